"""GPTQ: quantize a weight matrix column by column, pushing each column's rounding error onto the columns not
yet quantized, weighted by the inverse Hessian of the layer's calibration inputs (H = Σ xᵀx). Same int4 layout
as round-to-nearest (kiln.kernels.quant), so the runtime does not know the difference."""
from __future__ import annotations

import torch

from kiln.kernels.quant import pack_int4


def _group_grid(w: torch.Tensor, zero_point: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero) of one group from its current values (rows, group)."""
    if zero_point:
        low, high = w.amin(dim=1), w.amax(dim=1)
        scale = ((high - low) / 15.0).clamp_min(1e-8)
        return scale, -low / scale
    return w.abs().amax(dim=1).clamp_min(1e-8) / 7.0, None


def _round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels in [0, 15], dequantized values) of one column."""
    if zero is None:
        q = torch.round(w / scale).clamp(-8, 7)
        return q + 8, q * scale
    q = torch.round(w / scale + zero).clamp(0, 15)
    return q, (q - zero) * scale


@torch.no_grad()
def gptq_int4(w: torch.Tensor, hessian: torch.Tensor, group_size: int, zero_point: bool, block: int = 128,
              damp: float = 0.01):
    """(packed uint8 (out, in/2), scale (out, groups), zero or None) of w (out, in) quantized with GPTQ."""
    w = w.float().clone()
    out_features, in_features = w.shape
    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(in_features, device=h.device)
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    groups = -(-in_features // group_size)
    scales = torch.zeros(out_features, groups, device=w.device)
    zeros = torch.zeros(out_features, groups, device=w.device) if zero_point else None
    levels = torch.zeros(out_features, in_features, dtype=torch.uint8, device=w.device)
    for start in range(0, in_features, block):
        stop = min(start + block, in_features)
        w_block, errors = w[:, start:stop].clone(), torch.zeros(out_features, stop - start, device=w.device)
        h_block = h_inv[start:stop, start:stop]
        for i in range(stop - start):
            column = start + i
            if column % group_size == 0:
                g = column // group_size
                values = torch.cat([w_block[:, i:], w[:, stop:]], dim=1)[:, :group_size]
                scales[:, g], zero = _group_grid(values, zero_point)
                if zero_point:
                    zeros[:, g] = zero
            g = column // group_size
            q, dequant = _round(w_block[:, i], scales[:, g], zeros[:, g] if zero_point else None)
            levels[:, column] = q.to(torch.uint8)
            error = (w_block[:, i] - dequant) / h_block[i, i]
            w_block[:, i:] -= error[:, None] * h_block[i, i:][None, :]
            errors[:, i] = error
        w[:, stop:] -= errors @ h_inv[start:stop, stop:]
    return pack_int4(levels), scales, zeros
