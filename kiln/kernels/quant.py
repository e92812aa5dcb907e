"""Quantized weight formats (how a float matrix becomes integers or FP8 plus scales, and back) and the
reference matrix products on them.

All matrices are (out, in) like nn.Linear. Layouts (the names a checkpoint and an engine use):
- int8, per output channel: `weight` int8 (out, in), `weight_scale` (out,) float32; w ≈ q * scale.
- int4, per channel or per group of `group_size` input columns (the last group may be shorter): `weight` uint8
  (out, in/2) holding two 4-bit values per byte (low nibble = even column), `weight_scale` (out, groups) float32,
  and with a zero point (AWQ) `weight_zero` (out, groups) float32: w ≈ (q - zero) * scale, q in [0, 15];
  without one q - 8 is the signed value.
- fp8 (e4m3), per output channel: `weight` float8_e4m3fn (out, in), `weight_scale` (out,) float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.utils.int4 import pack_int4, unpack_int4

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def quantize_int4(w: torch.Tensor, group_size: int | None, zero_point: bool = False, ratio=1.0):
    """4-bit weights per group of input columns (group_size None: one group per row; a last group may be
    shorter). Returns (packed uint8 (out, in/2), scale (out, groups), zero (out, groups) or None). Zero points
    are kept as floats (w = q * scale + min exactly reproduces min/max grids such as GGUF's Q4_1). `ratio`
    (a number or (out, groups)) shrinks each group's range before the grid is laid: a clipping search's result."""
    if w.shape[1] % 2:
        raise ValueError(f"int4 quantization needs an even input size, got {w.shape[1]}")
    group = group_size or w.shape[1]
    scale, zero = int4_grid(w, group, zero_point, ratio)
    return pack_int4(int4_levels(w, scale, zero)), scale, zero


def int4_grid(w: torch.Tensor, group: int, zero_point: bool, ratio=1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, zero or None), each (out, groups), of the int4 grid spanning each group's range times `ratio`:
    min..max onto levels 0..15 with a (float) zero point, or ±max onto -7..7 without one."""
    out_features, in_features = w.shape
    groups = -(-in_features // group)
    g = _pad_columns(w.float(), groups * group).reshape(out_features, groups, group)
    real = _pad_columns(torch.ones_like(w, dtype=torch.bool), groups * group).reshape(g.shape)
    if not zero_point:
        return (g.abs().amax(dim=2) * ratio).clamp_min(1e-8) / 7.0, None
    low = torch.where(real, g, torch.inf).amin(dim=2) * ratio
    high = torch.where(real, g, -torch.inf).amax(dim=2) * ratio
    scale = ((high - low) / 15.0).clamp_min(1e-8)
    return scale, -low / scale


def int4_levels(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """(out, in) uint8 levels in [0, 15] of w on the grid (scale, zero) (one column of each per group)."""
    g = _grouped(w.float(), scale.shape[1])
    if zero is None:
        q = torch.round(g / scale[..., None]).clamp(-8, 7) + 8
    else:
        q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15)
    return q.reshape(w.shape[0], -1)[:, :w.shape[1]].to(torch.uint8)


def int4_positions(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """(out, in) float positions of w on the grid (scale, zero), before rounding: level q stands for q's own
    position (int4_levels rounds them, clamped to 0..15)."""
    g = _grouped(w.float(), scale.shape[1])
    offset = zero[..., None] if zero is not None else 8.0
    return (g / scale[..., None] + offset).reshape(w.shape[0], -1)[:, :w.shape[1]]


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(out, in) → (out, groups, group), the last group padded with zeros."""
    group = int4_group_size(x.shape[1], groups)
    return _pad_columns(x, groups * group).reshape(x.shape[0], groups, group)


def _pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))


def int4_group_size(in_features: int, groups: int) -> int:
    """The group size behind `groups` scales per row (group sizes are powers of two; one group: the row)."""
    if groups == 1:
        return in_features
    return 1 << (-(-in_features // groups) - 1).bit_length()


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    return int4_values(unpack_int4(packed), scale, zero)


def int4_values(levels: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """The float matrix that (out, in) levels in [0, 15] stand for on the grid (scale, zero)."""
    g = _grouped(levels.float(), scale.shape[1])
    offset = zero[..., None] if zero is not None else 8.0
    return ((g - offset) * scale[..., None]).reshape(levels.shape[0], -1)[:, :levels.shape[1]]


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel e4m3."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-8) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def quantize_activations_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token int8 (SmoothQuant's activations)."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8), scale


def quantize_activations_fp8(x: torch.Tensor, scale: torch.Tensor | None = None):
    """Per-token dynamic e4m3 scales, or a static per-tensor scale from calibration."""
    if scale is None:
        scale = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@dataclass
class Fp8Rows:
    """Activations already quantized per token to e4m3 by the kernel that made them (an RMSNorm or SiLU feeding a
    layer with per-token FP8 activations), so that the layer skips its own quantization pass."""

    values: torch.Tensor       # (T, K) float8_e4m3fn
    scale: torch.Tensor        # (T, 1) float32
    dtype: torch.dtype         # the model's dtype: the layer's output

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @classmethod
    def of(cls, x: torch.Tensor) -> "Fp8Rows":
        return cls(*quantize_activations_fp8(x), x.dtype)


# --- reference matrix products on quantized weights (the CPU path and the oracle) -----------------------------
def dequantize_weight(algo: str, params: dict) -> torch.Tensor:
    """The float32 matrix a quantized linear layer stands for."""
    if algo == "W8A16" or algo.startswith("W8A8"):
        return dequantize_int8(params["weight"], params["weight_scale"])
    if algo.startswith("W4A16"):
        return dequantize_int4(params["weight"], params["weight_scale"], params.get("weight_zero"))
    if algo.startswith("FP8"):
        return dequantize_fp8(params["weight"], params["weight_scale"])
    raise ValueError(f"unknown quantization {algo!r}")


def quant_linear(x: torch.Tensor | Fp8Rows, algo: str, params: dict, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for a quantized W. Weight-only modes compute in x's dtype; W8A8 and FP8 quantize the
    activations too (per token, or with the calibrated static scale `input_scale`) and accumulate in float; FP8
    rows come quantized already."""
    out = dense_product(x, algo, dequantize_weight(algo, params), params)
    return out if bias is None else out + bias


def dense_product(x: torch.Tensor | Fp8Rows, algo: str, weight: torch.Tensor, params: dict) -> torch.Tensor:
    """quant_linear's product (without the bias) on `weight`, the float matrix the quantized layer stands for."""
    if algo == "W8A16" or algo.startswith("W4A16"):
        return torch.nn.functional.linear(x, weight.to(x.dtype))
    qx, sx = (x.values, x.scale) if isinstance(x, Fp8Rows) else quantized_activations(x, algo, params)
    return (torch.nn.functional.linear(qx.float(), weight) * sx).to(x.dtype)


def quantized_activations(x: torch.Tensor, algo: str, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """x as W8A8 (int8) or FP8 layers quantize it: divided by the SmoothQuant smoother where there is one, then per
    token or by the calibrated static scale `input_scale`."""
    xs = x.float() / params["smoother"] if "smoother" in params else x.float()
    static = params.get("input_scale")
    if not algo.startswith("W8A8"):
        return quantize_activations_fp8(xs, static)
    if static is None:
        return quantize_activations_int8(xs)
    return torch.round(xs / static).clamp(-127, 127).to(torch.int8), static
