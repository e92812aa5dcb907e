"""LLM: point it at an HF directory, a GGUF file, a Kiln checkpoint or an engine; it does what is missing,
then serves generate / generate_async from one background engine loop."""
from __future__ import annotations

import copy
import dataclasses
import gc
import functools
import sys
import time
from pathlib import Path
from typing import Sequence, Union

import torch

from kiln.builder import Engine, build, build_all_ranks, build_auto_parallel, build_sharded, is_engine_dir
from kiln.checkpoint import hub, is_checkpoint_dir, load_checkpoint_config, read_source_config
from kiln.config import (BuildConfig, KvCacheConfig, LoraCacheConfig, Mapping, ModelConfig, ParallelConfig,
                         PretrainedConfig, QuantConfig, SchedulerPolicy, SpeculativeConfig)
from kiln.distributed import launched_rank, rank_device
from kiln.models import PretrainedModel, model_class
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.executor import GenerationExecutor, GenerationResult
from kiln.runtime.outputs import GenerationOutput
from kiln.runtime.prompt_table import PromptTable, make_prompt_table
from kiln.runtime.request import LoRARequest, Request
from kiln.runtime.sampling import DecodingMode, SamplingConfig
from kiln.runtime.workers import STOP, Workers, check_runnable, join_ranks, serve_steps
from kiln.tokenizer import eos_token_ids, generation_defaults, load_tokenizer
from kiln.utils.fs import exists_or_recovered

Prompt = Union[str, Sequence[int]]
PROGRESS_BAR_MIN_PROMPTS = 64


def default_build_config(config: PretrainedConfig) -> BuildConfig:
    """Limits used when LLM builds an engine itself: up to 4096 tokens per sequence (prompt and output share
    them as each request needs), 64 sequences at once."""
    max_seq_len = min(config.max_position_embeddings, 4096)
    return BuildConfig(max_batch_size=64, max_input_len=max_seq_len - 1, max_output_len=max_seq_len - 1,
                       max_seq_len=max_seq_len)


def load_engine(model, dtype: str = "auto", build_config: BuildConfig | None = None, quiet: bool = False,
                device: torch.device | str = "cpu", parallel_config: ParallelConfig | None = None,
                verify: bool = True, revision: str | None = None, quant_config: QuantConfig | None = None,
                build_fields: dict | None = None) -> Engine:
    """An Engine from an Engine, a PretrainedModel, a path to an engine, checkpoint, HF dir or GGUF file, or a
    Hugging Face model id (org/name, at `revision`; kiln.checkpoint.hub); a float model is quantized as
    `quant_config` asks before it is built, and `build_fields` (ModelConfig's) set those of the build config;
    with a parallel_config of several ranks, models and checkpoints are sharded and every rank built. The files
    of engines and checkpoints are verified against their checksums unless verify=False."""
    if revision is not None and not hub.is_model_id(model):
        raise ValueError(f"revision={revision!r} applies to Hugging Face model ids (org/name), not to {model!r}")
    if isinstance(model, Engine):
        _check_built("the Engine given", model.pretrained_config.mapping, dtype, build_config, parallel_config)
        return _check_prebuilt(model, quant_config, build_fields)
    if isinstance(model, PretrainedModel):
        if dtype != "auto":
            raise ValueError(f"dtype={dtype!r}: a loaded model keeps its own dtype ({model.config.dtype}); "
                             "give dtype when loading it")
        return _build(_quantized(model, quant_config, quiet), build_config, parallel_config, quiet, build_fields)
    path = Path(hub.resolve(model, revision))
    if not exists_or_recovered(path):
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_dir() and is_engine_dir(path):
        from kiln.builder.engine import read_manifest

        mapping = PretrainedConfig.from_dict(read_manifest(path)["pretrained_config"]).mapping
        _check_built(str(path), mapping, dtype, build_config, parallel_config)
        return _check_prebuilt(Engine.from_dir(path, device=device, verify=verify), quant_config, build_fields)
    if path.is_dir() and is_checkpoint_dir(path):
        config = load_checkpoint_config(path)
        if dtype != "auto":
            raise ValueError(f"{path} is a Kiln checkpoint in {config.dtype}; dtype is chosen at conversion")
        if config.mapping.world_size > 1:
            if parallel_config is not None or (build_config is not None and build_config.auto_parallel_config.enabled):
                raise ValueError(f"{path} is already sharded ({config.mapping.world_size} ranks): leave "
                                 "parallel_config and auto_parallel_config out")
            if quant_config is not None and quant_config.enabled:
                raise ValueError(f"{path} is a sharded checkpoint: quantize it with kiln convert, not quant_config")
            cls = model_class(config.architecture)
            return build_all_ranks(lambda rank: cls.from_checkpoint(path, rank, verify), config.mapping.world_size,
                                   _with_fields(build_config or default_build_config(config), build_fields), quiet)
        loaded = model_class(config.architecture).from_checkpoint(path, verify=verify)
    elif not verify:
        raise ValueError(f"skip_checksum applies to Kiln engines and checkpoints; {path} has no checksums to skip")
    else:
        loaded = model_class(read_source_config(path, dtype).architecture).from_hugging_face(path, dtype, quiet=quiet)
    return _build(_quantized(loaded, quant_config, quiet), build_config, parallel_config, quiet, build_fields)


