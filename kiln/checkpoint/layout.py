"""The Kiln checkpoint layout: tensor names and shapes for a PretrainedConfig (one rank, unfused).

A quantized linear layer keeps the same base name with the tensors of its format (kiln.kernels.quant):
`weight` (int8, packed int4 or fp8), `weight_scale`, and where the scheme needs them `weight_zero`,
`input_scale` (static activation scale) and `smoother` (SmoothQuant factors not folded into a norm).
MoE experts are stacked, (E, out, in) per projection; quantized, each tensor of the format gets that leading
expert dimension.
"""
from __future__ import annotations

import re

import torch

from kiln.config import PretrainedConfig

from .sharding import local_dims

_LAYER = re.compile(r"layers\.(\d+)\.")
_FLOAT32 = ("weight_scale", "weight_zero", "input_scale", "smoother", "kv_scale")   # quantization parameters
SPARSE_TARGETS = re.compile(r"layers\.\d+\.(attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
"""The weights 2:4 sparsity applies to (kiln convert --prune_2_4, BuildConfig.weight_sparsity): the decoder's
projections; not the embedding, LM head, MoE router or experts."""
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}


def engine_module_name(base: str) -> str:
    """layers.3.attn.k_proj → layers.3.attn.qkv_proj: quantization is decided per fused module."""
    head, _, last = base.rpartition(".")
    return f"{head}.{FUSED[last]}" if last in FUSED else base


