"""One unit of a model in the checkpoint layout (a decoder layer, or the LM head) quantized: its linear groups (the
parts of one engine module: q/k/v, gate/up) with SmoothQuant factors folded into the norm before them, static
activation scales, round to nearest or the layer-by-layer results stored as the checkpoint's parts, its experts, its
KV-cache scales. Each function reads and replaces tensors of the unit's dict `weights`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.config import QuantConfig
from kiln.config.quant import GROUP_ALGOS
from kiln.kernels import quant

from .calibration import CalibrationStats
from .experts import PROJECTIONS as EXPERT_PROJECTIONS

INT8_MAX, FP8_MAX = 127.0, quant.FP8_MAX


@dataclass
class LayerResults:
    """What quantizing layer `index` layer by layer gave (sequential.quantize_layers)."""
    index: int
    tensors: dict[str, dict[str, torch.Tensor]]   # engine module → its quantized tensors, one row per output
    changed: dict[str, torch.Tensor]              # engine name → float weight AWQ changed
    kv: tuple[float, float]                       # largest |key|, |value| the quantized layer caches


def linear_groups(config, unit: int | str) -> list[tuple[str, list[str], str | None]]:
    """(fused engine module, its checkpoint parts, the norm before it that can absorb SmoothQuant factors) of decoder
    layer `unit`, or of the module `unit` outside the layers (the LM head has one, the embedding and norm none)."""
    if not isinstance(unit, int):
        return [("lm_head", ["lm_head"], None)] if unit == "lm_head" else []
    p = f"layers.{unit}."
    groups = [(p + "attn.qkv_proj", [p + "attn.q_proj", p + "attn.k_proj", p + "attn.v_proj"], p + "input_norm"),
              (p + "attn.o_proj", [p + "attn.o_proj"], None)]
    if not config.is_moe:
        groups += [(p + "mlp.gate_up_proj", [p + "mlp.gate_proj", p + "mlp.up_proj"], p + "post_attn_norm"),
                   (p + "mlp.down_proj", [p + "mlp.down_proj"], None)]
    return groups


def expert_groups(config, layer: int) -> list[tuple[str, list[str]]]:
    """(engine expert projection, its checkpoint parts) of an MoE layer."""
    if not config.is_moe:
        return []
    parts = {"moe.gate_up_proj": ["moe.gate_proj", "moe.up_proj"], "moe.down_proj": ["moe.down_proj"]}
    return [(f"layers.{layer}.{name}", [f"layers.{layer}.{part}" for part in parts[name]])
            for name in EXPERT_PROJECTIONS]


class UnitTensors(dict):
    """A unit's tensors: its float ones made (by `fetch(names)`, from the model's weights) only when a step needs
    them, and replaced by what the steps make."""

    def __init__(self, fetch, names: list[str]):
        super().__init__()
        self.fetch, self.pending = fetch, list(names)

    def need(self, *modules: str) -> None:
        """Make the float tensors not made yet of `modules` (module names, or tensor names)."""
        wanted = [n for n in self.pending if n in modules or n.rpartition(".")[0] in modules]
        self.pending = [n for n in self.pending if n not in wanted]
        self.update(self.fetch(wanted))


def quantize_unit(weights: UnitTensors, config, quant_config: QuantConfig, unit: int | str,
                  stats: CalibrationStats | None, results: LayerResults | None) -> UnitTensors:
    """Quantize decoder layer `unit` (or the module `unit` outside the layers: embed_tokens, norm, lm_head), whose
    checkpoint-layout float tensors `weights` makes group by group: with the layer-by-layer `results` where there
    are some (and AWQ's changed norms and biases), else by round to nearest (and SmoothQuant); static input scales
    and KV-cache scales from `stats` or `results`. Returns the unit's tensors."""
    layered = results.tensors if results is not None else {}
    groups = linear_groups(config, unit)
    if results is not None:
        weights.need(*results.changed, *(p + ".bias" for _, parts, _ in groups for p in parts))
        weights.update(_checkpoint_floats(groups, weights, results.changed))
    for fused, parts, norm in groups:
        weights.need(*parts)
        if fused in layered:
            _store_rows(weights, parts, layered[fused])
            if quant_config.static_activations:
                for part in parts:
                    weights[part + ".input_scale"] = _input_scale(stats.inputs[fused], FP8_MAX)
        elif quant_config.quantizes(fused):
            weights.need(*([norm] if norm else []))
            _quantize_group(weights, quant_config, quant_config.quant_algo, fused, parts, norm, stats)
    if isinstance(unit, int):
        _quantize_layer_rest(weights, config, quant_config, unit, stats, results)
    weights.need(*weights.pending)
    return weights


def _quantize_layer_rest(weights: UnitTensors, config, quant_config: QuantConfig, layer: int,
                         stats: CalibrationStats | None, results: LayerResults | None) -> None:
    """A decoder layer's experts and KV-cache scales."""
    layered = results.tensors if results is not None else {}
    for fused, parts in expert_groups(config, layer):
        if quant_config.quantizes(fused):
            weights.need(*parts)
            _quantize_experts(weights, quant_config, fused, parts, layered.get(fused), stats)
    if quant_config.kv_cache_quant_algo:
        limit = INT8_MAX if quant_config.kv_cache_quant_algo == "INT8" else FP8_MAX
        k, v = results.kv if results is not None else stats.kv[layer]
        weights[f"layers.{layer}.attn.kv_scale"] = torch.tensor([max(k, 1e-6) / limit, max(v, 1e-6) / limit])


def _store_rows(weights, parts: list[str], tensors: dict[str, torch.Tensor], sizes: list[int] | None = None,
                dim: int = 0) -> None:
    """A fused module's quantized tensors (one row per output along `dim`), split by rows into its checkpoint parts
    (of `sizes` rows; by default their weights'); int4 levels packed two to a byte."""
    sizes = sizes or [weights[p + ".weight"].shape[0] for p in parts]
    for name, tensor in tensors.items():
        for part, rows in zip(parts, tensor.split(sizes, dim=dim)):
            rows = rows.contiguous()
            if rows.dtype == torch.uint8:
                rows = quant.pack_int4(rows.flatten(0, -2)).view(*rows.shape[:-1], -1)
            weights[f"{part}.{name}"] = rows


def _quantize_experts(weights, quant_config: QuantConfig, fused: str, parts: list[str], calibrated: dict | None,
                      stats: CalibrationStats | None) -> None:
    """An MoE layer's stacked experts (checkpoint layout, (E, out, in) per part) replaced by their quantized tensors,
    each with a leading expert dimension: the layer-by-layer results where there are some, else each expert's
    matrices rounded to nearest; with static activations one input scale for all experts."""
    if calibrated is not None:
        _store_rows(weights, parts, calibrated, [weights[p].shape[1] for p in parts], dim=1)
    for part in parts:
        stacked = weights.pop(part)
        if calibrated is None:
            weights.update({f"{part}.{name}": t for name, t in round_experts(stacked, quant_config).items()})
        if quant_config.static_activations:
            weights[part + ".input_scale"] = _input_scale(stats.inputs[fused], FP8_MAX)


def _input_scale(x_max: torch.Tensor, limit: float) -> torch.Tensor:
    """A static per-tensor activation scale from the calibrated largest |input| per channel."""
    return torch.tensor([max(float(x_max.max()), 1e-6) / limit])


def _checkpoint_floats(groups, weights, changed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Engine-layout float weights (norms, biases; fused q/k/v and gate/up biases split) → checkpoint ones."""
    changed, out = dict(changed), {}
    for fused, parts, _ in groups:
        bias = changed.pop(fused + ".bias", None)
        if bias is not None:
            sizes = [weights[p + ".bias"].shape[0] for p in parts]
            out.update({p + ".bias": b.contiguous() for p, b in zip(parts, bias.split(sizes))})
    out.update(changed)
    return {name: value.to(weights[name].dtype) for name, value in out.items()}


def _quantize_group(weights, quant_config: QuantConfig, algo: str, fused: str, parts: list[str], norm: str | None,
                    stats: CalibrationStats | None) -> None:
    mats = [weights.pop(p + ".weight") for p in parts]
    smoother = None
    if algo.startswith("W8A8"):                           # SmoothQuant: move activation outliers into the weights
        x_max = stats.inputs[fused].to(mats[0].device).clamp_min(1e-5)
        w_max = torch.stack([_column_peaks(m) for m in mats]).amax(dim=0).clamp_min(1e-5)
        alpha = quant_config.smoothquant_val
        smoother = (x_max.pow(alpha) / w_max.pow(1 - alpha)).clamp(1e-4, 1e4)    # x W^T == (x / s) (W s)^T
        if norm is not None:                               # the norm feeding these layers absorbs 1/s
            weight = weights[norm + ".weight"]
            weights[norm + ".weight"] = (weight.float() / smoother).to(weight.dtype)
    input_scale = None
    if quant_config.static_activations:
        x_max = stats.inputs[fused].to(mats[0].device)
        if smoother is not None:
            x_max = x_max / smoother
        input_scale = _input_scale(x_max, INT8_MAX if algo.startswith("W8A8") else FP8_MAX)
    for part in parts:
        mat = mats.pop(0)
        weights.update({f"{part}.{name}": t for name, t in quantize_matrix(mat, algo, quant_config, smoother).items()})
        del mat
        if input_scale is not None:                        # one tensor per part: safetensors refuses shared memory
            weights[part + ".input_scale"] = input_scale.clone()
        if smoother is not None and norm is None:          # not absorbed: divided at run time
            weights[part + ".smoother"] = smoother.clone()


ROW_BLOCK = 1 << 24     # elements of a float32 block of rows rounded at once


def _row_blocks(w: torch.Tensor):
    """w's rows in blocks of about ROW_BLOCK elements, as float32 (each row is rounded on its own: the blocks give
    the values the whole matrix would, with small float32 copies)."""
    rows = max(1, ROW_BLOCK // max(1, w.shape[-1]))
    for start in range(0, w.shape[0], rows):
        yield start, w[start:start + rows].float()


def _column_peaks(w: torch.Tensor) -> torch.Tensor:
    """Largest |w| of each input column."""
    return torch.stack([block.abs().amax(dim=0) for _, block in _row_blocks(w)]).amax(dim=0)


def quantize_matrix(w: torch.Tensor, algo: str, quant_config: QuantConfig,
                    smoother: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The format's tensors (weight, weight_scale[, weight_zero]) of w (times the SmoothQuant factors `smoother`,
    per input column) rounded to nearest, a block of rows at a time."""
    out: dict[str, torch.Tensor] = {}
    for start, block in _row_blocks(w):
        made = _round_rows(block if smoother is None else block * smoother, algo, quant_config)
        for name, t in made.items():
            if name not in out:
                out[name] = torch.empty((w.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
            out[name][start:start + t.shape[0]] = t
    return out


def _round_rows(w: torch.Tensor, algo: str, quant_config: QuantConfig) -> dict[str, torch.Tensor]:
    if algo == "W8A16" or algo.startswith("W8A8"):
        q, scale = quant.quantize_int8(w)
        return {"weight": q, "weight_scale": scale}
    if algo.startswith("W4A16"):
        group = quant_config.group_size if algo in GROUP_ALGOS else None
        packed, scale, zero = quant.quantize_int4(w, group, quant_config.has_zero_point)
        return {"weight": packed, "weight_scale": scale, **({"weight_zero": zero} if zero is not None else {})}
    q, scale = quant.quantize_fp8(w)
    return {"weight": q, "weight_scale": scale}


def round_experts(stacked: torch.Tensor, quant_config: QuantConfig) -> dict[str, torch.Tensor]:
    """Stacked experts (E, out, in) rounded to nearest in quant_config's format: each of its tensors with a leading
    expert dimension (no input_scale)."""
    out: dict[str, torch.Tensor] = {}
    for e, w in enumerate(stacked):
        for name, t in quantize_matrix(w, quant_config.quant_algo, quant_config).items():
            if name not in out:
                out[name] = torch.empty((len(stacked), *t.shape), dtype=t.dtype, device=t.device)
            out[name][e] = t
    return out
