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

import torch

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


def quantize_int4(w: torch.Tensor, group_size: int | None, zero_point: bool = False):
    """4-bit weights per group of input columns (group_size None: one group per row; a last group may be
    shorter). Returns (packed uint8 (out, in/2), scale (out, groups), zero (out, groups) or None). Zero points
    are kept as floats (w = q * scale + min exactly reproduces min/max grids such as GGUF's Q4_1)."""
    out_features, in_features = w.shape
    if in_features % 2:
        raise ValueError(f"int4 quantization needs an even input size, got {in_features}")
    group = group_size or in_features
    groups = -(-in_features // group)
    g = _pad_columns(w.float(), groups * group).reshape(out_features, groups, group)
    real = _pad_columns(torch.ones_like(w, dtype=torch.bool), groups * group).reshape(g.shape)
    if zero_point:
        low = torch.where(real, g, torch.inf).amin(dim=2)
        high = torch.where(real, g, -torch.inf).amax(dim=2)
        scale = ((high - low) / 15.0).clamp_min(1e-8)
        zero = -low / scale
        q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15)
    else:
        scale = g.abs().amax(dim=2).clamp_min(1e-8) / 7.0
        zero = None
        q = torch.round(g / scale[..., None]).clamp(-8, 7) + 8
    q = q.reshape(out_features, groups * group)[:, :in_features]
    return pack_int4(q.to(torch.uint8)), scale, zero


def _pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(out, in) values in [0, 15] → (out, in/2) bytes, even columns in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(out, in/2) bytes → (out, in) values in [0, 15]."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def int4_group_size(in_features: int, groups: int) -> int:
    """The group size behind `groups` scales per row (group sizes are powers of two; one group: the row)."""
    if groups == 1:
        return in_features
    return 1 << (-(-in_features // groups) - 1).bit_length()


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    q = unpack_int4(packed).float()
    out_features, in_features = q.shape
    group = int4_group_size(in_features, scale.shape[1])
    column_group = torch.arange(in_features, device=q.device) // group            # group of each column
    offset = zero[:, column_group] if zero is not None else 8.0
    return (q - offset) * scale[:, column_group]


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


def quant_linear(x: torch.Tensor, algo: str, params: dict, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for a quantized W. Weight-only modes compute in x's dtype; W8A8 and FP8 quantize the
    activations too (per token, or with the calibrated static scale `input_scale`) and accumulate in float."""
    weight = dequantize_weight(algo, params)
    if algo == "W8A16" or algo.startswith("W4A16"):
        out = torch.nn.functional.linear(x, weight.to(x.dtype))
    else:
        xs = x.float()
        if "smoother" in params:
            xs = xs / params["smoother"]
        static = params.get("input_scale")
        if algo.startswith("W8A8"):
            if static is None:
                qx, sx = quantize_activations_int8(xs)
            else:
                qx, sx = torch.round(xs / static).clamp(-127, 127), static
        else:
            qx, sx = quantize_activations_fp8(xs, static)
        out = (torch.nn.functional.linear(qx.float(), weight) * sx).to(x.dtype)
    return out if bias is None else out + bias
