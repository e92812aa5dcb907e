"""AWQ (activation-aware weight quantization), as AutoAWQ and llm-compressor do it, on int4 groups:

1. Scale search: per input channel factors s = x̄^α / w̄^(1-α) (x̄ the mean |input| of a channel, w̄ the mean of
   its weights relative to their group's largest), α on a grid in [0, 1); W·diag(s) is quantized and the op that
   feeds the layer absorbs 1/s (a norm's weight, or the rows of v_proj / up_proj), so the float function stays the
   same while the channels that carry large activations get finer steps.
2. Clipping search: per output row and group, the fraction of the weights' range that the grid spans.

Both choose by the layer's output error ‖X (W - Ŵ)ᵀ‖² = Σ (E H) ∘ E with H = XᵀX of the calibration inputs:
each candidate costs a product with H instead of a pass over the calibration tokens.
"""
from __future__ import annotations

from typing import Callable

import torch

from kiln.kernels.quant import int4_grid, int4_levels, int4_values

SCALE_GRID = 20                                         # α = 0, 1/20, ..., 19/20
CLIP_RATIOS = [1.0 - i / 40 for i in range(21)]          # 1.0 down to 0.5


def output_error(e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Σ over calibration tokens of ‖x eᵀ‖² for the weight error e (out, in), H = Σ xᵀx."""
    return ((e @ h) * e).sum()


def fake_quantize(w: torch.Tensor, group: int, zero_point: bool, ratio=1.0) -> torch.Tensor:
    """w rounded to its int4 grid (round to nearest), back in float."""
    scale, zero = int4_grid(w, group, zero_point, ratio)
    return int4_values(int4_levels(w, scale, zero), scale, zero)


def _spans(in_features: int, group: int) -> list[slice]:
    """The columns of each group (the last one may be shorter)."""
    return [slice(start, min(start + group, in_features)) for start in range(0, in_features, group)]


def _relative_weight(w: torch.Tensor, group: int) -> torch.Tensor:
    """w̄: per input channel, the mean over rows of |w| / the largest |w| of its group."""
    a = w.abs()
    return torch.cat([a[:, c] / a[:, c].amax(dim=1, keepdim=True).clamp_min(1e-8) for c in _spans(w.shape[1], group)],
                     dim=1).mean(dim=0)


def tie_heads(x: torch.Tensor, repeats: int, head_dim: int) -> torch.Tensor:
    """x over o_proj's inputs (heads·head_dim,) averaged over the query heads that share a KV head, so a scale
    built from it can be folded into v_proj's rows (grouped-query attention); repeats 1 leaves x as is."""
    if repeats == 1:
        return x
    shared = x.view(-1, repeats, head_dim).mean(dim=1, keepdim=True)
    return shared.expand(-1, repeats, -1).reshape(-1)


@torch.no_grad()
def search_scales(w: torch.Tensor, h: torch.Tensor, x_mean: torch.Tensor,
                  quantize: Callable[[torch.Tensor], torch.Tensor], group: int,
                  tie: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> torch.Tensor:
    """The per-input-channel scales s (in,) whose quantized W·diag(s)·diag(1/s) has the least output error; s = 1
    (plain rounding) is a candidate too, so the result is never worse than it on the calibration inputs."""
    w = w.float()
    x_mean, w_mean = tie(x_mean.float()).clamp_min(1e-8), tie(_relative_weight(w, group)).clamp_min(1e-8)
    best = torch.ones_like(x_mean)
    best_error = output_error(w - quantize(w), h)
    for step in range(SCALE_GRID):
        alpha = step / SCALE_GRID
        s = (x_mean.pow(alpha) / w_mean.pow(1 - alpha)).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        error = output_error(w - quantize(w * s) / s, h)
        if error < best_error:
            best, best_error = s, error
    return best


@torch.no_grad()
def search_clip(w: torch.Tensor, h: torch.Tensor, group: int, zero_point: bool,
                rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per (row, group), the fraction of the group's range the grid spans (out, groups) with the least output
    error of that group's columns (cross-group terms of H left out, as AutoAWQ); `rows` (bool, out) limits the
    search to some rows, the others keeping the full range."""
    w = w.float()
    spans = _spans(w.shape[1], group)
    best_ratio = torch.ones(w.shape[0], len(spans), device=w.device)
    best_error = torch.full((w.shape[0], len(spans)), torch.inf, device=w.device)
    for ratio in CLIP_RATIOS:
        e = w - fake_quantize(w, group, zero_point, ratio)
        error = torch.stack([((e[:, c] @ h[c, c]) * e[:, c]).sum(dim=1) for c in spans], dim=1)
        better = error < best_error
        best_ratio = torch.where(better, ratio, best_ratio)
        best_error = torch.where(better, error, best_error)
    if rows is not None:
        best_ratio[~rows] = 1.0
    return best_ratio

