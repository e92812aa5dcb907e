"""`kiln convert | build | run | demo | bench | eval | serve` (and `kiln-build`, which takes trtllm-build's flags)."""
from __future__ import annotations

import argparse
import json
import sys
import time

from kiln.config import AutoParallelConfig, BuildConfig, ConvertConfig, LoraConfig, PluginConfig

from .args import HelpFormatter, add_dataclass_args, parse_bool, parse_with_suggestions, pick

DTYPES = ("auto", "float32", "bfloat16", "float16")
SKIP_CHECKSUM_HELP = "load the engine or Kiln checkpoint without verifying its files' checksums"
DEFAULT_MAX_NEW_TOKENS = 128


def _command(sub, name: str, summary: str, *examples: str) -> argparse.ArgumentParser:
    """A subcommand whose help shows its flags' defaults and ends with examples."""
    return sub.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter,
                          epilog=_examples(*examples))


def _examples(*examples: str) -> str:
    return "examples:\n" + "\n".join(f"  {e}" for e in examples)


def _convert_parser(sub) -> None:
    p = _command(sub, "convert", "Hugging Face model (dir or GGUF) → Kiln checkpoint",
                 "kiln convert --model_dir HF_DIR --output_dir CKPT --dtype bfloat16",
                 "kiln convert --model_dir HF_DIR --output_dir CKPT --use_weight_only --weight_only_precision int4_awq "
                 "--per_group",
                 "kiln convert --output_dir CKPT --vocab_size 1000 --n_layer 2 --n_head 4 --n_embd 64 --inter_size 128"
                 "   # random weights")
    p.add_argument("--model_dir", help="HF model directory or GGUF file; omitted: a random-weight model "
                                       "of the shape given by --vocab_size, --n_layer, ...")
    p.add_argument("--output_dir", required=True, help="checkpoint directory to write")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="weight dtype (auto: the model's own)")
    p.add_argument("--seed", type=int, default=0, help="seed of a random-weight model")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --output_dir even when it is not a Kiln checkpoint (its files are deleted)")
    p.set_defaults(fields=add_dataclass_args(p, ConvertConfig), handler=cmd_convert)


BUILD_SUMMARY = "Kiln checkpoint (or HF model, or YAML build file) → engine"
BUILD_EXAMPLES = ("--checkpoint_dir CKPT --output_dir ENGINE --max_batch_size 8 --max_input_len 512 --max_seq_len 1024",
                  "--model_dir HF_DIR --output_dir ENGINE --dtype bfloat16",
                  "--config docs/build.yaml   # model:, checkpoint: and build: sections in one file")


def add_build_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint_dir", help="Kiln checkpoint directory")
    src.add_argument("--model_dir", help="HF model directory or GGUF file (converted on the fly)")
    src.add_argument("--config", help="one YAML file with model:, checkpoint: and build: sections")
    p.add_argument("--output_dir", help="engine directory to write")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --output_dir even when it is not a Kiln engine (its files are deleted)")
    p.add_argument("--skip_checksum", action="store_true",
                   help="with --checkpoint_dir: load it without verifying its files' checksums")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="with --model_dir: weight dtype")
    p.add_argument("--gather_all_token_logits", nargs="?", const=True, type=parse_bool, default=False,
                   metavar="enable|disable", help="same as --gather_context_logits --gather_generation_logits")
    p.add_argument("--workers", type=int, default=1, help="ranks loaded and built at a time")
    p.add_argument("--auto_parallel", type=int, default=1,
                   help="split an unsharded model over this many GPUs, choosing tp and pp (it says why)")
    p.add_argument("--log_level", default="info", choices=("verbose", "info", "warning", "error", "internal_error"),
                   help="verbosity: warning and above print no build steps")
    p.set_defaults(build_fields=add_dataclass_args(p, BuildConfig), plugin_fields=add_dataclass_args(p, PluginConfig),
                   lora_fields=add_dataclass_args(p, LoraConfig), handler=cmd_build)


