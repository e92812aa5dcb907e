"""One GPU, one run: Kiln's GPU tests, then the measurements of docs/performance.md on a model shape (--model:
llama-3.1-8b by default, mixtral-8x7b, llama-3.1-70b; random weights of the real shape, made on the GPU a layer at
a time). Each result prints as it comes; all of them go to $OUT/suite.json
(OUT defaults to /tmp).

    python benchmarks/gpu_suite.py --phases checks,latency,throughput,load,quant,lora [--model M] [--quick] [--profile]

Needs Kiln installed (`pip install -e .`, as the README says) and a CUDA GPU. Phases (every run starts with the
GPU, torch and Triton versions and the measured copy and GEMM rates):
  checks      pytest -m gpu over --test_paths (the Triton kernels against the torch reference, graphs against
              eager steps, quantized models against the CPU path)
  latency     bf16 batch-1 decode (128 prompt tokens, 128 new): tok/s, time to first token, % of the limit (of an
              MoE, the active weights: the experts a token is routed to)
  throughput  output tok/s (bf16, or --throughput_mode) at 128/128 over --requests requests, overlapped steps; with
              2048/128, 128/2048 and 2048/2048 (--long_requests requests each) too unless --quick (or --shapes)
  load        build an engine (--load_mode), compile its kernels into it, save it; then a fresh process loads it and produces
              a first token (twice: first with the engine's files dropped from the page cache, then warm),
              reporting the kernels compiled at load (0: the engine carried them all)
  quant       batch-1 decode per mode of --latency_modes (bf16, W4A16_AWQ, W8A16, ...; +lm_head quantizes the LM
              head too), then FP8 128/128 throughput (FP8 weights and KV cache, FP8 LM head) unless --quick
  lora        8 random adapters of rank 16 on all seven projections, on an engine with lora_plugin (bf16): batch-1
              decode with one adapter and without, 128/128 throughput over --requests requests spread evenly over
              the 8 and without adapters, and the adapter switch (an adapter in host memory put into a device slot)
  context_attention  causal prompt attention TFLOP/s at 1k..32k tokens, GQA 8:1, bf16 and FP8 caches (fp8q: FP8
              queries too, use_fp8_context_fmha): Kiln's kernel (a few tile choices) beside torch's SDPA flash
              backend and varlen flash attention; --context_seqs N attends N sequences of each length together,
              as a prompt step does (--context_kv_heads 8: Llama-3.1-8B's GQA 4:1)
  fp8_decode  FP8 products of 1 and 8 rows (the 8B and 70B projections, the 8B LM head): torch._scaled_mm beside
              fp8_decode on the engine's tile and on the alternatives of FP8_DECODE_SWEEP, µs and TB/s of weights
  sparsity    2:4 sparse GEMMs (the runtime's cached cuSPARSELt plans, torch's semi-structured calls) beside dense,
              the 8B projections at 2048 tokens, bf16, timed back to back and in CUDA graphs (--sparsity_sweep: also
              cuSPARSELt's algorithm × split-K swept)
  speculative the acceptance-controlled drafter (the model's greedy continuation, each token corrupted with
              probability 1 - alpha), k = 4, bf16: batch-1 tok/s at alpha 0.5..1.0 against decoding without drafts,
              and batch 64 (128/128) with drafts at alpha 0.8 and without
--profile writes torch profiler tables to $OUT: the latency and quant phases' decode steps, and after each throughput run
a batch of --max_batch prompts generating 8 tokens.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

from kiln import LLM, SamplingConfig
from kiln import benchmark as bench
from kiln.config import BuildConfig, QuantConfig, excluded_modules

RESULTS: dict = {}
OUT = os.environ.get("OUT", "/tmp")


def log(key, value):
    RESULTS[key] = value
    with open(os.path.join(OUT, "suite.jsonl"), "a") as f:          # kept if the run is cut short
        f.write(json.dumps({key: value}, default=str) + "\n")
    print(f"{key:48s} {json.dumps(value) if not isinstance(value, str) else value}", flush=True)


def phase(fn):
    """A phase that logs its failure and its duration: one failing phase must not hide the others."""
    def run(args):
        start = time.time()
        try:
            fn(args)
        except Exception:  # noqa: BLE001 - reported, and the next phase runs
            log(f"{fn.__name__}_error", traceback.format_exc()[-2000:])
        log(f"{fn.__name__}_seconds", round(time.time() - start, 1))
        gc.collect()
        torch.cuda.empty_cache()
    return run


@phase
def env(args):
    import triton

    log("gpu", torch.cuda.get_device_name(0))
    log("torch", torch.__version__)
    log("triton", triton.__version__)
    for setting in filter(None, args.tuning.split(";")):
        set_tuning(setting)
    hw = args.hw = bench.Hardware.measure(torch.device("cuda"))        # once: the limits of every phase
    log("copy_TBps", round(hw.copy_bytes_per_s / 1e12, 2))
    log("gemm_TFLOPs", round(hw.gemm_flops / 1e12, 1))


def set_tuning(setting: str) -> None:
    """NAME=VALUE: kiln/kernels/triton/tuning.py's NAME set to VALUE (a Python literal: 32, None, True) for this run."""
    import ast

    from kiln.kernels.triton import tuning

    name, _, value = setting.partition("=")
    if not hasattr(tuning, name):
        raise SystemExit(f"--tuning {setting}: kiln/kernels/triton/tuning.py has no {name}")
    setattr(tuning, name, ast.literal_eval(value))
    log(f"tuning_{name}", getattr(tuning, name))