def _check_built(where: str, mapping: Mapping, dtype: str, build_config: BuildConfig | None,
                 parallel: ParallelConfig | None) -> None:
    """An engine is built: build_config and dtype cannot change it, and a parallel_config must be its own layout
    (or one rank: none asked for)."""
    if build_config is not None or dtype != "auto":
        raise ValueError(f"{where} is a built engine: build_config and dtype cannot change it; rebuild instead")
    if parallel is None or (parallel.tp_size * parallel.pp_size == 1 and not parallel.auto_parallel):
        return
    agrees = (parallel.world_size == mapping.world_size if parallel.auto_parallel
              else (parallel.tp_size, parallel.pp_size) == (mapping.tp_size, mapping.pp_size))
    if not agrees:
        asked = (f"auto_parallel over world_size={parallel.world_size}" if parallel.auto_parallel
                 else f"tp_size={parallel.tp_size}, pp_size={parallel.pp_size}")
        raise ValueError(f"parallel_config ({asked}) disagrees with {where}, built for tp_size={mapping.tp_size}, "
                         f"pp_size={mapping.pp_size}: an engine's parallelism is fixed when it is built; leave "
                         "parallel_config out (or give the engine's) or rebuild")


def _quantized(model: PretrainedModel, quant_config: QuantConfig | None, quiet: bool) -> PretrainedModel:
    """The model quantized as quant_config asks (calibrated on Kiln's calibration text); a model quantized already
    is refused."""
    if quant_config is None or not quant_config.enabled:
        return model
    if model.config.quantization.enabled:
        raise ValueError(f"the model is quantized already ({model.config.quantization.quant_algo}): give a float "
                         "model to quantize with quant_config")
    from kiln.quantization import quantize_model

    return quantize_model(model, quant_config, 16, quiet)


def _with_fields(build_config: BuildConfig, fields: dict | None) -> BuildConfig:
    """build_config with ModelConfig.build_fields() set (multi_block_mode inside its plugin_config)."""
    fields = dict(fields or {})
    multi_block = fields.pop("multi_block_mode", None)
    build_config = dataclasses.replace(build_config, **fields) if fields else build_config
    if multi_block is not None:
        build_config = dataclasses.replace(build_config, plugin_config=dataclasses.replace(
            build_config.plugin_config, multi_block_mode=multi_block))
    return build_config


def _check_prebuilt(engine: Engine, quant_config: QuantConfig | None, fields: dict | None) -> Engine:
    """An engine built elsewhere: quant_config and build settings cannot change it (refused where they differ)."""
    if quant_config is not None and quant_config.enabled:
        raise ValueError("quant_config quantizes a model before it is built; this is a built engine (quantize the "
                         "model with kiln convert, then build)")
    for name, value in (fields or {}).items():
        built = engine.build_config.plugin_config if name == "multi_block_mode" else engine.build_config
        if getattr(built, name) != value:
            raise ValueError(f"ModelConfig asks for {name}={value!r}, but the engine was built with "
                             f"{getattr(built, name)!r}: rebuild it, or leave {name} at the engine's")
    return engine


def _build(model: PretrainedModel, build_config: BuildConfig | None, parallel: ParallelConfig | None, quiet: bool,
           build_fields: dict | None = None):
    build_config = _with_fields(build_config or default_build_config(model.config), build_fields)
    if parallel is None or (parallel.tp_size * parallel.pp_size == 1 and not parallel.auto_parallel):
        return build(model, build_config, quiet)
    if build_config.auto_parallel_config.enabled:
        raise ValueError("parallelism is given twice (parallel_config and build_config.auto_parallel_config): "
                         "give one")
    if parallel.auto_parallel:
        limit = parallel.max_memory_mb * 2**20 if parallel.max_memory_mb else None
        return build_auto_parallel(model, build_config, parallel.world_size, limit, quiet)
    return build_sharded(model, build_config, parallel.tp_size, parallel.pp_size, quiet)


def _unpack(config: ModelConfig, parallel: ParallelConfig | None, quant: QuantConfig | None):
    """(model, parallel_config, quant_config, build fields) of a ModelConfig; its fields given twice are refused."""
    if parallel is not None:
        raise ValueError("parallel_config is given twice (in the ModelConfig and to LLM): give it once")
    if quant is not None:
        raise ValueError("quant_config is given twice (in the ModelConfig and to LLM): give it once")
    return config.source, config.parallel_config, config.quant_config, config.build_fields()


def _is_built(model) -> bool:
    """Whether `model` is an engine already (its build limits are its own)."""
    return isinstance(model, Engine) or (not isinstance(model, PretrainedModel) and is_engine_dir(Path(model)))


