"""Decode activations whose residual add or RMSNorm a weight-only GEMV folded into itself (one rank, ≤ 4 rows):
o_proj and down_proj add their output to the residual stream and sum its squares; RMSNorm then defers to the next
GEMV (qkv_proj, gate_up_proj), which normalizes x as it loads it (CUDA-core GEMV) or, given the sum already times
the norm's weight (int4_mma), multiplies its products by 1/rms. Only the kernels make or read them
(TritonOps.quant_linear_before_norm); the reference never folds."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ResidualSum:
    """x + residual, written into the residual's buffer by the GEMV that made x, and each of that GEMV's programs'
    sum of squares of its columns of every row: the next RMSNorm's statistics without another pass."""

    residual: torch.Tensor       # (T, hidden): the new residual stream
    sum_squares: torch.Tensor    # (T, programs) float32
    weighted: torch.Tensor | None = None   # residual times the next RMSNorm's weight (int4_mma), where it was given


@dataclass
class DeferredNorm:
    """rms_norm(residual, weight, eps), not yet applied: the GEMV that reads it normalizes each column of x as it
    loads it, 1/rms from the partial sums of squares."""

    residual: torch.Tensor
    sum_squares: torch.Tensor
    weight: torch.Tensor
    eps: float
    weighted: torch.Tensor | None = None   # weight · residual, made by the GEMV before: a GEMV that reads it
                                           # scales its products by 1/rms instead of normalizing x (int4_mma)

    @property
    def shape(self) -> torch.Size:
        return self.residual.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.residual.dtype