def _run_parser(sub) -> None:
    p = _command(sub, "run", "generate text with an engine (or any model Kiln can load)",
                 'kiln run --engine_dir ENGINE "What is the capital of France?"',
                 'kiln run --model_dir model.gguf --max_new_tokens 64 --temperature 0.7 --seed 1 "Tell me a joke."')
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine_dir", help="Kiln engine directory")
    src.add_argument("--model_dir", help="HF directory, GGUF file or Kiln checkpoint (built on the fly)")
    _generation_args(p)
    p.add_argument("--skip_checksum", action="store_true", help=SKIP_CHECKSUM_HELP)
    _speculative_args(p)
    p.add_argument("prompt", nargs="+", help="one or more prompts")
    p.set_defaults(handler=cmd_run)


def _speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative_method", choices=("ngram", "draft_model", "eagle"),
                   help="speculative decoding (lossless): ngram (prompt lookup), draft_model or eagle (both with "
                        "--speculative_model)")
    p.add_argument("--speculative_model", help="with --speculative_method draft_model: the draft model (engine, "
                                               "checkpoint, HF directory or GGUF file sharing the tokenizer); with "
                                               "eagle: the EAGLE head's directory")
    p.add_argument("--max_draft_len", type=int, default=4, help="with --speculative_method: draft tokens per step")
    p.add_argument("--max_matching_ngram_size", type=int, default=4,
                   help="with --speculative_method ngram: the longest suffix n-gram looked up")


def _speculative_config(args):
    """The SpeculativeConfig of --speculative_method and its flags (None without it; its flags alone are refused)."""
    from kiln.config import SpeculativeConfig

    if args.speculative_method is None:
        if args.speculative_model is not None:
            raise ValueError("--speculative_model needs --speculative_method draft_model or eagle")
        return None
    return SpeculativeConfig(method=args.speculative_method, max_draft_len=args.max_draft_len,
                             max_matching_ngram_size=args.max_matching_ngram_size,
                             min_matching_ngram_size=min(1, args.max_matching_ngram_size),
                             speculative_model=args.speculative_model)


def _generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max_new_tokens", type=int,
                   help="most tokens to generate per prompt (default: 128, or the engine's max_output_len if lower)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default: greedy)")
    p.add_argument("--top_k", type=int, help="sample among the k most likely tokens (default: all)")
    p.add_argument("--top_p", type=float, help="sample among the most likely tokens holding this much probability "
                                                "(default: all)")
    p.add_argument("--seed", type=int, help="random seed for sampling")
    p.add_argument("--no_chat_template", action="store_true", help="send the prompt as raw text")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")


def _demo_parser(sub) -> None:
    p = _command(sub, "demo", "import the embedded SmolLM2-135M-Instruct, convert, build, and chat",
                 "kiln demo", 'kiln demo --work_dir demo/ "Name three rivers in Europe."')
    p.add_argument("--work_dir", help="where the checkpoint and engine go (default: a temporary directory)")
    _generation_args(p)
    p.add_argument("prompt", nargs="*", default=["What is the capital of France? Answer in one sentence."],
                   help="one or more prompts")
    p.set_defaults(handler=cmd_demo)