def _check_kv_cache_device(kv_cache_config: KvCacheConfig | None, device: torch.device) -> None:
    """Each memory limit of the KV cache applies on one kind of device; the other's is refused, not ignored."""
    if kv_cache_config is None:
        return
    default, on_gpu = KvCacheConfig(), device.type == "cuda"
    if on_gpu and kv_cache_config.host_cache_bytes != default.host_cache_bytes:
        raise ValueError("KvCacheConfig.host_cache_bytes sizes the cache on the CPU; on a GPU give "
                         "free_gpu_memory_fraction (or max_tokens)")
    if not on_gpu and kv_cache_config.free_gpu_memory_fraction != default.free_gpu_memory_fraction:
        raise ValueError(f"KvCacheConfig.free_gpu_memory_fraction sizes the cache on a GPU; on {device.type} give "
                         "host_cache_bytes (or max_tokens)")


def _freeze_live_objects() -> None:
    """Collect what is garbage, then move every object alive (mostly the interpreter's modules, functions and
    classes: the bulk of a torch process's heap) out of the collector's generations, so that the full collections
    that run while requests are served walk only what was made since: in a 10.5 s FP8 128/128 throughput run they
    took 0.44 s (timed through gc.callbacks), each pause stalling the overlapped steps. Done before
    the engine loads, so that this LLM's own objects stay collectable; `shutdown` unfreezes, so that whatever was
    alive here and has become garbage since (a frozen object is never collected) goes at the next collection."""
    gc.collect()
    gc.freeze()