@phase
def checks(args):
    path = os.path.join(OUT, "gpu_tests.txt")
    with open(path, "w") as f:                     # written as it runs: kept if the tests run out of time
        try:
            rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", *args.test_paths.split(","),
                                 "-p", "no:cacheprovider"], stdout=f, stderr=subprocess.STDOUT,
                                timeout=args.test_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    with open(path) as f:
        log("gpu_tests_tail", f.read()[-3000:])
    log("gpu_tests_rc", rc)


def _ready_llm(args, key: str, mode: str, input_len: int, output_len: int, max_batch: int,
               quant: QuantConfig | None = None, lora: bool = False, max_draft_len: int = 0, **kwargs) -> LLM:
    """A random engine of args.model's shape, loaded: its weights made on the GPU a layer at a time, kernels
    compiled, graphs captured (`lora`: with its LoRA adapter slots reserved). Logs the seconds from nothing to the
    ready LLM."""
    start = time.time()
    build = bench.default_bench_build(mode, input_len, output_len, max_batch)
    if args.max_num_tokens and mode == "throughput":
        build.max_num_tokens = max(input_len, args.max_num_tokens)
    build.plugin_config.use_fp8_context_fmha = args.use_fp8_context_fmha
    if lora:
        build.plugin_config.lora_plugin = "auto"
    build.max_draft_len = max_draft_len
    engine = bench.random_engine(args.model, "bfloat16", build, quant_config=quant)
    llm = LLM(engine, kv_cache_config=bench.default_kv_config(), device="cuda", quiet=True, **kwargs)
    log(f"{key}_engine_ready_s", round(time.time() - start, 1))
    return llm


def _decode(llm, model: str, prompts: int, new_tokens: int, dtype: str, lora=None):
    """Batch-1 decode over `prompts` prompts of 128 tokens, one at a time, the first a warm-up (under the LoRA
    adapter `lora` where given)."""
    outputs, elapsed = [], 0.0
    for i, prompt in enumerate(bench.random_prompts(prompts, 128, llm.engine.pretrained_config.vocab_size)):
        out, seconds = bench.run_requests(llm, [prompt], new_tokens, loras=[lora] if lora else None)
        if i:
            outputs += out
            elapsed += seconds
    return bench.summarize("latency", model, dtype, outputs, elapsed, 128, new_tokens)


@phase
def latency(args):
    with _ready_llm(args, "latency", "latency", 128, 128, 1) as llm:
        result = _decode(llm, args.model, 4, 128, "bfloat16")
        bench.decode_limit_pct(result, llm.engine, args.hw)
        log("latency_bs1_decode_tok_s", round(1e3 / result.tpot_ms["p50"], 1))
        log("latency_bs1_ttft_ms", round(result.ttft_ms["p50"], 1))
        log("latency_pct_of_roofline", round(result.hardware_limit_pct or 0, 1))
        log("latency_limit", result.limit_note)
        if args.profile:
            _profile_steps(llm, "latency", bench.random_prompts(1, 128, llm.engine.pretrained_config.vocab_size,
                                                                 seed=5), 16)


def _profile_steps(llm, name: str, prompts: list[list[int]], new_tokens: int, loras: list | None = None) -> None:
    """A torch profiler table (CUDA time per kernel) of `prompts` generated together (prompt i under the LoRA
    adapter loras[i % len(loras)] where given), written to $OUT."""
    from torch.profiler import ProfilerActivity, profile

    lora_request = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, SamplingConfig(max_new_tokens=new_tokens, end_id=-1), lora_request=lora_request)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    with open(os.path.join(OUT, f"profile_{name}.txt"), "w") as f:
        f.write(table)
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(table[:3000])


def _throughput(args, key: str, input_len: int, output_len: int, num: int, max_batch: int,
                quant: QuantConfig | None = None) -> None:
    """Output tok/s (and latencies, steps, memory) of `num` requests submitted at once, overlapped steps."""
    with _ready_llm(args, key, "throughput", input_len, output_len, max_batch, quant, enable_trt_overlap=True) as llm:
        vocab = llm.engine.pretrained_config.vocab_size
        start = time.perf_counter()
        bench.warm_up(llm, input_len, output_len, vocab, max_batch, num)
        torch.cuda.synchronize()
        log(f"{key}_warm_up_s", round(time.perf_counter() - start, 1))    # a run takes engine + warm-up + measured
        outputs, elapsed = bench.run_requests(llm, bench.random_prompts(num, input_len, vocab), output_len)
        result = bench.summarize("throughput", args.model, "bfloat16", outputs, elapsed, input_len, output_len)
        bench.throughput_limit_pct(result, llm.engine, args.hw)
        log(f"{key}_out_tok_s", round(result.output_tok_s, 1))
        log(f"{key}_measured_s", round(elapsed, 1))
        log(f"{key}_pct_of_gemm_limit", round(result.hardware_limit_pct or 0, 1))
        log(f"{key}_ttft_p50_ms", round(result.ttft_ms.get("p50", 0), 1))
        log(f"{key}_tpot_p50_ms", round(result.tpot_ms.get("p50", 0), 2))
        log(f"{key}_steps_per_s", round(llm.stats()["steps"] / elapsed, 1))
        log(f"{key}_peak_mem_gib", round(result.peak_memory_gib, 1))
        if args.profile:
            _profile_steps(llm, key, bench.random_prompts(max_batch, input_len, vocab, seed=5), 8)