def _bench_parser(sub) -> None:
    p = _command(sub, "bench", "throughput or latency of an engine (or a random-weight model of a real shape)",
                 "kiln bench latency --model smollm2-135m --num_requests 4 --input_len 32 --output_len 16",
                 "kiln bench throughput --model llama-3.1-8b --num_requests 2048 --input_len 128 --output_len 128",
                 "kiln bench throughput --engine_dir ENGINE --request_rate 20 --json")
    p.add_argument("mode", choices=("throughput", "latency"),
                   help="throughput: many requests at once (or at --request_rate); latency: one request at a time")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine_dir", help="a built engine")
    src.add_argument("--model", help="random weights of a named shape: llama-3.1-8b, llama-3.1-70b, mixtral-8x7b, "
                                     "smollm2-135m (built on the device in seconds)")
    p.add_argument("--dtype", choices=DTYPES[1:],
                   help="with --model: weight dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--quant_algo", help="with --model: quantize the random weights (W8A16, W4A16_AWQ, FP8, ...)")
    p.add_argument("--kv_cache_quant_algo", help="with --model: INT8 or FP8 KV cache")
    p.add_argument("--quantize_lm_head", action="store_true", help="with --model and --quant_algo: the LM head too")
    p.add_argument("--num_requests", type=int, default=512, help="throughput: requests (latency: iterations)")
    p.add_argument("--input_len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output_len", type=int, default=128, help="generated tokens per request")
    p.add_argument("--input_spread", type=float, default=0.0, help="input lengths drawn within ±spread×input_len")
    p.add_argument("--request_rate", type=float, help="requests per second (Poisson); default: all at once")
    p.add_argument("--max_batch_size", type=int, help="engine limit for --model builds (throughput default 512)")
    p.add_argument("--tp_size", type=int, default=1, help="with --model: tensor parallelism (one process per GPU)")
    p.add_argument("--pp_size", type=int, default=1, help="with --model: pipeline parallelism (one process per GPU)")
    p.add_argument("--enable_trt_overlap", action="store_true",
                   help="schedule and launch each step while the device runs the previous one")
    p.add_argument("--use_custom_all_reduce", action="store_true",
                   help="with --model and --tp_size: symmetric-memory all-reduce for small messages")
    p.add_argument("--use_fp8_context_fmha", action="store_true",
                   help="with --model and --kv_cache_quant_algo FP8: prompt attention's queries in e4m3 on the FP8 "
                        "tensor cores")
    p.add_argument("--device", help="cpu or cuda (default: cuda when a GPU is visible, else the CPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", help="write a PNG of per-request latencies (needs matplotlib)")
    p.add_argument("--baseline", choices=("hf",), help="also run transformers generate on the same shape")
    p.add_argument("--speculative", type=float, nargs="+", metavar="ALPHA",
                   help="also run with speculative decoding: an acceptance-controlled drafter proposes the model's "
                        "own greedy continuation with each token corrupted with probability 1 - ALPHA (one run per "
                        "ALPHA; the tokens must not change); with --model, the engine is built for --max_draft_len")
    p.add_argument("--max_draft_len", type=int, default=4, help="with --speculative: draft tokens per step")
    p.set_defaults(handler=cmd_bench)


def _eval_parser(sub) -> None:
    p = _command(sub, "eval", "evaluate an engine (or any model Kiln can load)",
                 "kiln eval ppl --engine_dir ENGINE --text tests/data/eval.txt",
                 "kiln eval ppl --model_dir model.gguf --text book.txt --window 1024")
    p.add_argument("metric", choices=("ppl",), help="ppl: perplexity on a text")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine_dir", help="Kiln engine directory")
    src.add_argument("--model_dir", help="HF directory, GGUF file or Kiln checkpoint (built on the fly)")
    p.add_argument("--text", required=True, help="a UTF-8 text file")
    p.add_argument("--window", type=int, default=512, help="tokens per scored window")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.set_defaults(handler=cmd_eval)


def _serve_parser(sub) -> None:
    from kiln.config import KvCacheConfig, LoraCacheConfig

    p = _command(sub, "serve", "an OpenAI-compatible HTTP server (needs the serve extra: kiln[serve])",
                 "kiln serve ENGINE --port 8000 --api_key SECRET",
                 "kiln serve model.gguf --host 0.0.0.0 --served_model_name smollm2 --enable_chunked_context",
                 "kiln serve ENGINE --api_key SECRET --lora_modules sql=adapters/sql-lora chat=adapters/chat-lora")
    p.add_argument("model", help="engine directory, Kiln checkpoint, HF directory or GGUF file")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served_model_name", "--served-model-name",
                   help="model id clients use (default: the model's file or directory name)")
    p.add_argument("--api_key", "--api-key", help="bearer token every /v1 route requires (default: $KILN_API_KEY)")
    p.add_argument("--max_queue", "--max-queue", type=int, default=64,
                   help="requests that may wait beyond the engine's max_batch_size; more get 429")
    p.add_argument("--max_body_bytes", "--max-body-bytes", type=int, default=4 * 2**20,
                   help="largest request body; larger ones get 413")
    p.add_argument("--body_timeout", "--body-timeout", type=float, default=30.0,
                   help="seconds a client has to send its whole request body; slower ones get 408")
    p.add_argument("--shutdown_timeout", "--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM/SIGINT before they are aborted")
    p.add_argument("--log_prompts", "--log-prompts", action="store_true", help="put prompt text in the log lines")
    p.add_argument("--lora_modules", "--lora-modules", nargs="+", type=_lora_module, metavar="NAME=PATH",
                   help="LoRA adapters (Hugging Face PEFT directories) served by name: a request whose model is NAME "
                        "runs under that adapter; each is checked at start-up. Adapters stored in the engine are "
                        "served by their names too")
    p.add_argument("--enable_chunked_context", action="store_true",
                   help="split prompts longer than the engine's max_num_tokens over several steps")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--kv_cache_max_tokens", type=int, help="most tokens the KV cache holds (default: from memory)")
    p.add_argument("--skip_checksum", action="store_true", help=SKIP_CHECKSUM_HELP)
    _speculative_args(p)
    p.set_defaults(kv_fields=add_dataclass_args(p, KvCacheConfig, skip=("max_tokens",)),
                   lora_cache_fields=add_dataclass_args(p, LoraCacheConfig), handler=cmd_serve)


