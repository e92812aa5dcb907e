"""GPTQ: quantize a weight matrix column by column, pushing each column's rounding error onto the columns not
yet quantized, weighted by the inverse Hessian of the layer's calibration inputs (H = XᵀX).

As AutoGPTQ with `desc_act=True, static_groups=True`: columns are visited in order of decreasing H diagonal
(act order: the inputs that carry the most energy are rounded first, while there is the most freedom left to
compensate), and every group's grid (scale, zero) is fixed before the pass from the weights themselves, so the
levels keep the plain sequential group layout (kiln.kernels.quant) and the runtime does not know the difference.
"""
from __future__ import annotations

from typing import Callable

import torch

from kiln.kernels.quant import FP8, FP8_MAX, int4_group_size, int4_levels

DAMP = 0.01      # fraction of H's mean diagonal added to it (AutoGPTQ's damp_percent)
BLOCK = 128      # columns updated lazily together


def inverse_hessian_factor(h: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp·mean(diag H)·I)⁻¹; dead inputs (zero diagonal) get a unit diagonal."""
    h = h.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], device=h.device)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


@torch.no_grad()
def gptq(w: torch.Tensor, hessian: torch.Tensor, round_column: Callable[[torch.Tensor, int], torch.Tensor],
         act_order: bool = True, damp: float = DAMP) -> torch.Tensor:
    """w (out, in) quantized: each column c's values rounded by round_column(values, c) (→ their quantized float
    values), in act order, the rounding error spread over the columns still to come."""
    out_features, in_features = w.shape
    order = torch.argsort(torch.diag(hessian), descending=True) if act_order else torch.arange(in_features)
    # Columns are kept as rows (w transposed) so that each column's updates run over contiguous memory; every value
    # is computed by the same operations as on (out, in) matrices, and the lazy block update by the same product.
    w_t = w.float()[:, order].t().contiguous()                          # (in, out), act order
    w_t[torch.diag(hessian)[order] == 0] = 0.0
    h_inv = inverse_hessian_factor(hessian[order][:, order], damp)
    columns = order.tolist()                                   # read once: no device sync per column
    result_t = torch.empty_like(w_t)
    for start in range(0, in_features, BLOCK):
        stop = min(start + BLOCK, in_features)
        block, errors = w_t[start:stop].clone(), torch.empty(stop - start, out_features, device=w.device)
        h_block = h_inv[start:stop, start:stop]
        for i in range(stop - start):
            result_t[start + i] = round_column(block[i], columns[start + i])
            error = (block[i] - result_t[start + i]) / h_block[i, i]
            block[i:] -= h_block[i, i:][:, None] * error[None, :]
            errors[i] = error
        w_t[stop:] -= (errors.t().contiguous() @ h_inv[start:stop, stop:]).t()
    return result_t[torch.argsort(order)].t().contiguous()


def gptq_int4(w: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
              rounded: torch.Tensor | None = None) -> torch.Tensor:
    """(out, in) uint8 levels of w on the fixed int4 grid (scale, zero), each (out, groups), by GPTQ. `rounded`,
    where given (out, in), receives the values each column was rounded from (w plus the errors pushed onto it)."""
    group = int4_group_size(w.shape[1], scale.shape[1])
    offset = zero if zero is not None else torch.full_like(scale, 8.0)

    def round_column(values, column):
        if rounded is not None:
            rounded[:, column] = values
        s, z = scale[:, column // group], offset[:, column // group]
        return (torch.round(values / s + z).clamp(0, 15) - z) * s

    return int4_levels(gptq(w, hessian, round_column), scale, zero)


def gptq_int8(w: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(out, in) int8 levels of w / scale (symmetric, scale per output row, (out,)) by GPTQ."""
    def round_column(values, _column):
        return torch.round(values / scale).clamp(-127, 127) * scale

    return torch.round(gptq(w, hessian, round_column) / scale[:, None]).clamp(-127, 127).to(torch.int8)


def gptq_fp8(w: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(out, in) e4m3 values of w / scale (scale per output row, (out,)) by GPTQ."""
    def round_column(values, _column):
        return (values / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale

    return (gptq(w, hessian, round_column) / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
