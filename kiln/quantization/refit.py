"""Grid refit: with the int4 levels fixed, the per-group scales and zero points that minimise the layer's output
error ‖X (W - Ŵ)ᵀ‖² with the full H = XᵀX are a small linear least-squares problem per output row (Ŵ is linear in
them: ŵ = scale · q + bias per group, zero = -bias / scale). GPTQ and the clipping search fix the grid before the
levels; refitting after them, then rounding again on the refitted grid, lowers the output error further.
"""
from __future__ import annotations

import torch

from kiln.kernels.quant import int4_group_size, int4_values

RIDGE = 1e-6        # relative to the normal matrix's mean diagonal: keeps groups with a single level solvable


def row_output_errors(e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Per output row, the output error x eᵀ summed over the calibration inputs (H = Σ xᵀx): (out,)."""
    return ((e @ h) * e).sum(dim=1)


def _group_sums(x: torch.Tensor, groups: int, group: int) -> torch.Tensor:
    """(..., in) → (..., groups): sums over each group's columns (the last group may be shorter)."""
    pad = groups * group - x.shape[-1]
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], groups, group).sum(dim=-1)


def _normal_equations(w: torch.Tensor, h: torch.Tensor, q: torch.Tensor, groups: int, zero_point: bool):
    """(AᵀHA (out, k, k), AᵀHw (out, k)) per row for the unknowns [scales, biases], ŵ = A·[scales, biases]."""
    out_features, in_features = w.shape
    group = int4_group_size(in_features, groups)
    k = 2 * groups if zero_point else groups
    normal = torch.zeros(out_features, k, k, device=w.device)
    for g in range(groups):
        cols = slice(g * group, min((g + 1) * group, in_features))
        q_h = q[:, cols] @ h[cols, :]                                     # (out, in): q_gᵀ H_g,:
        normal[:, g, :groups] = _group_sums(q_h * q, groups, group)
        if zero_point:
            ones_h = h[cols, :].sum(dim=0)                                # (in,): 1_gᵀ H_g,:
            normal[:, g, groups:] = _group_sums(q_h, groups, group)
            normal[:, groups + g, :groups] = _group_sums(ones_h * q, groups, group)
            normal[:, groups + g, groups:] = _group_sums(ones_h, groups, group)
    wh = w @ h
    rhs = _group_sums(q * wh, groups, group)
    if zero_point:
        rhs = torch.cat([rhs, _group_sums(wh, groups, group).expand(out_features, groups)], dim=1)
    return normal, rhs


@torch.no_grad()
def refit_grid(w: torch.Tensor, h: torch.Tensor, levels: torch.Tensor, scale: torch.Tensor,
               zero: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, zero) for the fixed (out, in) levels with the least output error, row by row; a row keeps its
    old grid where the refit is not better (or not a valid grid: a scale that is not positive)."""
    w, zero_point, groups = w.float(), zero is not None, scale.shape[1]
    q = levels.float() - (0.0 if zero_point else 8.0)
    normal, rhs = _normal_equations(w, h, q, groups, zero_point)
    normal += RIDGE * torch.diagonal(normal, dim1=1, dim2=2).mean(dim=1)[:, None, None] * \
        torch.eye(normal.shape[1], device=w.device)
    solution = torch.linalg.solve(normal, rhs)
    new_scale = solution[:, :groups]
    new_zero = -solution[:, groups:] / new_scale if zero_point else None
    valid = (new_scale > 1e-8).all(dim=1) & torch.isfinite(solution).all(dim=1)
    new_scale = torch.where(valid[:, None], new_scale, scale)
    if zero_point:
        new_zero = torch.where(valid[:, None], new_zero, zero)
    better = row_output_errors(w - int4_values(levels, new_scale, new_zero), h) < \
        row_output_errors(w - int4_values(levels, scale, zero), h)
    return (torch.where(better[:, None], new_scale, scale),
            torch.where(better[:, None], new_zero, zero) if zero_point else None)