def _lora_module(text: str) -> tuple[str, str]:
    """--lora_modules NAME=PATH → (name, path)."""
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH (an adapter's name and its directory)")
    return name, path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="Kiln: build fast LLM inference engines and run them.",
                                formatter_class=HelpFormatter,
                                epilog="`kiln COMMAND --help` lists the command's flags with their defaults and "
                                       "examples.\n\n" + _examples(
                                           "kiln demo", "kiln convert --model_dir HF_DIR --output_dir CKPT",
                                           "kiln build --checkpoint_dir CKPT --output_dir ENGINE",
                                           'kiln run --engine_dir ENGINE "What is the capital of France?"'))
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _convert_parser(sub)
    add_build_args(_command(sub, "build", BUILD_SUMMARY, *(f"kiln build {e}" for e in BUILD_EXAMPLES)))
    _run_parser(sub)
    _demo_parser(sub)
    _bench_parser(sub)
    _eval_parser(sub)
    _serve_parser(sub)
    return p


def cmd_convert(args) -> None:
    from kiln.checkpoint.io import CHECKPOINT_FORMAT
    from kiln.convert import convert_checkpoint

    convert = ConvertConfig(**pick(args, args.fields))
    _check_output_dir(args.output_dir, CHECKPOINT_FORMAT, args.overwrite, args.model_dir)
    convert_checkpoint(args.model_dir, args.output_dir, args.dtype, convert, args.seed, args.overwrite)
    world = convert.tp_size * convert.pp_size
    how = ", read by shard" if convert.load_by_shard and world > 1 else ""
    print(f"checkpoint written to {args.output_dir} ({world} rank(s){how})")


def _check_output_dir(output_dir: str, kiln_format: str, overwrite: bool, source: str | None) -> None:
    """Before any work: the output may replace only an empty directory or a Kiln output of its kind (else
    --overwrite), and never the input."""
    from kiln.utils.fs import check_output_dir

    check_output_dir(output_dir, kiln_format, overwrite, [source] if source else [])


def build_config_from_args(args) -> BuildConfig:
    fields = pick(args, args.build_fields)
    if args.gather_all_token_logits:
        fields.update(gather_context_logits=True, gather_generation_logits=True)
    build_config = BuildConfig(**fields, plugin_config=PluginConfig(**pick(args, args.plugin_fields)),
                               lora_config=LoraConfig(**pick(args, args.lora_fields)))
    if args.auto_parallel > 1:
        build_config.auto_parallel_config = AutoParallelConfig(enabled=True, tp_size=args.auto_parallel)
    return build_config


def cmd_build(args) -> None:
    from kiln.models import LlamaForCausalLM

    quiet = args.log_level in ("warning", "error", "internal_error")
    workers = args.workers
    _check_build_output(args)
    verify = not args.skip_checksum
    if args.config:
        engine, build_config, output_dir = _from_build_file(args, quiet)
    else:
        build_config, output_dir = build_config_from_args(args), args.output_dir
        if args.checkpoint_dir:
            from kiln.checkpoint import load_checkpoint_config

            world = load_checkpoint_config(args.checkpoint_dir).mapping.world_size
            if world > 1:
                from kiln.builder import build_all_ranks

                if build_config.auto_parallel_config.enabled:
                    raise ValueError(f"{args.checkpoint_dir} is already sharded ({world} ranks): drop --auto_parallel")
                engine = build_all_ranks(
                    lambda rank: LlamaForCausalLM.from_checkpoint(args.checkpoint_dir, rank, verify, lazy=True),
                    world, build_config, quiet, workers)
                _finish_build(engine, build_config, output_dir, quiet, args.overwrite)
                return
            model = LlamaForCausalLM.from_checkpoint(args.checkpoint_dir, verify=verify, lazy=True)
        else:
            model = LlamaForCausalLM.from_hugging_face(args.model_dir, args.dtype, quiet=quiet, lazy=True)
        engine = _build_model(model, build_config, 1, 1, quiet, workers)
    _finish_build(engine, build_config, output_dir, quiet, args.overwrite)


