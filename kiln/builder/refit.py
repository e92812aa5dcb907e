"""Refit: the weights of another model of the same architecture and shapes, in an engine's runtime layout, checked
against the engine before any is read.

    weights = refit_source("ckpt_b/", engine.pretrained_config)   # names, shapes, dtypes, config: all checked
    for unit in weights.units():                                  # a layer at a time, each read when it is used
        ...                                                       # copied into the engine's tensors

A source is a Kiln checkpoint directory, a Hugging Face directory (or GGUF file, read in the engine's dtype), or a
state dict with Hugging Face names or Kiln checkpoint names (tensors of the engine's dtypes); each rank of a sharded
engine cuts its share of an unsharded source, or reads its own rank of a checkpoint of the engine's layout. A
quantized engine refits from weights quantized the same way (`kiln convert` with the engine's quantization flags);
a float source for it is refused, as Kiln cannot promise the engine's own rounding (calibrated scales, AWQ/GPTQ
searches) here.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping as MappingABC
from pathlib import Path

import torch

from kiln.checkpoint import (LazyWeights, check_weights, is_checkpoint_dir, load_checkpoint, load_checkpoint_config,
                             read_source_config, source_weights, weight_specs)
from kiln.checkpoint.hf import state_dict_weights
from kiln.checkpoint.lazy import layer_units, weights_device
from kiln.checkpoint.sharding import shard_view
from kiln.config import BuildConfig, Mapping, PretrainedConfig
from kiln.models import model_class
from kiln.utils.fs import exists_or_recovered

_HF_NAME = re.compile(r"model\.|(?:model\.)?layers\.\d+\.(?:self_attn|input_layernorm|post_attention_layernorm|"
                      r"block_sparse_moe)\.")
_PARALLEL = ("mapping", "use_parallel_embedding", "embedding_sharding_dim", "moe_tp_mode")


def check_refittable(build: BuildConfig) -> None:
    """Refit needs an engine built with use_refit."""
    if not build.use_refit:
        raise ValueError("this engine was built without BuildConfig.use_refit: rebuild it with use_refit=True "
                         "(kiln build --use_refit) to update its weights in place")


def refit_source(source, config: PretrainedConfig) -> LazyWeights:
    """The weights of `source` in the engine layout of `config` (one rank's: cut from an unsharded source, or read
    from the same rank of a checkpoint of the engine's layout), made a layer at a time when they are used. Checked
    first, from file headers and specs, nothing read: every tensor the engine has is there, nothing else, each of
    the engine's shape and dtype (the first that is not is named with both), and a directory's model config is the
    engine's (quantization first: a float source for a quantized engine is refused)."""
    full = dataclasses.replace(config, mapping=Mapping())           # the engine's model, unsharded
    if isinstance(source, MappingABC):
        where, weights, source_config = "state dict", _state_dict(source, full), None
    elif isinstance(source, (str, Path)):
        where, weights, source_config = str(source), *_directory(Path(source), config)
    else:
        raise ValueError(f"refit takes a Kiln checkpoint directory, a Hugging Face directory or a state dict (name → "
                         f"tensor), got {type(source).__name__}")
    if source_config is None or source_config.mapping.world_size == 1:
        check_weights(weights, full, where)                         # the whole model, before it is cut
        if config.mapping.world_size > 1:
            weights = shard_view(full, weights, config.mapping)
    model = model_class(config.architecture)(config, weights, source=where)     # this rank's share, checked
    if source_config is not None:
        _check_config(source_config, config, where)
    return model.engine_weights()


def _directory(path: Path, config: PretrainedConfig) -> tuple[LazyWeights, PretrainedConfig]:
    """(the checkpoint-layout weights of a checkpoint or HF directory or GGUF file, lazy: the whole model's, or
    `config`'s rank of a checkpoint of the engine's layout; its model config)."""
    if not exists_or_recovered(path):
        raise FileNotFoundError(f"refit source {str(path)!r} does not exist")
    if path.is_dir() and is_checkpoint_dir(path):
        source_config = load_checkpoint_config(path)
        _check_quantization(source_config, config, str(path))
        _check_ranks(source_config, config, str(path))
        rank = config.mapping.rank if source_config.mapping.world_size > 1 else 0
        return load_checkpoint(path, rank, lazy=True)[1], source_config
    source_config = read_source_config(path, config.dtype)           # read in the engine's dtype
    _check_quantization(source_config, config, str(path))
    return source_weights(path, source_config)[0], source_config


def _state_dict(state: MappingABC, config: PretrainedConfig) -> LazyWeights:
    """A state dict's tensors in the checkpoint layout, lazy: Hugging Face names converted a layer at a time (their
    dtypes checked first: nothing is cast), Kiln checkpoint names as they are."""
    wrong = next((name for name, t in state.items() if not isinstance(t, torch.Tensor)), None)
    if wrong is not None:
        raise ValueError(f"state dict: {wrong!r} is a {type(state[wrong]).__name__}, not a tensor")
    quantized = config.quantization.quant_algo or config.quantization.kv_cache_quant_algo
    if quantized and not any(name.endswith(("weight_scale", "kv_scale", ".scales")) for name in state):
        raise ValueError(_float_for_quantized("the state dict", config))
    if not any(_HF_NAME.match(name) for name in state):
        specs = weight_specs(state)
        return LazyWeights(specs, layer_units(specs), lambda names: {n: state[n] for n in names}, "state dict",
                           weights_device(state))
    dtype = getattr(torch, config.dtype)
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            raise ValueError(f"state dict: tensor {name!r} is {_name(tensor.dtype)}, the engine's weights are "
                             f"{_name(dtype)}: convert the state dict (.to(torch.{_name(dtype)})) first")
    return state_dict_weights(dict(state), config, "state dict")


def _check_quantization(source: PretrainedConfig, config: PretrainedConfig, where: str) -> None:
    """The source is quantized as the engine is (the algorithms; group sizes, zero points and excluded modules
    show in the tensors' names and shapes)."""
    ours, theirs = config.quantization, source.quantization
    if (ours.quant_algo or ours.kv_cache_quant_algo) and not (theirs.quant_algo or theirs.kv_cache_quant_algo):
        raise ValueError(_float_for_quantized(where, config))
    for name in ("quant_algo", "kv_cache_quant_algo"):
        if getattr(theirs, name) != getattr(ours, name):
            raise ValueError(f"{where} is quantized differently from the engine: {name}={getattr(theirs, name)!r}, "
                             f"the engine's is {getattr(ours, name)!r}; refit from weights quantized as the engine is")


def _float_for_quantized(where: str, config: PretrainedConfig) -> str:
    quant = config.quantization
    return (f"{where} holds float weights and the engine is quantized (quant_algo={quant.quant_algo!r}, "
            f"kv_cache_quant_algo={quant.kv_cache_quant_algo!r}): refit a quantized engine from a checkpoint "
            "quantized the same way (kiln convert with the engine's quantization flags, e.g. --round_to_nearest for "
            "weight-only modes), never from float weights")


def _check_ranks(source: PretrainedConfig, config: PretrainedConfig, where: str) -> None:
    """A checkpoint is unsharded (each rank cuts its share) or of the engine's own layout."""
    theirs, ours = source.mapping, config.mapping
    if theirs.world_size > 1 and (theirs.tp_size, theirs.pp_size) != (ours.tp_size, ours.pp_size):
        raise ValueError(f"{where} is a checkpoint of tp_size={theirs.tp_size}, pp_size={theirs.pp_size}; the engine "
                         f"has tp_size={ours.tp_size}, pp_size={ours.pp_size}: refit from an unsharded checkpoint or "
                         "one of the engine's layout")


def _check_config(source: PretrainedConfig, config: PretrainedConfig, where: str) -> None:
    """The source's model config is the engine's in every field that weights do not show (rotary base and
    scaling, norm epsilon, sliding window, ...): refit replaces weights, nothing else."""
    for field in dataclasses.fields(PretrainedConfig):
        if field.name in _PARALLEL + ("quantization", "dtype"):
            continue
        theirs, ours = getattr(source, field.name), getattr(config, field.name)
        if theirs != ours:
            raise ValueError(f"{where} is another model than the engine's: {field.name}={theirs!r}, the engine's is "
                             f"{ours!r}; refit replaces weights only: rebuild the engine for another model")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
