"""FP8 products of few rows (decode steps) on the tensor cores, the weight as the MMA's wide side ("swap AB").

An MMA tile is at least 64 rows on Hopper's wgmma, so a product of one to sixteen activation rows wastes most of
each tile when the activations are the rows, as cuBLAS's kernels for x @ W^T do at batch 1. Here each program
computes out^T for BLOCK_N weight rows: tl.dot(W tile (BLOCK_N, BLOCK_K), x^T tile (BLOCK_K, 16)), so the weight
fills the tile and x (padded to 16 rows by masked loads) is the narrow side. The weight bytes are the e4m3 rows
torch._scaled_mm reads for longer products (no second layout); out = (x·W^T) · x_scale · w_scale in float32, then
out's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .launch import launch_args, wait_for_inputs

MAX_ROWS = 16
MIN_BLOCK_K = 32       # the K of one FP8 MMA


@triton.jit
def _fp8_decode_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr, M, N, K: tl.constexpr,
                       ROW_SCALES: tl.constexpr, IMPRECISE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                       PDL: tl.constexpr):
    """out (M ≤ 16, N) = (x @ w^T) · x_scale[m] · w_scale[n] (ROW_SCALES; else the one w_scale[0]); x (M, K) and w
    (N, K) e4m3, row-major; K a multiple of BLOCK_K. Rows of x past M load as zeros. IMPRECISE: products the
    tensor cores sum at their reduced precision before adding into float32 (None: Triton's default, all of them)."""
    ROWS: tl.constexpr = 16
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, ROWS)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < N
    m_ok = m < M
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * K + k[None, :]
    x_ptrs = x_ptr + m[None, :] * K + k[:, None]
    wait_for_inputs(PDL)
    acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
    for _ in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        acc = tl.dot(w, x, acc, max_num_imprecise_acc=IMPRECISE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    x_scale = tl.load(x_scale_ptr + m, mask=m_ok, other=0.0)
    if ROW_SCALES:
        acc = acc * tl.load(w_scale_ptr + n, mask=n_ok, other=0.0)[:, None] * x_scale[None, :]
    else:
        acc = acc * (tl.load(w_scale_ptr) * x_scale[None, :])
    tl.store(out_ptr + m[None, :] * N + n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=n_ok[:, None] & m_ok[None, :])


def config(n: int, k: int) -> tuple[int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of an (N, K) weight: tuning.FP8_DECODE_CONFIGS', else
    tuning.FP8_DECODE_CONFIG with BLOCK_K halved until it divides K; None where not even 32 does (the product stays
    on cuBLAS)."""
    if (n, k) in tuning.FP8_DECODE_CONFIGS:
        return tuning.FP8_DECODE_CONFIGS[n, k]
    block_n, block_k, warps, stages = tuning.FP8_DECODE_CONFIG
    while k % block_k:
        block_k //= 2
    return (block_n, block_k, warps, stages) if block_k >= MIN_BLOCK_K else None


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether fp8_decode_matmul computes this product: at most tuning.FP8_DECODE_ROWS rows and a K it steps
    evenly."""
    return x.shape[0] <= min(MAX_ROWS, tuning.FP8_DECODE_ROWS) and config(weight.shape[0], weight.shape[1]) is not None


def fp8_decode_matmul(qx: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      out_dtype: torch.dtype, fast_accumulation: bool = True,
                      tile: tuple[int, int, int, int] | None = None, launch: dict | None = None) -> torch.Tensor:
    """(qx @ weight^T) · x_scale · weight_scale as out_dtype: qx (M ≤ 16, K) e4m3 with one float32 scale per row
    (M or (M, 1)), weight (N, K) e4m3 with one scale per row (N) or one for all. fast_accumulation as
    torch._scaled_mm's use_fast_accum (off: sums promoted to float32 every 32 products). tile: (BLOCK_N, BLOCK_K,
    num_warps, num_stages), config's by default."""
    m, k = qx.shape
    n = weight.shape[0]
    block_n, block_k, warps, stages = tile or config(n, k)
    out = torch.empty((m, n), dtype=out_dtype, device=qx.device)
    _fp8_decode_kernel[(triton.cdiv(n, block_n),)](
        qx.contiguous(), x_scale.reshape(-1).contiguous(), weight, weight_scale.reshape(-1), out, m, n, k,
        ROW_SCALES=weight_scale.numel() > 1,
        IMPRECISE=None if fast_accumulation else 32, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, num_warps=warps,
        **launch_args(launch))
    return out