def _check_build_output(args) -> None:
    """--output_dir (or the YAML file's model.output_dir) is given and may be written, checked before the minutes
    of loading and building; --skip_checksum only where there is a checkpoint to verify."""
    if args.skip_checksum and not args.checkpoint_dir:
        raise ValueError("--skip_checksum applies to --checkpoint_dir (HF directories and GGUF files have no Kiln "
                         "checksums)")
    if args.config:
        from kiln.config import load_build_file

        spec = load_build_file(args.config)
        output_dir, dry_run, source = spec.model.output_dir, spec.build.dry_run, spec.model.model_dir
    else:
        output_dir, dry_run = args.output_dir, getattr(args, "dry_run", False)
        source = args.checkpoint_dir or args.model_dir
    if dry_run:
        return
    if not output_dir:
        raise ValueError("--output_dir is required (or model.output_dir in the YAML file)")
    from kiln.builder.engine import ENGINE_FORMAT

    _check_output_dir(output_dir, ENGINE_FORMAT, args.overwrite, source)


def _build_model(model, build_config: BuildConfig, tp: int, pp: int, quiet: bool, workers: int):
    """One engine, sharded when asked for (tp/pp, or auto_parallel)."""
    from kiln.builder import build, build_auto_parallel, build_sharded

    if build_config.auto_parallel_config.enabled:
        if tp * pp > 1:
            raise ValueError("give either the checkpoint's tp_size/pp_size or auto_parallel, not both")
        auto = build_config.auto_parallel_config
        return build_auto_parallel(model, build_config, auto.world_size, auto.max_memory_MB * 2**20, quiet, workers)
    if tp * pp > 1:
        return build_sharded(model, build_config, tp, pp, quiet, workers)
    timing = (build_config.input_timing_cache, build_config.output_timing_cache)
    build_config.input_timing_cache = build_config.output_timing_cache = None   # handled below, on the GPU
    engine = build(model, build_config, quiet=quiet)
    build_config.input_timing_cache, build_config.output_timing_cache = timing
    return engine


def _finish_build(engine, build_config, output_dir, quiet: bool, overwrite: bool) -> None:
    if engine.pretrained_config.mapping.world_size == 1:
        _compile_gpu_kernels(engine, quiet)
    if engine.save(output_dir, overwrite) is not None:
        print(f"engine written to {output_dir} (hash {engine.hash[:16]})")


def _compile_gpu_kernels(engine, quiet: bool) -> None:
    """On a GPU, compile the engine's kernels now and store them in it (and in output_timing_cache)."""
    import torch

    build = engine.build_config
    if not torch.cuda.is_available():
        if build.input_timing_cache or build.output_timing_cache:
            raise ValueError("--input_timing_cache/--output_timing_cache need a GPU: kernels are compiled there")
        return
    if build.dry_run:
        return
    from kiln.runtime.precompile import compile_kernels

    start = time.perf_counter()
    count = compile_kernels(engine)
    if not quiet:
        print(f"Build: compiled {count} GPU kernels for the engine's shapes in {time.perf_counter() - start:.1f} s",
              file=sys.stderr)


