"""Hugging Face tensor names and shapes → the Kiln checkpoint layout, a unit at a time.

Each Kiln tensor comes from one HF tensor (renamed and cast), from a layer's experts (stacked, (E, out, in)), from
one half of a fused experts tensor (gate/up split), or, for AutoAWQ/AutoGPTQ checkpoints, from a layer's packed
tensors (prequantized.py). The units are known from the names and shapes alone (`hf_units`), before anything is
read; `convert_unit` makes one from its HF tensors, each freed as soon as it is consumed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from kiln.config import PretrainedConfig

from .layout import check_finite
from .lazy import TensorSpec, unit_key
from .prequantized import SUFFIXES, convert_layer

# HF name (after removing a leading "model.") → Kiln checkpoint name.
_NAME_RULES = [
    (re.compile(r"embed_tokens\.weight"), "embed_tokens.weight"),
    (re.compile(r"norm\.weight"), "norm.weight"),
    (re.compile(r"lm_head\.weight"), "lm_head.weight"),
    (re.compile(r"layers\.(\d+)\.self_attn\.([qkvo]_proj)\.(weight|bias)"), r"layers.\1.attn.\2.\3"),
    (re.compile(r"layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.(weight|bias)"), r"layers.\1.mlp.\2.\3"),
    (re.compile(r"layers\.(\d+)\.input_layernorm\.weight"), r"layers.\1.input_norm.weight"),
    (re.compile(r"layers\.(\d+)\.post_attention_layernorm\.weight"), r"layers.\1.post_attn_norm.weight"),
    (re.compile(r"layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight"), r"layers.\1.moe.router.weight"),
]
_EXPERT = re.compile(r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_FUSED_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class HFTensor:
    """One tensor of a Hugging Face model, known before it is read: its shape and the file it is in."""
    shape: tuple[int, ...]
    path: Path | str


@dataclass
class HFUnit:
    """Kiln tensors made together (`outputs`) from the HF tensors `inputs` (experts: in expert order)."""
    kind: str                    # "plain", "experts", "fused_experts" or "packed"
    outputs: list[str]
    inputs: list[str]


def hf_units(tensors: dict[str, HFTensor], config: PretrainedConfig) -> list[HFUnit]:
    """The units that make the Kiln layout from the HF tensors `tensors` (name → HFTensor), in layer order; an HF
    name the architecture does not have is a ValueError naming it and its file."""
    units: dict[str, HFUnit] = {}
    experts: dict[str, dict[int, str]] = {}
    for hf_name, info in tensors.items():
        name = hf_name.removeprefix("model.")
        base, _, suffix = name.rpartition(".")
        if _IGNORED.fullmatch(name):
            continue
        if suffix in SUFFIXES and config.quantization.quant_algo:
            kiln_base = _rename(base + ".weight", hf_name, info.path)[:-len(".weight")]
            unit = units.setdefault(kiln_base, HFUnit("packed", [f"{kiln_base}.{k}" for k in PACKED_OUTPUTS], []))
            unit.inputs.append(hf_name)
        elif m := _EXPERT.fullmatch(name):
            experts.setdefault(f"layers.{m[1]}.moe.{_EXPERT_NAMES[m[3]]}", {})[int(m[2])] = hf_name
        elif m := _FUSED_EXPERTS.fullmatch(name):
            parts = ["gate_proj", "up_proj"] if m[2] == "gate_up_proj" else ["down_proj"]
            units[hf_name] = HFUnit("fused_experts", [f"layers.{m[1]}.moe.{p}" for p in parts], [hf_name])
        else:
            kiln_name = _rename(name, hf_name, info.path)
            if not (kiln_name == "lm_head.weight" and config.tie_word_embeddings):
                units[kiln_name] = HFUnit("plain", [kiln_name], [hf_name])
    for kiln_name, per_expert in experts.items():
        units[kiln_name] = HFUnit("experts", [kiln_name], [per_expert[e] for e in sorted(per_expert)])
    return sorted(units.values(), key=lambda u: (unit_key(u.outputs[0]), u.outputs[0]))


PACKED_OUTPUTS = ("weight", "weight_scale", "weight_zero")


def unit_specs(unit: HFUnit, tensors: dict[str, HFTensor], config: PretrainedConfig) -> dict[str, TensorSpec]:
    """The shapes and dtypes `convert_unit` gives the unit's tensors."""
    dtype = DTYPES[config.dtype]
    first = tensors[unit.inputs[0]].shape
    if unit.kind == "plain":
        return {unit.outputs[0]: TensorSpec(first, dtype)}
    if unit.kind == "experts":
        return {unit.outputs[0]: TensorSpec((len(unit.inputs), *first), dtype)}
    if unit.kind == "fused_experts":
        halves = torch.empty(first, device="meta").chunk(len(unit.outputs), dim=1)
        return {name: TensorSpec(tuple(half.shape), dtype) for name, half in zip(unit.outputs, halves)}
    return _packed_specs(unit, tensors, config)


