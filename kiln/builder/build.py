"""build(model, BuildConfig) → Engine: validate, fuse into the runtime layout, check the network."""
from __future__ import annotations

import sys
from pathlib import Path

from kiln.checkpoint.layout import SPARSE_TARGETS
from kiln.checkpoint.lazy import LazyWeights, meta_tensors
from kiln.checkpoint.lora import load_adapter
from kiln.config import BuildConfig, Mapping
from kiln.kernels.sparse import check_2_4
from kiln.models import PretrainedModel
from kiln.utils.steps import StepLog

from .engine import Engine


def build(model: PretrainedModel, build_config: BuildConfig | None = None, quiet: bool = False) -> Engine:
    """Turn a loaded model into an engine. Each step prints its name, time and peak memory. A model with lazy
    weights gives an engine with lazy weights (fused a layer at a time when they are saved or loaded onto a
    device). With auto_parallel_config enabled over several GPUs, the (unsharded) model is split as
    build_auto_parallel chooses."""
    build_config = build_config or BuildConfig()
    auto = build_config.auto_parallel_config
    if auto.enabled and auto.world_size > 1:
        return build_auto_parallel(model, build_config, auto.world_size, auto.max_memory_MB * 2**20, quiet)
    return _build_rank(model, build_config, quiet)


def _build_rank(model: PretrainedModel, build_config: BuildConfig, quiet: bool) -> Engine:
    log = StepLog("Build", 3, quiet)
    with log.step("Validate the build config against the model"):
        _validate(model, build_config, log)
    fuse = "(a layer at a time as they are used)" if isinstance(model.weights, LazyWeights) else ""
    with log.step(f"Fuse weights into the runtime layout (q/k/v, gate/up) {fuse}".rstrip()):
        weights = model.engine_weights()
    with log.step("Check the network against its weights"):
        network = model.network_class.load(model.config, meta_tensors(weights), build_config.max_seq_len,
                                           device="meta")
        text = describe_network(network, build_config.profiling_verbosity) if build_config.visualize_network else None
    log.done()
    return Engine(model.config, build_config, {model.config.mapping.rank: weights}, model.tokenizer_files, text,
                  adapters={Path(d).name: str(d) for d in build_config.lora_config.lora_dir})


def _validate(model: PretrainedModel, build_config: BuildConfig, log: StepLog) -> None:
    config = model.config
    if build_config.max_seq_len > config.max_position_embeddings:
        raise ValueError(f"BuildConfig.max_seq_len={build_config.max_seq_len} exceeds the model's "
                         f"max_position_embeddings={config.max_position_embeddings}")
    plugins = build_config.plugin_config
    for name in ("gemm_plugin", "gpt_attention_plugin"):
        value = getattr(plugins, name)
        if value not in ("auto", "disable", config.dtype):
            raise ValueError(f"PluginConfig.{name}={value!r} differs from the model dtype {config.dtype!r}; "
                             "use auto or the model's dtype")
    if plugins.lora_plugin not in (None, "auto", config.dtype):
        raise ValueError(f"PluginConfig.lora_plugin={plugins.lora_plugin!r} differs from the model dtype "
                         f"{config.dtype!r}: Kiln computes LoRA products in the model's dtype; use auto")
    if plugins.use_fp8_context_fmha and config.quantization.kv_cache_quant_algo != "FP8":
        raise ValueError("PluginConfig.use_fp8_context_fmha multiplies queries by the keys of an FP8 KV cache: it "
                         "needs kv_cache_quant_algo FP8 (kiln convert --fp8_kv_cache), this model's is "
                         f"{config.quantization.kv_cache_quant_algo}")
    if plugins.use_custom_all_reduce and config.mapping.tp_size == 1:
        raise ValueError("PluginConfig.use_custom_all_reduce needs tensor parallelism (tp_size > 1)")
    if build_config.input_timing_cache or build_config.output_timing_cache:
        raise ValueError("timing caches come from compiling the kernels on a GPU: use `kiln build` there, or "
                         "kiln.runtime.precompile.compile_kernels(engine) after build()")
    if build_config.visualize_network and build_config.profiling_verbosity == "none":
        raise ValueError("BuildConfig.visualize_network needs profiling_verbosity layer_names_only or detailed")
    if not build_config.strongly_typed:
        log.say("note: strongly_typed=False has no effect: Kiln engines always keep the checkpoint's dtypes")
    if not build_config.use_fused_mlp:
        log.say("note: use_fused_mlp=False has no effect: Kiln always fuses the gate and up projections")
    lora = build_config.lora_config
    for adapter in lora.lora_dir if config.mapping.rank == 0 else ():      # read and checked once, not per rank
        load_adapter(adapter, config, lora.max_lora_rank, lora.target_modules, Path(adapter).name)
    if build_config.weight_sparsity:
        _check_sparse(model, build_config)