def _from_build_file(args, quiet: bool):
    """(engine, build config, output dir) of a build YAML: the model converted as its checkpoint: section says
    (random weights of its shape without model_dir, quantized by its flags; read by shard with load_by_shard)."""
    from kiln.builder import build_all_ranks
    from kiln.config import Mapping, load_build_file
    from kiln.convert import convert as convert_model, rank_reader

    given = list(pick(args, args.build_fields + args.plugin_fields + args.lora_fields))
    given += [f"--{n}" for n, default in (("output_dir", None), ("dtype", "auto"), ("gather_all_token_logits", False))
              if getattr(args, n) != default]
    if given:
        raise ValueError(f"--config takes every setting from the YAML file; remove {given[0]}")
    spec = load_build_file(args.config)
    convert, model_dir, build_config = spec.checkpoint, spec.model.model_dir, spec.build
    if convert.save_config_only:
        raise ValueError(f"{args.config}: checkpoint.save_config_only writes a checkpoint's config.json (kiln "
                         "convert); a build file builds an engine (build.dry_run builds without writing)")
    mapping = Mapping(convert.tp_size * convert.pp_size, 0, convert.tp_size, convert.pp_size)
    if convert.load_by_shard and mapping.world_size > 1 and model_dir:
        if build_config.auto_parallel_config.enabled:
            raise ValueError("give either the checkpoint's tp_size/pp_size or auto_parallel, not both")
        engine = build_all_ranks(rank_reader(model_dir, spec.model.dtype, convert, quiet, lazy=True),
                                 mapping.world_size, build_config, quiet, convert.workers)
        return engine, build_config, spec.model.output_dir
    model = convert_model(model_dir, spec.model.dtype, convert, quiet=quiet)
    engine = _build_model(model, build_config, convert.tp_size, convert.pp_size, quiet, convert.workers)
    return engine, build_config, spec.model.output_dir


def _sampling(args, max_output_len: int):
    from kiln import SamplingConfig

    max_new_tokens = args.max_new_tokens or min(DEFAULT_MAX_NEW_TOKENS, max_output_len)
    return SamplingConfig(max_new_tokens=max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, random_seed=args.seed)


def _chat(llm, args) -> None:
    use_template = not args.no_chat_template and llm.tokenizer is not None and getattr(llm.tokenizer, "chat_template", None)
    prompts = []
    for text in args.prompt:
        if use_template:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": text}]
            prompts.append(llm.apply_chat_template(messages))
        else:
            prompts.append(text)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, _sampling(args, llm.build_config.max_output_len))
    elapsed = time.perf_counter() - t0
    for text, out in zip(args.prompt, outputs):
        print(f"> {text}\n{out.text.strip()}\n")
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"[{tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tok/s]", file=sys.stderr)


def cmd_run(args) -> None:
    from kiln import LLM

    _chat(LLM(args.engine_dir or args.model_dir, device=args.device, skip_checksum=args.skip_checksum,
              speculative_config=_speculative_config(args)), args)


def cmd_demo(args) -> None:
    import tempfile
    from pathlib import Path

    from kiln import LLM, BuildConfig, build
    from kiln.builder.engine import ENGINE_FORMAT
    from kiln.checkpoint.io import CHECKPOINT_FORMAT
    from kiln.models import LlamaForCausalLM
    from kiln.utils.default_model import default_model_path

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        _check_output_dir(work / "checkpoint", CHECKPOINT_FORMAT, False, None)
        _check_output_dir(work / "engine", ENGINE_FORMAT, False, None)
        gguf = default_model_path()
        print(f"1. import {gguf.name} (embedded default model)", file=sys.stderr)
        LlamaForCausalLM.from_hugging_face(gguf).save_checkpoint(work / "checkpoint")
        print(f"2. convert → {work / 'checkpoint'}; build the engine", file=sys.stderr)
        model = LlamaForCausalLM.from_checkpoint(work / "checkpoint")
        build(model, BuildConfig(max_batch_size=8, max_input_len=1024, max_seq_len=2048)).save(work / "engine")
        print(f"3. run the engine {work / 'engine'}", file=sys.stderr)
        _chat(LLM(work / "engine", device=args.device), args)


def cmd_eval(args) -> None:
    from pathlib import Path

    import torch

    from kiln.evaluate import perplexity
    from kiln.llm import load_engine
    from kiln.tokenizer import load_tokenizer

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    path = Path(args.text)
    if not path.is_file():
        raise FileNotFoundError(f"text file {str(path)!r} does not exist")
    engine = load_engine(args.engine_dir or args.model_dir, device=device)
    tokenizer = load_tokenizer(engine.tokenizer_files)
    if tokenizer is None:
        raise ValueError("the engine has no tokenizer to turn the text into tokens")
    ppl, count = perplexity(engine, tokenizer.encode(path.read_text()), device, args.window, quiet=False)
    print(f"perplexity {ppl:.4f} over {count} tokens ({path.name})")