def _packed_specs(unit: HFUnit, tensors: dict[str, HFTensor], config: PretrainedConfig) -> dict[str, TensorSpec]:
    """AWQ qweight (in, out/8) or GPTQ qweight (in/8, out), scales (in/g, out) → weight (out, in/2) uint8, scale
    and zero (out, in/g) float32."""
    shapes = {name.rpartition(".")[2]: tensors[name].shape for name in unit.inputs}
    if not {"qweight", "scales"} <= shapes.keys() or len(shapes["qweight"]) != 2 or len(shapes["scales"]) != 2:
        raise ValueError(f"{tensors[unit.inputs[0]].path}: the packed layer {unit.outputs[0][:-len('.weight')]!r} "
                         "lacks its qweight or scales (or they are not matrices)")
    groups, out = shapes["scales"]
    rows = shapes["qweight"][0]
    inputs = rows if config.quantization.quant_algo == "W4A16_AWQ" else rows * 8
    weight, scale, zero = unit.outputs
    return {weight: TensorSpec((out, inputs // 2), torch.uint8), scale: TensorSpec((out, groups), torch.float32),
            zero: TensorSpec((out, groups), torch.float32)}


def convert_unit(unit: HFUnit, inputs: Iterator[tuple[str, torch.Tensor]], paths: dict[str, Path | str],
                 config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """The unit's Kiln tensors from its HF tensors, given one at a time as (HF name, tensor), cast to config.dtype
    and checked for NaN/Inf; each is released once it is copied in."""
    dtype = DTYPES[config.dtype]
    if unit.kind == "packed":
        layer = {}
        for hf_name, tensor in inputs:
            check_finite(hf_name, tensor, paths[hf_name])
            layer[hf_name.rpartition(".")[2]] = tensor
        made = convert_layer(layer, config.quantization)
        return {f"{unit.outputs[0][:-len('.weight')]}.{k}": v for k, v in made.items()}
    if unit.kind == "experts":
        position = {name: e for e, name in enumerate(unit.inputs)}
        stacked = None
        for hf_name, tensor in inputs:
            tensor = _cast(hf_name, tensor, dtype, paths)
            if stacked is None:
                stacked = torch.empty((len(unit.inputs), *tensor.shape), dtype=dtype)
            stacked[position[hf_name]] = tensor
        return {unit.outputs[0]: stacked}
    hf_name, tensor = next(inputs)
    tensor = _cast(hf_name, tensor, dtype, paths)
    if unit.kind == "plain":
        return {unit.outputs[0]: tensor}
    halves = tensor.chunk(len(unit.outputs), dim=1)         # (E, 2I, H): gate rows first
    return {name: half.contiguous() for name, half in zip(unit.outputs, halves)}


def _cast(hf_name: str, tensor: torch.Tensor, dtype: torch.dtype, paths: dict) -> torch.Tensor:
    tensor = tensor.to(dtype)
    check_finite(hf_name, tensor, paths[hf_name])     # after the cast: float32 values beyond float16's range are Inf
    return tensor


def _rename(name: str, hf_name: str, path: Path | str) -> str:
    for pattern, replacement in _NAME_RULES:
        if pattern.fullmatch(name):
            return pattern.sub(replacement, name)
    raise ValueError(f"{path}: unexpected tensor {hf_name!r} for this architecture")