@phase
def throughput(args):
    shapes = [(128, 128)] if args.quick else [(128, 128), (2048, 128), (128, 2048), (2048, 2048)]
    if args.shapes:
        shapes = [tuple(int(n) for n in shape.split("/")) for shape in args.shapes.split(",")]
    mode = args.throughput_mode
    for input_len, output_len in shapes:
        num = args.requests if (input_len, output_len) == (128, 128) else args.long_requests
        key = f"throughput_{'' if mode == 'bf16' else mode + '_'}{input_len}_{output_len}_b{args.max_batch}" + (
            f"_t{args.max_num_tokens}" if args.max_num_tokens else "")
        _throughput(args, key, input_len, output_len, num, args.max_batch, None if mode == "bf16" else mode_quant(mode))
        gc.collect()
        torch.cuda.empty_cache()


def _time_steps(llm) -> list:
    """From now on, each step of llm's runner as (tokens, whether a CUDA graph ran it, CUDA events around it) in
    the returned list (clear it to restart); _step_summary reads it."""
    runner, steps = llm.core.runner, []
    run_step, replay, replayed = runner.run_step, runner.graphs.run, [False]

    def counted(*args, **kwargs):
        replayed[0] = True
        return replay(*args, **kwargs)

    def timed(step, fill=None):
        replayed[0] = False
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = run_step(step, fill)
        end.record()
        steps.append((len(step.input_ids), replayed[0], begin, end))
        return out

    runner.graphs.run, runner.run_step = counted, timed
    return steps


def _step_summary(key: str, steps: list, elapsed: float) -> None:
    """Log the device time of graph and eager steps, and the rest of `elapsed` (host time the GPU waited)."""
    torch.cuda.synchronize()
    for kind, graph in (("graph", True), ("eager", False)):
        mine = [(n, b.elapsed_time(e)) for n, g, b, e in steps if g == graph]
        log(f"{key}_{kind}_steps", len(mine))
        log(f"{key}_{kind}_tokens", sum(n for n, _ in mine))
        log(f"{key}_{kind}_ms", round(sum(ms for _, ms in mine), 1))
    span = steps[-1][2].elapsed_time(steps[-1][3]) + steps[0][2].elapsed_time(steps[-1][2]) if steps else 0.0
    log(f"{key}_first_to_last_step_ms", round(span, 1))
    log(f"{key}_elapsed_ms", round(1e3 * elapsed, 1))