def cmd_serve(args) -> None:
    import os
    from pathlib import Path

    try:
        from kiln.server import ServerConfig
        from kiln.server.run import serve
    except ImportError as err:
        raise ValueError(f"kiln serve needs the serve extra ({err.name} is missing): pip install 'kiln[serve]'") from None
    from kiln import LLM, KvCacheConfig, LoraCacheConfig

    api_key = args.api_key if args.api_key is not None else os.environ.get("KILN_API_KEY")   # "" is refused
    names = [name for name, _ in args.lora_modules or []]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"--lora_modules names {twice[0]!r} twice")
    config = ServerConfig(model_name=args.served_model_name or Path(args.model).name, api_key=api_key,
                          max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                          body_timeout=args.body_timeout, log_prompts=args.log_prompts,
                          lora_modules=dict(args.lora_modules or []))
    kv_cache = KvCacheConfig(**{"enable_block_reuse": True, "max_tokens": args.kv_cache_max_tokens,
                                **pick(args, args.kv_fields)})
    llm = LLM(args.model, kv_cache_config=kv_cache, enable_chunked_context=args.enable_chunked_context,
              device=args.device, skip_checksum=args.skip_checksum,
              lora_cache_config=LoraCacheConfig(**pick(args, args.lora_cache_fields)),
              speculative_config=_speculative_config(args))
    serve(llm, config, args.host, args.port, args.shutdown_timeout)


def cmd_bench(args) -> None:
    import torch

    from kiln import LLM, Engine
    from kiln import benchmark as bench

    device, model_dtype = _bench_device(args)
    if args.engine_dir and args.tp_size * args.pp_size > 1:
        raise ValueError("--tp_size/--pp_size apply to --model; a built engine carries its own parallelism")
    if args.engine_dir:
        engine = Engine.from_dir(args.engine_dir, device=device)
        name, dtype = args.engine_dir, engine.pretrained_config.dtype
    else:
        from kiln.config import QuantConfig, excluded_modules

        build_config = bench.default_bench_build(args.mode, args.input_len, args.output_len, args.max_batch_size)
        build_config.plugin_config.use_custom_all_reduce = args.use_custom_all_reduce
        build_config.plugin_config.use_fp8_context_fmha = args.use_fp8_context_fmha
        build_config.max_draft_len = args.max_draft_len if args.speculative else 0
        if args.quantize_lm_head and not args.quant_algo:
            raise ValueError("--quantize_lm_head needs --quant_algo (the LM head is quantized like the other layers)")
        quant_config = QuantConfig(quant_algo=args.quant_algo, kv_cache_quant_algo=args.kv_cache_quant_algo,
                                   exclude_modules=excluded_modules(args.quantize_lm_head))
        engine = bench.random_engine(args.model, model_dtype, build_config, device=str(device), quant_config=quant_config,
                                     tp_size=args.tp_size, pp_size=args.pp_size)
        name, dtype = args.model, model_dtype
    hw = bench.Hardware.measure(device, getattr(torch, dtype))
    with LLM(engine, kv_cache_config=bench.default_kv_config(), device=device, quiet=args.json,
             enable_trt_overlap=args.enable_trt_overlap) as llm:
        vocab = engine.pretrained_config.vocab_size
        if args.mode == "latency":
            outputs, elapsed = [], 0.0
            for i, prompt in enumerate(bench.random_prompts(1 + args.num_requests, args.input_len, vocab)):
                out, seconds = bench.run_requests(llm, [prompt], args.output_len)
                if i:                                        # the first request warms up
                    outputs += out
                    elapsed += seconds
            result = bench.summarize("latency", name, dtype, outputs, elapsed, args.input_len, args.output_len)
            bench.decode_limit_pct(result, engine, hw)
        else:
            bench.warm_up(llm, args.input_len, args.output_len, vocab, engine.build_config.max_batch_size,
                          args.num_requests)
            prompts = bench.random_prompts(args.num_requests, args.input_len, vocab, spread=args.input_spread)
            outputs, elapsed = bench.run_requests(llm, prompts, args.output_len, args.request_rate)
            result = bench.summarize("throughput", name, dtype, outputs, elapsed, args.input_len, args.output_len)
            bench.throughput_limit_pct(result, engine, hw)
        if args.speculative:
            _bench_speculative(llm, args, vocab, engine.build_config.max_batch_size)
    print(bench.to_json(result) if args.json else result.table())
    if args.plot:
        _plot(outputs, args.plot)
    if args.baseline == "hf":
        del engine, llm
        if args.engine_dir:
            raise ValueError("--baseline hf needs --model (a named shape)")
        batch = 1 if args.mode == "latency" else min(args.num_requests, 64)
        base = bench.hf_baseline(args.model, model_dtype, batch, args.input_len, args.output_len, str(device))
        print(json.dumps(base) if args.json else f"transformers baseline (batch {batch}): "
                                                 f"{base['output_tok_s']:,.1f} output tok/s")