class LLM:
    """Generate text with an engine, building it first when given a model or checkpoint.

        llm = LLM("engine_dir")            # or an HF dir, a .gguf file, a Kiln checkpoint
        for out in llm.generate(["Hello", [1, 2, 3]], SamplingConfig(max_new_tokens=32)):
            print(out.text)

    Requests from all callers share one background engine loop (in-flight batching over a paged KV cache).
    """

    def __init__(self, model, tokenizer=None, dtype: str = "auto", build_config: BuildConfig | None = None,
                 kv_cache_config: KvCacheConfig | None = None, enable_trt_overlap: bool = False,
                 normalize_log_probs: bool = False, enable_chunked_context: bool = False,
                 decoding_mode: DecodingMode | None = None,
                 scheduling_policy: SchedulerPolicy = SchedulerPolicy.GUARANTEED_NO_EVICT,
                 device: str | torch.device | None = None, quiet: bool = False,
                 parallel_config: ParallelConfig | None = None,
                 garbage_collection_gen0_threshold: int | None = 20000, skip_checksum: bool = False,
                 lora_cache_config: LoraCacheConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None, revision: str | None = None,
                 quant_config: QuantConfig | None = None, async_engine_tmp_dir: str | Path | None = None):
        """
        Args:
            model: an engine directory, a Kiln checkpoint, an HF directory or GGUF file, a Hugging Face model id
                (org/name: downloaded once into the hub cache; HF_HUB_OFFLINE=1 reads the cache only), or an
                Engine/model object.
            tokenizer: overrides the tokenizer stored with the model.
            build_config: limits for the engine built here (not for an already built engine).
            kv_cache_config: size of the paged KV cache and prefix block reuse.
            enable_trt_overlap: schedule and launch the next step while the device still runs this one (greedy
                requests; others run in order). Needs SchedulerPolicy.GUARANTEED_NO_EVICT and one rank.
            normalize_log_probs: returned log-probabilities are renormalised over the tokens top-k/top-p kept.
            enable_chunked_context: split prompts longer than the step's token budget over several steps.
            decoding_mode: restrict the decoding algorithms requests may use (None: any).
            scheduling_policy: GUARANTEED_NO_EVICT or MAX_UTILIZATION.
            parallel_config: tensor/pipeline parallelism for a model or unsharded checkpoint (an engine carries its
                own); every rank beyond 0 runs in a worker process started here.
            garbage_collection_gen0_threshold: Python's generation-0 collection threshold while this LLM serves
                (restored by shutdown; process-wide, as TensorRT-LLM's option of that name): 20000 makes the
                collections that pause the engine loop ~28x rarer than Python's 700; None leaves it as it is.
            skip_checksum: load an engine or Kiln checkpoint without verifying its files' checksums (faster for
                very large engines; corruption then goes unnoticed).
            lora_cache_config: how many LoRA adapters stay loaded on the device and on the host (requests choose
                theirs with lora_request=LoRARequest(name, path)).
            speculative_config: speculative decoding (n-gram lookup, a draft model or an EAGLE head), lossless;
                an engine loaded from disk must have been built with max_draft_len >= its max_draft_len (one built
                here is).
            revision: the branch, tag or commit of a Hugging Face model id.
            quant_config: quantize a float model (HF dir, GGUF, unsharded checkpoint, in-memory model) before
                building it, as `kiln convert` would (calibrated on Kiln's calibration text).
            async_engine_tmp_dir: where an engine built here is also saved (for inspection); it must be a new or
                empty directory.

        `model` may also be the seed's ModelConfig(model_dir=..., parallel_config=..., quant_config=...,
        max_beam_width=..., multi_block_mode=..., plugin_config=...), standing for those arguments.
        """
        if isinstance(model, ModelConfig):
            model, parallel_config, quant_config, build_fields = _unpack(model, parallel_config, quant_config)
        else:
            build_fields = None
        if garbage_collection_gen0_threshold is not None and garbage_collection_gen0_threshold < 1:
            raise ValueError(f"garbage_collection_gen0_threshold={garbage_collection_gen0_threshold} must be >= 1 "
                             "(or None to keep Python's threshold)")
        if enable_trt_overlap and scheduling_policy is not SchedulerPolicy.GUARANTEED_NO_EVICT:
            raise ValueError("enable_trt_overlap=True needs scheduling_policy=GUARANTEED_NO_EVICT (a preempted "
                             "sequence cannot be recomputed while its next token is still on the device)")
        self.device = _rank0_device(device, parallel_config)
        _check_kv_cache_device(kv_cache_config, self.device)
        _freeze_live_objects()
        self._workers = self._parallel = self._tmp_engine = None
        launched = launched_rank()
        if launched is not None:
            _check_launched_engine(model, launched[1])
            if launched[0] > 0:
                _serve_launched_worker(model, launched, self.device, parallel_config or ParallelConfig())
            self.device = rank_device(self.device.type, 0, (parallel_config or ParallelConfig()).devices)
        started = time.perf_counter()
        self.engine = load_engine(model, dtype, build_config, quiet, self.device, parallel_config,
                                  verify=not skip_checksum, revision=revision, quant_config=quant_config,
                                  build_fields=build_fields)
        if async_engine_tmp_dir is not None:
            if _is_built(model):
                raise ValueError("async_engine_tmp_dir keeps an engine built here; this one was built already")
            self.engine.save(async_engine_tmp_dir)
        engine_ready = time.perf_counter()
        draft_engine = self._speculation(model, speculative_config, quiet, skip_checksum, enable_trt_overlap)
        build_limits = self.engine.build_config
        if not enable_chunked_context and build_limits.max_num_tokens < build_limits.max_input_len:
            raise ValueError(f"max_num_tokens={build_limits.max_num_tokens} is below max_input_len="
                             f"{build_limits.max_input_len}: enable_chunked_context=True is needed")
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.engine.tokenizer_files)
        self.eos_ids = eos_token_ids(self.tokenizer, self.engine.tokenizer_files)
        self._sampling_defaults = generation_defaults(self.engine.tokenizer_files)    # read once, checked below
        self.get_default_sampling_config()
        self.decoding_mode = decoding_mode or DecodingMode.none
        self._max_prompt_rows = self.engine.build_config.max_prompt_embedding_table_size
        if enable_trt_overlap and self.engine.pretrained_config.mapping.world_size > 1:
            raise ValueError("enable_trt_overlap=True is not supported with tensor/pipeline parallelism yet")
        if self.engine.pretrained_config.mapping.world_size > 1:
            self._start_ranks(model, kv_cache_config or KvCacheConfig(), lora_cache_config or LoraCacheConfig(),
                              parallel_config or ParallelConfig(), launched is not None)
        self.core = EngineCore(self.engine, self.device, kv_cache_config, scheduling_policy, enable_chunked_context,
                               normalize_log_probs, parallel=self._parallel, overlap=enable_trt_overlap,
                               lora_cache_config=lora_cache_config, speculative_config=speculative_config,
                               draft_engine=draft_engine)
        if not quiet:
            print(self.core.memory_line, file=sys.stderr)
            print(f"ready in {time.perf_counter() - started:.1f} s: engine {engine_ready - started:.1f} s (loaded or "
                  f"built), runtime {time.perf_counter() - engine_ready:.1f} s (weights laid out for the kernels, KV "
                  "cache, CUDA graphs)", file=sys.stderr)
        failure = self._workers.failure if self._workers is not None else None
        self._executor = GenerationExecutor(self.core, copy.deepcopy(self.tokenizer), failure)
        self._next_request_id = 0
        self._gc_threshold = gc.get_threshold()             # set only once nothing above can fail
        if garbage_collection_gen0_threshold is not None:
            gc.set_threshold(garbage_collection_gen0_threshold, *self._gc_threshold[1:])

    def _speculation(self, model, config: SpeculativeConfig | None, quiet: bool, skip_checksum: bool,
                     overlap: bool) -> Engine | None:
        """Check speculative_config against the engine (one built here is sized for it); the draft model's engine,
        built with this engine's limits, for method "draft_model"."""
        if config is None:
            return None
        if not isinstance(config, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a SpeculativeConfig, got {type(config).__name__}")
        build_limits = self.engine.build_config
        if self.engine.pretrained_config.mapping.world_size > 1:
            raise ValueError("speculative decoding with tensor/pipeline parallelism is not supported yet")
        if config.method == "eagle" and overlap:
            raise ValueError("EAGLE drafting with enable_trt_overlap is not supported yet (it reads each step's "
                             "hidden states before the next is launched)")
        if not _is_built(model) and build_limits.max_draft_len < config.max_draft_len:
            self.engine.build_config = dataclasses.replace(build_limits, max_draft_len=config.max_draft_len)
        elif build_limits.max_draft_len < config.max_draft_len:
            raise ValueError(f"speculative_config.max_draft_len={config.max_draft_len}, but the engine was built "
                             f"with max_draft_len={build_limits.max_draft_len}: rebuild it with --max_draft_len "
                             f"{config.max_draft_len} or draft fewer tokens")
        if config.method != "draft_model":
            return None
        limits = self.engine.build_config
        draft_build = BuildConfig(max_batch_size=limits.max_batch_size, max_input_len=limits.max_input_len,
                                  max_seq_len=limits.max_seq_len, max_num_tokens=limits.max_num_tokens)
        draft = load_engine(config.speculative_model, "auto", None if _is_built(config.speculative_model) else
                            draft_build, quiet, self.device, verify=not skip_checksum)
        if draft.pretrained_config.mapping.world_size > 1:
            raise ValueError("the draft model must be one rank (a sharded draft engine is not supported)")
        short = [name for name in ("max_batch_size", "max_seq_len")
                 if getattr(draft.build_config, name) < getattr(limits, name)]
        if short:
            raise ValueError(f"the draft engine's {short[0]}={getattr(draft.build_config, short[0])} is below the "
                             f"engine's ({getattr(limits, short[0])}): build the draft engine with the engine's "
                             "limits, or give its model directory")
        return draft

    def _start_ranks(self, model, kv_cache_config: KvCacheConfig, lora_cache_config: LoraCacheConfig,
                     parallel: ParallelConfig, launched: bool) -> None:
        """Join ranks 1..N-1: started by an external launcher, or spawned here as worker processes that load
        their shards themselves (from the engine directory, saved first when the engine was built here)."""
        import dataclasses

        mapping = self.engine.pretrained_config.mapping
        check_runnable(self.engine, self.device)
        if launched:
            init_method = "env://"
        else:
            self._workers = Workers(self._rank_loader(model), mapping.world_size, self.device.type, parallel.timeout_s,
                                    tuple(parallel.devices))
            init_method = self._workers.init_method
        self.engine.weights = {0: self.engine.weights[0]}
        self._parallel = join_ranks(self.engine, self.device, init_method, parallel.timeout_s)
        self._parallel.broadcast({"kv_cache": dataclasses.asdict(kv_cache_config),
                                  "lora_cache": dataclasses.asdict(lora_cache_config)})

    def _rank_loader(self, model):
        if self.engine.rank_loader is not None:
            return self.engine.rank_loader
        import tempfile

        from kiln.builder.engine import load_engine_rank

        self._tmp_engine = tempfile.TemporaryDirectory(prefix="kiln-engine-")
        engine_dir = Path(self._tmp_engine.name) / "engine"
        self.engine.save(engine_dir)
        return functools.partial(load_engine_rank, str(engine_dir))

    @property
    def build_config(self) -> BuildConfig:
        return self.engine.build_config

    @property
    def config(self) -> PretrainedConfig:
        return self.engine.pretrained_config

    def save(self, engine_dir: str | Path) -> None:
        """Write the engine (built here or loaded) to a directory."""
        if not self.engine.weights:
            raise RuntimeError("this LLM was shut down and has let go of its engine's weights: save it before "
                               "shutdown()")
        self.engine.save(engine_dir)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_config: SamplingConfig | Sequence[SamplingConfig] | None = None,
                 use_tqdm: bool | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 prompt_table=None, prompt_tasks: int | Sequence[int | None] | None = None):
        """Generate for one prompt (→ one GenerationOutput) or a list of prompts (→ a list, in order).

        A prompt is text or a list of token ids; `sampling_config` is one config or one per prompt; `lora_request`
        one LoRA adapter for all, or one per prompt (None: the base model). `prompt_table` (prompt tuning; the engine
        built with max_prompt_embedding_table_size): a (rows, hidden_size) tensor of embeddings, or (tasks, rows,
        hidden_size) with `prompt_tasks` picking a task — one for all prompts or one per prompt (None: none); prompt
        token id vocab_size + i stands for row i. Every prompt (and adapter, table) is validated before any is
        submitted. A progress bar shows for large batches (or with use_tqdm=True)."""
        single = isinstance(prompts, str) or (isinstance(prompts, Sequence) and len(prompts) > 0
                                              and isinstance(prompts[0], int))
        prompt_list = [prompts] if single else list(prompts)
        configs = self._configs(sampling_config, len(prompt_list))
        loras = self._loras(lora_request, len(prompt_list))
        tables = self._prompt_tables(prompt_table, prompt_tasks, len(prompt_list))
        requests = [self._make_request(p, c, lora, table)
                    for p, c, lora, table in zip(prompt_list, configs, loras, tables)]
        results = [self._executor.submit(r, p, streaming=False) for r, p in zip(requests, prompt_list)]
        show = len(results) >= PROGRESS_BAR_MIN_PROMPTS if use_tqdm is None else use_tqdm
        outputs = [r.result() for r in _progress(results, show)]
        return outputs[0] if single else outputs

    def generate_async(self, prompt: Prompt, sampling_config: SamplingConfig | None = None,
                       streaming: bool = False, lora_request: LoRARequest | None = None,
                       prompt_table=None, prompt_tasks: int | None = None) -> GenerationResult:
        """Submit one prompt (under the LoRA adapter `lora_request`, with the prompt table `prompt_table`, as in
        generate); returns at once. `await` the result, `async for` its streamed outputs (each with text_diff /
        token_ids_diff), or call `.result()`; `.abort()` stops it."""
        table = self._prompt_tables(prompt_table, prompt_tasks, 1)[0]
        request = self._make_request(prompt, sampling_config or self.get_default_sampling_config(), lora_request,
                                     table)
        return self._executor.submit(request, prompt, streaming)

    def abort(self, request_id: int) -> None:
        self._executor.abort(request_id)

    def update_weights(self, source) -> None:
        """Refit: replace the engine's weights with those of `source` without a rebuild — a Kiln checkpoint
        directory, a Hugging Face directory (read in the engine's dtype) or a state dict (Hugging Face or Kiln
        checkpoint names, the engine's dtypes) of the same architecture and shapes; a quantized engine takes weights
        quantized the same way. The engine must be built with BuildConfig.use_refit. With several ranks the source
        is a directory (unsharded, or a checkpoint of the engine's layout) that every rank reads its share of.

        Every name, shape and dtype (and a directory's model config) is checked first, from file headers, before
        anything is read: if anything differs, the error names the first tensor that does and nothing changes. Then
        the engine loop applies it once the requests submitted before this call have finished (requests submitted
        meanwhile wait, then run on the new weights: no request mixes the two), copying a layer at a time into the
        tensors the network already holds (CUDA graphs stay valid), and forgets every cached prefix. Returns once
        the new weights are in place."""
        if self._parallel is not None:
            if not isinstance(source, (str, Path)):
                raise ValueError(f"with {self.config.mapping.world_size} ranks, refit takes a directory every rank "
                                 "reads its share of, not a state dict: save it as a checkpoint first")
            source = str(Path(source).absolute())
        weights = self.engine.refit_source(source)                 # rank 0's share, checked here
        self._executor.run_when_idle(lambda: self.core.refit(self.engine, weights, source))

    def get_default_sampling_config(self) -> SamplingConfig:
        """What a request without a SamplingConfig decodes with: the sampling the model's generation_config.json
        recommends (temperature, top_k, top_p, min_p with do_sample; repetition_penalty), as vLLM does; greedy where
        it recommends nothing."""
        try:
            return SamplingConfig(**self._sampling_defaults)
        except (TypeError, ValueError) as err:
            raise ValueError(f"the model's generation_config.json has sampling settings Kiln cannot use: {err}") from None

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_config: SamplingConfig | Sequence[SamplingConfig] | None = None, use_tqdm: bool | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None):
        """The assistant's reply to a conversation (a list of {"role", "content"} messages) → one GenerationOutput,
        or to each of a list of conversations → a list; the prompt is the tokenizer's chat template with the
        assistant's turn opened. The other arguments are generate's."""
        single = isinstance(messages, Sequence) and len(messages) > 0 and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        if not conversations or isinstance(messages, str):
            conversations = [None]                          # refused below
        for conversation in conversations:
            if (not isinstance(conversation, Sequence) or not conversation
                    or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in conversation)):
                raise ValueError("chat takes a conversation — a non-empty list of {'role': str, 'content': str} "
                                 "messages — or a list of them")
        outputs = self.generate([self.apply_chat_template(list(c)) for c in conversations], sampling_config,
                                use_tqdm, lora_request)
        return outputs[0] if single else outputs

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat (a list of {"role", "content"}) with the prompt for the assistant's turn."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this engine's tokenizer has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def healthy(self) -> bool:
        """Whether the engine loop is running and accepts requests (for health checks)."""
        executor = getattr(self, "_executor", None)
        return executor is not None and executor.alive

    def stats(self) -> dict:
        """Runtime statistics: requests running/waiting, KV blocks used/free, prefix reuse, tokens per step."""
        return self.core.stats()

    def _configs(self, sampling_config, n: int) -> list[SamplingConfig]:
        if sampling_config is None or isinstance(sampling_config, SamplingConfig):
            return [sampling_config or self.get_default_sampling_config()] * n
        configs = list(sampling_config)
        if len(configs) != n:
            raise ValueError(f"{len(configs)} sampling configs for {n} prompts")
        return configs

    @staticmethod
    def _loras(lora_request, n: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        if isinstance(lora_request, (str, bytes)) or not isinstance(lora_request, Sequence):
            raise ValueError(f"lora_request must be a LoRARequest or a list of them (None for the base model), got "
                             f"{type(lora_request).__name__}")
        loras = list(lora_request)
        if len(loras) != n:
            raise ValueError(f"{len(loras)} LoRA requests for {n} prompts")
        return loras

    def _prompt_tables(self, prompt_table, prompt_tasks, n: int) -> list[PromptTable | None]:
        """One checked PromptTable (or None) per prompt."""
        tables = list(prompt_table) if isinstance(prompt_table, (list, tuple)) else [prompt_table] * n
        tasks = list(prompt_tasks) if isinstance(prompt_tasks, (list, tuple)) else [prompt_tasks] * n
        if len(tables) != n or len(tasks) != n:
            raise ValueError(f"{len(tables)} prompt tables and {len(tasks)} prompt tasks for {n} prompts: give one "
                             "for all or one per prompt")
        if prompt_table is None and prompt_tasks is not None:
            raise ValueError("prompt_tasks picks a task of a prompt_table; no prompt_table was given")
        config = self.config
        return [None if table is None else make_prompt_table(
                    table, task, hidden_size=config.hidden_size, dtype=getattr(torch, config.dtype),
                    max_rows=self._max_prompt_rows, vocab_size=config.vocab_size)
                for table, task in zip(tables, tasks)]

    def _encode(self, prompt: Prompt, table: PromptTable | None = None) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence):
            ids = list(prompt)
            vocab = self.config.vocab_size
            top = vocab + (0 if table is None else len(table.rows))
            if not (set(map(type, ids)) <= {int} and (not ids or 0 <= min(ids) and max(ids) < top)):
                # (the check above runs at C speed: a Python pass over the ids cost 85 µs a 128-token prompt)
                bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < top]
                if bad:
                    rows = "" if table is None else f" or the prompt table's ids [{vocab}, {top})"
                    raise ValueError(f"prompt token id {bad[0]!r} is not in the vocabulary [0, {vocab}){rows}")
        else:
            raise ValueError(f"a prompt is text or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        return ids

    def _make_request(self, prompt: Prompt, sampling: SamplingConfig, lora: LoRARequest | None = None,
                      table: PromptTable | None = None) -> Request:
        if not isinstance(sampling, SamplingConfig):
            raise ValueError(f"sampling_config must be a SamplingConfig, got {type(sampling).__name__}")
        if lora is not None and not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest (or None), got {type(lora).__name__}")
        ids, build_limits = self._encode(prompt, table), self.build_config
        if len(ids) > build_limits.max_input_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than the engine's max_input_len="
                             f"{build_limits.max_input_len}")
        if sampling.max_new_tokens > build_limits.max_output_len:
            raise ValueError(f"max_new_tokens={sampling.max_new_tokens} exceeds the engine's max_output_len="
                             f"{build_limits.max_output_len}")
        if len(ids) + sampling.max_new_tokens > build_limits.max_seq_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = "
                             f"{len(ids) + sampling.max_new_tokens} exceeds the engine's max_seq_len="
                             f"{build_limits.max_seq_len}")
        self._check_decoding(sampling)
        vocab = self.config.vocab_size
        for name, value in (("end_id", sampling.end_id), ("pad_id", sampling.pad_id)):
            if value is not None and value != -1 and not 0 <= value < vocab:
                raise ValueError(f"SamplingConfig.{name}={value} is not in the vocabulary [0, {vocab})")
        bad_stop = [t for t in sampling.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"SamplingConfig.stop_token_ids: {bad_stop[0]} is not in the vocabulary [0, {vocab})")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("SamplingConfig.stop needs a tokenizer; this engine has none")
        end_ids = self.eos_ids if sampling.end_id is None else ([] if sampling.end_id == -1 else [sampling.end_id])
        if lora is not None and lora.path is None:
            lora = self._stored_adapter(lora)
        request = Request(self._next_request_id + 1, ids, sampling, frozenset(end_ids), lora_request=lora,
                          prompt_table=table)
        self.core.scheduler.check_fits(request)
        if lora is not None:
            self.core.runner.lora.register(lora)         # read and checked now: a bad adapter fails this call
        self._next_request_id += 1
        return request

    def _stored_adapter(self, lora: LoRARequest) -> LoRARequest:
        """A LoRARequest without a path: the adapter of that name stored with the engine."""
        stored = self.engine.adapters
        if lora.name not in stored:
            have = f"it has {', '.join(sorted(stored))}" if stored else "it has none (LoraConfig.lora_dir)"
            raise ValueError(f"LoRARequest {lora.name!r} has no path and the engine stores no adapter of that name "
                             f"({have}); give the adapter's directory")
        return LoRARequest(lora.name, stored[lora.name], lora.id)

    def _check_decoding(self, sampling: SamplingConfig) -> None:
        build_limits, mode = self.build_config, self.decoding_mode
        if sampling.num_beams > build_limits.max_beam_width:
            raise ValueError(f"SamplingConfig.num_beams={sampling.num_beams} exceeds the engine's "
                             f"max_beam_width={build_limits.max_beam_width}")
        if sampling.use_beam_search and (sampling.stop or sampling.has_penalties):
            raise ValueError("beam search does not support stop strings or repetition/presence/frequency penalties")
        if sampling.num_sequences > 1 and build_limits.gather_generation_logits:
            raise ValueError("gather_generation_logits engines return generation logits for n=1, num_beams=1 only")
        if mode is DecodingMode.none:
            return
        if sampling.use_beam_search != (mode is DecodingMode.beam_search):
            raise ValueError(f"decoding_mode={mode.name} does not accept num_beams={sampling.num_beams}")
        if mode is DecodingMode.top_k and (sampling.top_p is not None or sampling.min_p is not None):
            raise ValueError("decoding_mode=top_k does not accept top_p or min_p")
        if mode is DecodingMode.top_p and sampling.top_k is not None:
            raise ValueError("decoding_mode=top_p does not accept top_k")

    def shutdown(self) -> None:
        """Stop the engine loop (and the worker ranks) and free the device memory; unfinished requests fail with a
        clear error."""
        self._stop(unfreeze=True)
        # Let go of the engine's weights too: an engine built on the device would otherwise stay there for as long
        # as this object lives (an engine the caller passed in stays theirs, untouched).
        self.engine = dataclasses.replace(self.engine, weights={})

    def _stop(self, unfreeze: bool) -> None:
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown()
            if unfreeze:                        # not from __del__: that may run inside a collection
                gc.unfreeze()
                gc.set_threshold(*self._gc_threshold)
                if executor.finished:           # the engine thread is gone: nothing uses the device memory
                    self.core.close()
        workers, parallel = getattr(self, "_workers", None), getattr(self, "_parallel", None)
        self._workers = self._parallel = None
        if parallel is not None and (workers is None or workers.failure() is None):
            try:
                parallel.broadcast(STOP)
            except Exception:  # noqa: BLE001 - a rank already gone: stop() below ends the rest
                pass
        if workers is not None:
            workers.stop()
        if parallel is not None:
            parallel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        self._stop(unfreeze=False)