def linear_shapes(base: str, out_features: int, in_features: int, bias: bool,
                  config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """The tensors of one linear layer, as `config.quantization` stores it."""
    quant = config.quantization
    shapes: dict[str, tuple[int, ...]] = {}
    algo = quant.quant_algo if quant.quantizes(engine_module_name(base)) else None
    if algo is None:
        shapes[base + ".weight"] = (out_features, in_features)
    elif algo.startswith("W4A16"):
        groups = -(-in_features // quant.group_size) if algo in ("W4A16_GPTQ", "W4A16_AWQ") else 1
        shapes[base + ".weight"] = (out_features, in_features // 2)
        shapes[base + ".weight_scale"] = (out_features, groups)
        if quant.has_zero_point:
            shapes[base + ".weight_zero"] = (out_features, groups)
    else:
        shapes[base + ".weight"] = (out_features, in_features)
        shapes[base + ".weight_scale"] = (out_features,)
        if quant.static_activations:
            shapes[base + ".input_scale"] = (1,)
        if algo.startswith("W8A8") and base.endswith(("o_proj", "down_proj")):
            shapes[base + ".smoother"] = (in_features,)
    if bias:
        shapes[base + ".bias"] = (out_features,)
    return shapes


def expert_shapes(base: str, experts: int, out_features: int, in_features: int,
                  config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """The tensors of one projection of a layer's experts: float `base` (E, out, in), or the tensors of
    `config.quantization`'s format with a leading expert dimension (a static input_scale: one for all)."""
    if not config.quantization.quantizes(engine_module_name(base)):
        return {base: (experts, out_features, in_features)}
    return {name: shape if name.endswith(".input_scale") else (experts, *shape)
            for name, shape in linear_shapes(base, out_features, in_features, False, config).items()}


def embedding_shape(config: PretrainedConfig) -> tuple[int, int]:
    """This rank's slice of the embedding table (kiln.checkpoint.sharding)."""
    tp, dims = config.mapping.tp_size, local_dims(config)
    if not config.use_parallel_embedding or tp == 1:
        return config.vocab_size, config.hidden_size
    if config.embedding_sharding_dim == 0:
        return dims.vocab_padded // tp, config.hidden_size
    return config.vocab_size, config.hidden_size // tp


def checkpoint_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `config` holds (this rank's share of it), with its shape."""
    dims, tp = local_dims(config), config.mapping.tp_size
    h, hd, inter = config.hidden_size, config.head_dim, dims.intermediate
    q_out, kv_out = dims.heads * hd, dims.kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {}
    if dims.first_stage or (config.tie_word_embeddings and dims.last_stage):
        shapes["embed_tokens.weight"] = embedding_shape(config)
    if dims.last_stage:
        shapes["norm.weight"] = (h,)
        if not config.tie_word_embeddings:
            shapes.update(linear_shapes("lm_head", dims.vocab_padded // tp, h, False, config))
    for i in dims.layers:
        p = f"layers.{i}."
        shapes[p + "input_norm.weight"] = (h,)
        shapes[p + "post_attn_norm.weight"] = (h,)
        for name, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            shapes.update(linear_shapes(f"{p}attn.{name}", out, h, config.attention_bias, config))
        shapes.update(linear_shapes(p + "attn.o_proj", h, q_out, config.dense_bias, config))
        if config.quantization.kv_cache_quant_algo:
            shapes[p + "attn.kv_scale"] = (2,)
        if config.is_moe:
            shapes[p + "moe.router.weight"] = (config.moe_num_experts, h)
            for name, out, inp in (("gate_proj", inter, h), ("up_proj", inter, h), ("down_proj", h, inter)):
                shapes.update(expert_shapes(f"{p}moe.{name}", len(dims.experts), out, inp, config))
        else:
            for name, out, inp in (("gate_proj", inter, h), ("up_proj", inter, h), ("down_proj", h, inter)):
                shapes.update(linear_shapes(f"{p}mlp.{name}", out, inp, config.mlp_bias, config))
    return shapes


def quantized_weight_dtype(algo: str) -> torch.dtype:
    return torch.uint8 if algo.startswith("W4A16") else torch.float8_e4m3fn if algo.startswith("FP8") else torch.int8


def tensor_dtypes(config: PretrainedConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.dtype]:
    """The dtype of each tensor of `shapes`: a quantized weight its format's, quantization parameters float32,
    every other tensor the model's dtype."""
    dtypes = {}
    for name in shapes:
        base, _, suffix = name.rpartition(".")
        if suffix in _FLOAT32:
            dtypes[name] = torch.float32
        elif suffix == "weight" and f"{base}.weight_scale" in shapes:
            dtypes[name] = quantized_weight_dtype(config.quantization.quant_algo)
        else:
            dtypes[name] = getattr(torch, config.dtype)
    return dtypes


def check_layer_count(weights: dict, config: PretrainedConfig, source: str) -> None:
    """The layers the config gives this rank are the layers the tensors hold. Checked before anything is sized by
    num_hidden_layers, so that a config claiming millions of layers fails at once instead of filling memory."""
    expected = local_dims(config).layers
    found = {int(m[1]) for name in weights if (m := _LAYER.match(name))}
    if len(found) != len(expected) or not all(i in expected for i in found):
        held = f"layers {min(found)}..{max(found)} ({len(found)} in all)" if found else "no layers"
        raise ValueError(f"{source}: num_hidden_layers={config.num_hidden_layers} gives this rank layers "
                         f"{expected.start}..{expected.stop - 1}, but the weights hold {held}")


def check_tensors(weights: dict, expected: dict[str, tuple[tuple[int, ...], torch.dtype]], source: str) -> None:
    """Every expected tensor present with its (shape, dtype), nothing unexpected; else a ValueError naming it
    (lazy weights are checked by their specs, nothing made)."""
    from .lazy import weight_specs

    missing = [n for n in expected if n not in weights]
    if missing:
        raise ValueError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    extra = [n for n in weights if n not in expected]
    if extra:
        raise ValueError(f"{source}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all)")
    specs = weight_specs(weights)
    for name, (shape, dtype) in expected.items():
        if tuple(specs[name].shape) != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(specs[name].shape)}, expected {shape}")
        if specs[name].dtype != dtype:
            raise ValueError(f"{source}: tensor {name!r} is {str(specs[name].dtype).removeprefix('torch.')}, "
                             f"expected {str(dtype).removeprefix('torch.')}")


def check_weights(weights: dict, config: PretrainedConfig, source: str) -> None:
    """The checkpoint-layout tensors of `config` (this rank's), each with its shape and dtype, and nothing else."""
    check_layer_count(weights, config, source)
    shapes = checkpoint_shapes(config)
    dtypes = tensor_dtypes(config, shapes)
    check_tensors(weights, {name: (shape, dtypes[name]) for name, shape in shapes.items()}, source)


def check_finite(name: str, tensor: torch.Tensor, source) -> None:
    """A floating-point tensor holds no NaN or Inf (checked in slices, so that the check needs little memory)."""
    if not tensor.is_floating_point() or tensor.element_size() < 2:
        return
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), 1 << 24):
        if not torch.isfinite(flat[start:start + (1 << 24)]).all():
            raise ValueError(f"{source}: tensor {name!r} holds NaN or Inf values (a damaged or diverged model)")