def _bench_speculative(llm, args, vocab: int, max_batch: int) -> None:
    """Output tok/s of a batch of greedy requests without drafts and with the acceptance-controlled drafter at each
    --speculative ALPHA (batch 1 in latency mode), one JSON line each."""
    from kiln import benchmark as bench

    count = 1 if args.mode == "latency" else min(args.num_requests, max_batch)
    prompts = bench.random_prompts(count, args.input_len, vocab, seed=7)
    plain = None
    for alpha, outputs, seconds, same in bench.speculative_runs(llm, prompts, args.output_len, args.speculative,
                                                                args.max_draft_len):
        rate = sum(len(o.token_ids) for o in outputs) / seconds
        plain = plain or rate
        stats = {"draft_acceptance": alpha, "batch": count, "max_draft_len": args.max_draft_len,
                 "output_tok_s": round(rate, 1), "speedup": round(rate / plain, 2), "same_tokens": round(same, 3)}
        print(json.dumps(stats))


def _bench_device(args):
    """(device, dtype of a --model engine): a GPU in bfloat16 when one is visible, else the CPU in float32 (said
    in one line); a --device or --dtype given is kept."""
    from kiln import benchmark as bench

    device = bench.choose_device(args.device)
    if args.engine_dir and args.dtype:
        raise ValueError("--dtype applies to --model; a built engine keeps the dtype it was built in")
    model_only = [f"--{name}" for name in ("quant_algo", "kv_cache_quant_algo", "quantize_lm_head", "max_batch_size",
                                           "use_custom_all_reduce", "use_fp8_context_fmha") if getattr(args, name)]
    if args.engine_dir and model_only:
        raise ValueError(f"{', '.join(model_only)} apply to --model builds; a built engine keeps what it was "
                         "built with")
    dtype = args.dtype or bench.default_dtype(device)
    if args.device is None and device.type == "cpu":
        print(f"kiln bench: no CUDA GPU is visible: running on the CPU{'' if args.engine_dir else ' in ' + dtype}",
              file=sys.stderr)
    return device, dtype


def _plot(outputs, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    ttft = sorted(o.metrics.time_to_first_token * 1e3 for o in outputs)
    e2e = sorted(o.metrics.e2e_latency * 1e3 for o in outputs)
    fig, ax = plt.subplots(figsize=(6, 4))
    for values, label in ((ttft, "time to first token"), (e2e, "end-to-end latency")):
        ax.plot(values, [i / len(values) for i in range(len(values))], label=label)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.legend()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    """`kiln-build`: `kiln build` under trtllm-build's name (it accepts trtllm-build's flags)."""
    p = argparse.ArgumentParser(prog="kiln-build", description=f"{BUILD_SUMMARY} (kiln build, with trtllm-build's "
                                "flag names)", formatter_class=HelpFormatter,
                                epilog=_examples(*(f"kiln-build {e}" for e in BUILD_EXAMPLES)))
    add_build_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return _run(parser(), argv)


def build_main(argv: list[str] | None = None) -> int:
    """`kiln-build`: trtllm-build's interface."""
    return _run(build_parser(), argv)


def _run(p: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = parse_with_suggestions(p, argv)
    try:
        args.handler(args)
    except (ValueError, FileNotFoundError, NotADirectoryError) as err:
        print(f"{' '.join(filter(None, (p.prog, getattr(args, 'command', None))))}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