def _check_sparse(model: PretrainedModel, build_config: BuildConfig) -> None:
    """weight_sparsity: float weights, not refittable, and every target weight 2:4 sparse (each read once)."""
    algo = model.config.quantization.quant_algo
    if algo is not None:
        raise ValueError(f"weight_sparsity runs float weights on the sparse path; this model's are quantized ({algo}): "
                         "build the float checkpoint, or without weight_sparsity")
    if build_config.use_refit:
        raise ValueError("weight_sparsity with use_refit is not supported yet (refit copies dense weights in place)")
    weights = model.weights
    names = [name for name in weights if SPARSE_TARGETS.search(name)]
    tensors = weights.iter_take(names) if isinstance(weights, LazyWeights) else ((n, weights[n]) for n in names)
    for name, tensor in tensors:
        check_2_4(tensor, f"weight_sparsity: {name}")


def describe_network(network, verbosity: str) -> str:
    """The module graph as text: the module tree, plus every parameter's shape and dtype when detailed."""
    lines = [repr(network)]
    if verbosity == "detailed":
        lines.append("")
        lines += [f"{name}\t{tuple(p.shape)}\t{str(p.dtype).removeprefix('torch.')}"
                  for name, p in network.named_parameters()]
    return "\n".join(lines) + "\n"


def build_all_ranks(load_rank, world_size: int, build_config: BuildConfig | None = None, quiet: bool = False,
                    workers: int = 1) -> Engine:
    """One engine holding every rank: `load_rank(rank)` gives each rank's model (e.g. from_checkpoint(dir, rank));
    `workers` ranks are loaded and built at a time (threads)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(rank: int) -> Engine:
        return _build_rank(load_rank(rank), build_config or BuildConfig(), quiet=quiet or rank > 0)

    with ThreadPoolExecutor(max_workers=max(1, min(workers, world_size))) as pool:
        parts = list(pool.map(one, range(world_size)))
    engine = parts[0]
    for part in parts[1:]:
        engine.weights.update(part.weights)
    return engine


def build_sharded(model: PretrainedModel, build_config: BuildConfig, tp_size: int, pp_size: int,
                  quiet: bool = False, workers: int = 1) -> Engine:
    """Shard an unsharded model over tp_size × pp_size ranks and build each rank."""
    mapping = Mapping(tp_size * pp_size, 0, tp_size, pp_size)
    if mapping.world_size == 1:
        return _build_rank(model, build_config, quiet)
    return build_all_ranks(lambda rank: model.shard(mapping.for_rank(rank)), mapping.world_size, build_config, quiet,
                           workers)


def build_auto_parallel(model: PretrainedModel, build_config: BuildConfig, world_size: int,
                        max_memory_bytes: int | None = None, quiet: bool = False, workers: int = 1) -> Engine:
    """Choose tp × pp for `world_size` ranks (and a per-rank memory limit), say why, shard and build; with
    build_config.auto_parallel_config.debug_mode, print every candidate of the search."""
    from .auto_parallel import choose_parallelism, describe_search

    if model.config.mapping.world_size > 1:
        raise ValueError("auto_parallel needs an unsharded model or checkpoint; this one is already sharded")
    tp, pp, why = choose_parallelism(model.config, world_size, max_memory_bytes)
    if build_config.auto_parallel_config.debug_mode:
        print("\n".join(describe_search(model.config, world_size, max_memory_bytes, (tp, pp))), file=sys.stderr)
    if not quiet:
        print(f"auto_parallel: {why}", file=sys.stderr)
    return build_sharded(model, build_config, tp, pp, quiet, workers)