def _check_launched_engine(model, world_size: int) -> None:
    """Under torchrun/Slurm/mpirun every rank loads its own shard: the model must be an engine of that many ranks."""
    path = Path(model) if isinstance(model, (str, Path)) else None
    if path is None or not is_engine_dir(path):
        raise ValueError(f"started as one of {world_size} ranks (WORLD_SIZE={world_size}): LLM needs a built engine "
                         f"directory with {world_size} ranks, got {model!r}; build one with kiln build first")
    from kiln.builder.engine import read_manifest

    engine_world = PretrainedConfig.from_dict(read_manifest(path)["pretrained_config"]).mapping.world_size
    if engine_world != world_size:
        raise ValueError(f"{path} has {engine_world} ranks but {world_size} processes were started "
                         f"(WORLD_SIZE={world_size}); start {engine_world}")


def _rank0_device(device: str | torch.device | None, parallel: ParallelConfig | None) -> torch.device:
    """Where rank 0 runs: `device`, or ParallelConfig.devices[0] when the config picks GPUs (checked against
    `device` and the GPUs this machine has), or the GPU if there is one."""
    devices = parallel.devices if parallel is not None else []
    if not devices:
        return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    asked = torch.device(device if device is not None else "cuda")
    if asked.type != "cuda" or not torch.cuda.is_available():
        where = f"device={str(device)!r} was asked" if device is not None else "this machine has no CUDA GPU"
        raise ValueError(f"ParallelConfig.devices={devices} picks CUDA GPUs, but {where}")
    if asked.index is not None and asked.index != devices[0]:
        raise ValueError(f"device={str(device)!r} disagrees with ParallelConfig.devices[0]={devices[0]} (rank 0's "
                         "GPU): give one of them")
    count = torch.cuda.device_count()
    missing = [d for d in devices if d >= count]
    if missing:
        raise ValueError(f"ParallelConfig.devices={devices} names GPUs {missing} this machine does not have (it has "
                         f"{count}: cuda:0..cuda:{count - 1})")
    torch.cuda.set_device(devices[0])
    return torch.device("cuda", devices[0])


def _serve_launched_worker(model, launched: tuple[int, int], device: torch.device, parallel: ParallelConfig):
    """Rank > 0 of an externally launched run: serve rank 0's steps, then end this process when it stops."""
    from kiln.builder.engine import load_engine_rank

    rank, world_size = launched
    serve_steps(rank, world_size, "env://", functools.partial(load_engine_rank, str(model)), device.type,
                parallel.timeout_s, tuple(parallel.devices))
    raise SystemExit(0)


def _progress(results: list[GenerationResult], show: bool):
    if not show:
        return results
    from kiln.utils.steps import progress

    return progress(results, "Generating", total=len(results))