@phase
def lora(args):
    from kiln import LoraCacheConfig

    config = bench.shape_config(args.model, "bfloat16")
    workdir = tempfile.TemporaryDirectory(prefix="kiln-lora-", dir=args.work_dir)
    adapters = bench.random_adapters(config, workdir.name, 9, 16)
    cache = LoraCacheConfig(max_loras=8, max_cpu_loras=9)
    with _ready_llm(args, "lora_latency", "latency", 128, 128, 1, lora=True, lora_cache_config=cache) as llm:
        base = _decode(llm, args.model, 4, 128, "bfloat16")
        with_adapter = _decode(llm, args.model, 4, 128, "bfloat16", lora=adapters[0])
        log("lora_bs1_base_tok_s", round(1e3 / base.tpot_ms["p50"], 1))
        log("lora_bs1_adapter_tok_s", round(1e3 / with_adapter.tpot_ms["p50"], 1))
        log("lora_bs1_pct_of_base", round(100 * base.tpot_ms["p50"] / with_adapter.tpot_ms["p50"], 1))
        if args.profile:
            _profile_steps(llm, "lora_bs1", bench.random_prompts(1, 128, config.vocab_size, seed=5), 16, adapters[:1])
        manager = llm.core.runner.lora
        for adapter in adapters:
            manager.register(adapter)                       # read and laid out in host memory, as a request does
        times = []
        for i in range(16):                                 # each into a slot another adapter held
            torch.cuda.synchronize()
            start = time.perf_counter()
            manager.install(i % 8, adapters[(i + 1) % 9])
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        log("lora_switch_ms_p50", round(1e3 * sorted(times)[len(times) // 2], 2))
        log("lora_switch_ms_max", round(1e3 * max(times), 2))
    gc.collect()
    torch.cuda.empty_cache()
    with _ready_llm(args, "lora_throughput", "throughput", 128, 128, args.max_batch, lora=True,
                    lora_cache_config=cache, enable_trt_overlap=True) as llm:
        vocab = config.vocab_size
        bench.warm_up(llm, 128, 128, vocab, args.max_batch, args.requests)
        bench.run_requests(llm, bench.random_prompts(64, 128, vocab, seed=2), 8, loras=adapters[:8])   # warm
        rates, steps = {}, _time_steps(llm)
        for key, loras in (("base", None), ("adapters", adapters[:8])):
            torch.cuda.synchronize()
            steps.clear()
            outputs, elapsed = bench.run_requests(llm, bench.random_prompts(args.requests, 128, vocab), 128, loras=loras)
            rates[key] = bench.summarize("throughput", args.model, "bfloat16", outputs, elapsed, 128, 128).output_tok_s
            log(f"lora_throughput_128_128_{key}_out_tok_s", round(rates[key], 1))
            _step_summary(f"lora_throughput_{key}", steps, elapsed)
        log("lora_throughput_pct_of_base", round(100 * rates["adapters"] / rates["base"], 1))
        if args.profile:
            _profile_steps(llm, "lora", bench.random_prompts(args.max_batch, 128, vocab, seed=5), 8, adapters[:8])
            prompts = bench.random_prompts(args.max_batch // 2, 128, vocab, seed=6)
            _profile_steps(llm, "lora_decode_base", prompts, 48)
            _profile_steps(llm, "lora_decode_adapters", prompts, 48, adapters[:8])
    workdir.cleanup()


@phase
def speculative(args):
    """Speculative decoding with the acceptance-controlled drafter (k = 4): batch 1 at alpha 0.5..1.0 against
    decoding without drafts, then batch 64."""
    alphas = [0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    with _ready_llm(args, "spec_latency", "latency", 128, 256, 1, max_draft_len=4) as llm:
        vocab = llm.engine.pretrained_config.vocab_size
        bench.run_requests(llm, bench.random_prompts(1, 128, vocab, seed=9), 16)                      # warm
        prompts = bench.random_prompts(1, 128, vocab, seed=1)
        plain = None
        for alpha, outputs, seconds, same in bench.speculative_runs(llm, prompts, 256, alphas, 4):
            rate = sum(len(o.token_ids) for o in outputs) / seconds
            plain = plain or rate
            key = "spec_bs1_" + ("plain" if alpha is None else f"alpha_{alpha}")
            log(f"{key}_tok_s", round(rate, 1))
            if alpha is not None:
                log(f"{key}_speedup", round(rate / plain, 2))
                log(f"{key}_accepted", round(_mean(o.metrics.draft_acceptance_rate for o in outputs), 3))
                log(f"{key}_mean_length", round(_mean(o.metrics.mean_accepted_length for o in outputs), 2))
                log(f"{key}_same_tokens", round(same, 3))
    gc.collect()
    torch.cuda.empty_cache()
    with _ready_llm(args, "spec_batch64", "throughput", 128, 128, 64, max_draft_len=4) as llm:
        vocab = llm.engine.pretrained_config.vocab_size
        prompts = bench.random_prompts(64, 128, vocab, seed=3)
        bench.run_requests(llm, bench.random_prompts(64, 128, vocab, seed=4), 16)                     # warm
        for alpha, outputs, seconds, same in bench.speculative_runs(llm, prompts, 128, [0.8], 4):
            key = "spec_batch64_" + ("plain" if alpha is None else "alpha_0.8")
            log(f"{key}_out_tok_s", round(sum(len(o.token_ids) for o in outputs) / seconds, 1))
            if alpha is not None:
                log(f"{key}_accepted", round(_mean(o.metrics.draft_acceptance_rate for o in outputs), 3))
                log(f"{key}_same_tokens", round(same, 3))


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else 0.0


DROP_CACHE = """
import os, sys
def engine_files(folder):
    return [p for p in (os.path.join(folder, name) for name in os.listdir(folder)) if os.path.isfile(p)]
def drop_cache(folder):                       # the engine's files out of the page cache: a first read from disk
    for path in engine_files(folder):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
"""

DISK_CHILD = DROP_CACHE + """
import json, time
from concurrent.futures import ThreadPoolExecutor
CHUNK = 64 << 20
drop_cache(sys.argv[1])
paths = engine_files(sys.argv[1])
def read(job):
    path, offset = job
    with open(path, "rb", buffering=0) as f:
        return len(os.pread(f.fileno(), CHUNK, offset))
jobs = [(p, o) for p in paths for o in range(0, os.path.getsize(p), CHUNK)]
start = time.time()
with ThreadPoolExecutor(16) as pool:
    total = sum(pool.map(read, jobs))
seconds = time.time() - start
print(json.dumps({"bytes": total, "seconds": round(seconds, 2), "GB_s": round(total / seconds / 1e9, 3)}))
"""

LOAD_CHILD = DROP_CACHE + """
import json, time
if sys.argv[2] == "cold":
    drop_cache(sys.argv[1])
start = time.time()
from kiln import LLM, SamplingConfig
import contextlib, io
said = io.StringIO()
with contextlib.redirect_stderr(said):
    llm = LLM(sys.argv[1], device="cuda")
ready = time.time()
llm.generate([1, 2, 3], SamplingConfig(max_new_tokens=1, end_id=-1))
split = next((line for line in said.getvalue().splitlines() if line.startswith("ready in")), "")
print(json.dumps({"load_s": ready - start, "load_to_first_token_s": time.time() - start,
                  "kernels_compiled_at_load": llm.stats()["kernels_compiled_at_load"], "split": split}))
llm.shutdown()
"""


BUILD_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import gpu_suite
print(json.dumps(gpu_suite.save_random_engine(*sys.argv[2:])))
"""


def save_random_engine(model: str, mode: str, path: str) -> dict:
    """A random engine of `model` in `mode` with its kernels compiled into it, saved to `path`: seconds of each."""
    from kiln.runtime.precompile import compile_kernels

    start = time.time()
    engine = bench.random_engine(model, "bfloat16", BuildConfig(max_batch_size=256, max_input_len=2048,
                                                                max_seq_len=4096), quant_config=mode_quant(mode))
    built = time.time()
    count = compile_kernels(engine)
    compiled = time.time()
    engine.save(path)
    return {"build_random_s": round(built - start, 1), "compile_kernels_s": round(compiled - built, 1),
            "kernels_in_engine": count, "save_s": round(time.time() - compiled, 1)}


@phase
def load(args):
    """An engine built, compiled and saved by one process; its files read from disk by 16 threads with the page cache
    dropped (the disk's rate, the cold load's limit); then loaded to its first token by a fresh process with its
    files dropped from the page cache and by another with them cached; this process holds no GPU memory meanwhile
    (a 72 GB 70B FP8 engine would not fit twice)."""
    workdir = tempfile.TemporaryDirectory(prefix="kiln-suite-", dir=args.work_dir)   # 16-70 GB: not under $OUT
    path = os.path.join(workdir.name, "engine")
    torch.cuda.empty_cache()
    proc = subprocess.run([sys.executable, "-c", BUILD_CHILD, os.path.dirname(os.path.abspath(__file__)), args.model,
                           args.load_mode, path], capture_output=True, text=True, timeout=400)
    if proc.returncode:
        raise RuntimeError(f"building the engine failed: {proc.stderr[-1500:]}")
    for key, value in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        log(f"load_{key}", value)
    proc = subprocess.run([sys.executable, "-c", DISK_CHILD, path], capture_output=True, text=True, timeout=300)
    log("load_disk_read_cold_16_threads", (proc.stdout.strip().splitlines() or [proc.stderr[-1500:]])[-1])
    for attempt in ("cold", "warm"):
        proc = subprocess.run([sys.executable, "-c", LOAD_CHILD, path, attempt], capture_output=True, text=True,
                              timeout=300)
        log(f"load_{attempt}_process", (proc.stdout.strip().splitlines() or [proc.stderr[-1500:]])[-1])
    workdir.cleanup()


def mode_quant(mode: str) -> QuantConfig:
    """The QuantConfig of a mode written ALGO (bf16: none), then +INT8 or +FP8 for a quantized KV cache and +lm_head
    for a quantized LM head."""
    algo, *extras = mode.split("+")
    kv = next((e for e in extras if e in ("INT8", "FP8")), None)
    return QuantConfig(quant_algo=None if algo == "bf16" else algo, kv_cache_quant_algo=kv,
                       exclude_modules=excluded_modules("lm_head" in extras))


@phase
def quant(args):
    for mode in filter(None, args.latency_modes.split(",")):
        with _ready_llm(args, f"quant_{mode}", "latency", 128, 128, 1, mode_quant(mode)) as llm:
            result = _decode(llm, args.model, 3, 128, mode)
            bench.decode_limit_pct(result, llm.engine, args.hw)
            if args.profile:
                _profile_steps(llm, f"quant_{mode}", bench.random_prompts(
                    1, 128, llm.engine.pretrained_config.vocab_size, seed=5), 16)
        log(f"quant_{mode}_bs1_decode_tok_s", round(1e3 / result.tpot_ms["p50"], 1))
        log(f"quant_{mode}_pct_of_limit", f"{result.hardware_limit_pct or 0:.1f}% of {result.limit_note}")
        gc.collect()
        torch.cuda.empty_cache()
    if not args.quick:
        fp8 = mode_quant("FP8_PER_CHANNEL_PER_TOKEN+FP8+lm_head")
        _throughput(args, f"quant_FP8_throughput_128_128_b{args.max_batch}", 128, 128, args.requests, args.max_batch,
                    fp8)


FP8_DECODE_SHAPES = {"8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096),
                     "8b_down": (4096, 14336), "8b_lm_head": (128256, 4096), "70b_qkv": (10240, 8192),
                     "70b_o": (8192, 8192), "70b_gate_up": (57344, 8192), "70b_down": (8192, 28672)}
FP8_DECODE_SWEEP = [(64, 256, 4, 4, 1), (64, 256, 4, 6, 1), (128, 256, 4, 4, 1), (64, 512, 4, 3, 1), (64, 128, 4, 8, 1),
                    (64, 256, 4, 4, 2), (64, 256, 4, 4, 4)]    # Fp8DecodeTile fields


@phase
def fp8_decode(args):
    """FP8 products of few rows: torch._scaled_mm beside fp8_decode (the engine's tile, then FP8_DECODE_SWEEP's),
    in CUDA graphs whose calls each read another copy of the weight (bench.graph_seconds: over 100 MB between reuses
    of one, no help from the 50 MB L2)."""
    from kiln.kernels.triton import fp8_decode as kernel
    from kiln.kernels.triton.tuning import Fp8DecodeTile

    for name, (n, k) in FP8_DECODE_SHAPES.items():
        copies = [torch.randn(n, k, device="cuda").div(8).to(torch.float8_e4m3fn)
                  for _ in range(max(2, min(8, -(-(256 << 20) // (n * k)))))]
        scale = torch.rand(n, device="cuda") + 0.5
        for rows in (1, 8):
            x = torch.randn(rows, k, device="cuda").to(torch.float8_e4m3fn)
            x_scale = torch.rand(rows, 1, device="cuda") + 0.5
            variants = {"scaled_mm": lambda w: torch._scaled_mm(x, w.t(), scale_a=x_scale, scale_b=scale[None, :],
                                                                out_dtype=torch.bfloat16, use_fast_accum=True),
                        "engine": lambda w: kernel.fp8_decode_matmul(x, x_scale, w, scale, torch.bfloat16)}
            for fields in FP8_DECODE_SWEEP if rows == 1 else []:
                tile = Fp8DecodeTile(*fields)
                if k % (tile.block_k * tile.split) == 0:
                    variants["tile_" + "_".join(map(str, fields))] = (
                        lambda w, tile=tile: kernel.fp8_decode_matmul(x, x_scale, w, scale, torch.bfloat16, tile=tile))
            for variant, product in variants.items():
                micros = bench.graph_seconds([lambda w=w: product(w) for w in copies]) * 1e6
                log(f"fp8_decode_{name}_m{rows}_{variant}_us", f"{micros:.1f} ({n * k / micros / 1e6:.2f} TB/s)")
        copies.clear()
        torch.cuda.empty_cache()


PROMPT_GEMM_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@phase
def prompt_gemm(args):
    """The 8B shape's FP8 products at prompt-step sizes, TFLOP/s: torch._scaled_mm with a scale per token and per
    channel (what FP8_PER_CHANNEL_PER_TOKEN layers run), with one scale per tensor (cuBLASLt's own FP8 path), and
    the bf16 product, fast accumulation, bf16 out."""
    for rows in (2048, 8192, 16384):
        for name, (n, k) in PROMPT_GEMM_SHAPES.items():
            x = torch.randn(rows, k, device="cuda").div(4).to(torch.float8_e4m3fn)
            w = torch.randn(n, k, device="cuda").div(4).to(torch.float8_e4m3fn)
            row_scale, col_scale = torch.rand(rows, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
            one = torch.ones((), device="cuda")
            xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
            variants = {
                "rowwise": lambda: torch._scaled_mm(x, w.t(), scale_a=row_scale, scale_b=col_scale,
                                                    out_dtype=torch.bfloat16, use_fast_accum=True),
                "tensorwise": lambda: torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                       use_fast_accum=True),
                "bf16": lambda: xb @ wb.t()}
            for variant, product in variants.items():
                seconds = bench._cuda_time(product, 20)
                log(f"prompt_gemm_{name}_m{rows}_{variant}_tflops", round(2 * rows * n * k / seconds / 1e12, 1))
        torch.cuda.empty_cache()


@phase
def sparsity(args):
    """2:4 sparse GEMMs beside dense ones: the 8B shape's projections at 2048 tokens, bf16 — through the runtime's
    sparse_linear (cuSPARSELt with cached plans), torch's semi-structured F.linear, and torch's cuSPARSELt op
    called directly (its default algorithm, the one its search picks, and with --sparsity_sweep the fastest of a
    sweep over algorithm × split-K). Each is timed twice: calls back to back (what an uncaptured prompt step pays, host work included:
    torch builds a cuSPARSELt plan every call) and replayed in a CUDA graph (the GPU's time alone)."""
    from kiln.kernels.sparse import prune_2_4, sparse_linear, sparse_weight

    tokens = 2048
    cslt = bool(torch.backends.cusparselt.is_available())
    log("sparsity_cusparselt", cslt)
    for name, out, inp in (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)):
        weight = prune_2_4(torch.randn(out, inp, device="cuda", dtype=torch.bfloat16) * 0.02)
        x = torch.randn(tokens, inp, device="cuda", dtype=torch.bfloat16)
        flops = 2 * tokens * out * inp
        with torch.inference_mode():
            dense = lambda: torch.nn.functional.linear(x, weight)  # noqa: E731
            dense_s, dense_graph_s = bench._cuda_time(dense, 50), bench.graph_seconds([dense] * 8)
            log(f"sparsity_{name}_dense_TFLOPs",
                f"{flops / dense_s / 1e12:.1f} (graph {flops / dense_graph_s / 1e12:.1f})")
            variants = {"runtime": lambda: functools.partial(sparse_linear, x, sparse_weight(weight, name), None),
                        "torch_linear": lambda: functools.partial(torch.nn.functional.linear, x,
                                                                  sparse_weight(weight, name))}
            if cslt:
                compressed = torch._cslt_compress(weight)
                variants["cslt_alg0"] = lambda: _cslt(compressed, x, 0, 1)
                variants["cslt_searched"] = lambda: _cslt(compressed, x, _cslt_search(compressed, x, name), 1)
                if args.sparsity_sweep:
                    variants["cslt_swept"] = lambda: _cslt(compressed, x, *_cslt_sweep(compressed, x, name))
            for variant, make in variants.items():
                try:
                    product = make()
                    seconds, graph_s = bench._cuda_time(product, 50), bench.graph_seconds([product] * 8)
                    log(f"sparsity_{name}_{variant}_speedup",
                        f"{dense_s / seconds:.2f} (graph {dense_graph_s / graph_s:.2f})")
                except Exception as err:  # noqa: BLE001 - one variant failing must not hide the others
                    log(f"sparsity_{name}_{variant}_error", repr(err)[:300])
        del weight, x


def _cslt(compressed, x, alg: int, split_k: int):
    """x W^T as one cuSPARSELt product of the compressed weight (transposed result fused)."""
    return lambda: torch._cslt_sparse_mm(compressed, x.t(), transpose_result=True, alg_id=alg, split_k=split_k)


def _cslt_search(compressed, x, name: str) -> int:
    alg = torch._cslt_sparse_mm_search(compressed, x.t(), transpose_result=True)
    log(f"sparsity_{name}_cslt_searched_alg", alg)
    return alg


def _cslt_sweep(compressed, x, name: str) -> tuple[int, int]:
    """(algorithm, split-K) of the fastest cuSPARSELt product of this shape in CUDA-graph time."""
    best = None
    for alg in range(torch.backends.cusparselt.get_max_alg_id() + 1):
        for split_k in (1, 2, 4):
            try:
                seconds = bench.graph_seconds([_cslt(compressed, x, alg, split_k)] * 8)
            except RuntimeError:
                continue
            if best is None or seconds < best[0]:
                best = (seconds, alg, split_k)
    log(f"sparsity_{name}_cslt_swept_alg_split_k", best[1:])
    return best[1:]


CONTEXT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
CONTEXT_VARIANTS = {    # Kiln's prompt attention: (keys per tile, (warps, stages), query rows a program, causal split)
    "kiln": (None, None, None, None),  # tuning.PROMPT_ATTENTION
    "kiln_t64": (64, (4, 2), 64, False), "kiln_t64_split": (64, (4, 2), 64, True),
    "kiln_r128_t128_s2": (128, (8, 2), 128, True), "kiln_r256_t128": (128, (8, 3), 256, True),
    "kiln_r128_t64": (64, (4, 3), 128, True), "kiln_r128_t128_s4": (128, (8, 4), 128, True),
    "kiln_r128_t64_w8": (64, (8, 3), 128, True), "kiln_r64_t128": (128, (4, 2), 64, True),
    "kiln_r128_t128_w4": (128, (4, 2), 128, True), "kiln_r64_t64": (64, (4, 3), 64, True),
}


@phase
def context_attention(args):
    """Causal prompt attention TFLOP/s, --context_seqs sequences (default one) of each of --context_lengths tokens
    attended together, 32 query heads over --context_kv_heads KV heads (4: GQA 8:1; Llama-3.1-8B has 8) of 128 in
    cache blocks of --context_block tokens: Kiln's paged kernel (variants of tuning.py's choices; bf16 and FP8
    caches, and FP8 queries over the FP8 cache) beside torch's SDPA flash backend on contiguous q/k/v, and torch's
    varlen flash attention over the same paged cache where this torch has it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kiln.kernels.triton.paged_attention import paged_attention

    heads, kv_heads, dim, block, seqs = 32, args.context_kv_heads, 128, args.context_block, args.context_seqs
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    log("context_varlen_attn", varlen_attn is not None)
    for n in map(int, args.context_lengths.split(",")):
        flops = 2 * n * n * heads * dim * seqs                         # causal: half of 4·N²·H·D a sequence
        q = torch.randn(seqs * n, heads, dim, device="cuda", dtype=torch.bfloat16)
        blocks = torch.randperm(seqs * n // block, device="cuda")
        cache = torch.randn(2, seqs * n // block, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        tables, lens = blocks.reshape(seqs, -1).clone(), torch.full((seqs,), n, device="cuda")
        starts = torch.arange(0, seqs * n + 1, n, device="cuda")
        scale = dim ** -0.5
        rate = lambda seconds: round(flops / seconds / 1e12, 1)  # noqa: E731
        with torch.inference_mode():
            fp8_cache, ones = cache.to(torch.float8_e4m3fn), torch.ones(2, device="cuda")
            for name in args.context_variants.split(","):
                tile, launch, rows, split = CONTEXT_VARIANTS[name]
                for kv, kv_cache, kv_scale, fp8_queries in (("bf16", cache, None, False),
                                                            ("fp8", fp8_cache, ones, False),
                                                            ("fp8q", fp8_cache, ones, True)):
                    try:
                        seconds = bench._cuda_time(lambda: paged_attention(
                            q, kv_cache, tables, lens, starts, n, scale, None, tile=tile, warps_stages=launch,
                            kv_scale=kv_scale, block_rows=rows, causal_split=split, fp8_queries=fp8_queries), 5)
                        log(f"context_{n}_{name}_{kv}_TFLOPs", rate(seconds))
                    except Exception as err:  # noqa: BLE001 - a variant that does not compile must not hide the rest
                        log(f"context_{n}_{name}_{kv}_error", repr(err)[:300])
            k = cache[0][blocks].reshape(seqs * n, kv_heads, dim)   # the sequences' keys in order (block i: blocks[i])
            v = cache[1][blocks].reshape(seqs * n, kv_heads, dim)
            qt, kt, vt = (x.reshape(seqs, n, -1, dim).transpose(1, 2) for x in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                seconds = bench._cuda_time(lambda: torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True), 5)
            log(f"context_{n}_sdpa_flash_TFLOPs", rate(seconds))
            if varlen_attn is not None:
                for paged in (False, True):
                    name = f"context_{n}_varlen_{'paged' if paged else 'packed'}"
                    try:
                        log(f"{name}_TFLOPs", rate(_varlen_seconds(varlen_attn, q, k, v, cache, tables, lens, starts,
                                                                   n, scale, paged)))
                    except Exception as err:  # noqa: BLE001
                        log(f"{name}_error", repr(err)[:300])
        del q, cache, fp8_cache
        torch.cuda.empty_cache()


def _varlen_seconds(varlen_attn, q, k, v, cache, tables, lens, starts, n: int, scale: float, paged: bool) -> float:
    """torch's flash varlen attention over the packed (k, v) or the paged cache; a torch without enable_gqa gets
    K/V heads repeated for every query head (packed only)."""
    kw = dict(block_table=tables.int(), seqused_k=lens.int()) if paged else {}
    kk, vv = (cache[0], cache[1]) if paged else (k, v)
    try:
        return bench._cuda_time(lambda: varlen_attn(q, kk, vv, starts.int(), starts.int(), n, n, scale=scale,
                                                    window_size=(-1, 0), enable_gqa=True, **kw), 5)
    except TypeError:
        if paged:
            raise
        kk, vv = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        return bench._cuda_time(lambda: varlen_attn(q, kk, vv, starts.int(), starts.int(), n, n, scale=scale,
                                                    window_size=(-1, 0)), 5)


PHASES = {"context_attention": context_attention, "fp8_decode": fp8_decode, "prompt_gemm": prompt_gemm, "sparsity": sparsity, "speculative": speculative, "checks": checks, "latency": latency, "throughput": throughput, "load": load, "quant": quant,
          "lora": lora}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default="checks,latency,throughput", help=f"comma-separated, of {', '.join(PHASES)}")
    p.add_argument("--model", default="llama-3.1-8b", choices=list(bench.SHAPES), help="the model shape")
    p.add_argument("--quick", action="store_true", help="throughput at 128/128 only; quant without FP8 throughput")
    p.add_argument("--profile", action="store_true", help="torch profiler tables of latency and throughput runs")
    p.add_argument("--requests", type=int, default=2048, help="requests of the 128/128 throughput runs")
    p.add_argument("--long_requests", type=int, default=1500,
                   help="requests of the 2048/128, 128/2048 and 2048/2048 runs (TensorRT-LLM's tables use 1,500-3,000)")
    p.add_argument("--shapes", default=None,
                   help="the throughput phase's input/output lengths, e.g. 2048/128,2048/2048 (default: all four)")
    p.add_argument("--throughput_mode", default="bf16",
                   help="the throughput phase's engine mode (as in --latency_modes), e.g. FP8_PER_CHANNEL_PER_TOKEN+FP8+lm_head")
    p.add_argument("--max_batch", type=int, default=512, help="max_batch_size of the throughput engines")
    p.add_argument("--max_num_tokens", type=int, default=0,
                   help="tokens a step of the throughput engines (0: kiln bench's default, up to 16384)")
    p.add_argument("--use_fp8_context_fmha", action="store_true",
                   help="engines with an FP8 KV cache: prompt attention's queries in e4m3 (PluginConfig)")
    p.add_argument("--latency_modes", default="bf16,W4A16_AWQ+lm_head,W8A16",
                   help="batch-1 modes of the quant phase ('': none, FP8 throughput only)")
    p.add_argument("--load_mode", default="bf16", help="the load phase's engine mode (as in --latency_modes)")
    p.add_argument("--work_dir", default=None, help="where the load phase saves its engine (default: the temp dir)")
    p.add_argument("--tuning", default="",
                   help="semicolon-separated NAME=VALUE settings of kiln/kernels/triton/tuning.py for this run "
                        "(VALUE a Python literal), e.g. 'MOE_GROUPED_MM_ROWS={}' (never) or "
                        "'ATTENTION_TILE=128;ATTENTION_LAUNCH=(8, 3)'")
    p.add_argument("--context_lengths", default=",".join(map(str, CONTEXT_LENGTHS)),
                   help="prompt lengths of the context_attention phase")
    p.add_argument("--context_kv_heads", type=int, default=4, help="KV heads of the context_attention phase")
    p.add_argument("--context_block", type=int, default=64, help="cache block tokens of the context_attention phase")
    p.add_argument("--context_seqs", type=int, default=1,
                   help="sequences of each length the context_attention phase attends together (a prompt step's)")
    p.add_argument("--context_variants", default=",".join(CONTEXT_VARIANTS),
                   help=f"the context_attention phase's kernel variants, of {', '.join(CONTEXT_VARIANTS)}")
    p.add_argument("--sparsity_sweep", action="store_true",
                   help="the sparsity phase also sweeps cuSPARSELt's algorithm x split-K (slow)")
    p.add_argument("--test_paths", default="tests", help="comma-separated pytest paths of the checks phase")
    p.add_argument("--test_timeout", type=int, default=900, help="seconds the checks phase may take")
    args = p.parse_args()
    unknown = [name for name in args.phases.split(",") if name not in PHASES]
    if unknown:
        p.error(f"unknown phase {unknown[0]!r}: choose from {', '.join(PHASES)}")
    unknown = [name for name in args.context_variants.split(",") if name not in CONTEXT_VARIANTS]
    if unknown:
        p.error(f"unknown context variant {unknown[0]!r}: choose from {', '.join(CONTEXT_VARIANTS)}")
    env(args)
    for name in args.phases.split(","):
        PHASES[name](args)
    with open(os.path.join(OUT, "suite.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main()
