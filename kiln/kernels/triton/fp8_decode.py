"""FP8 products of few rows (decode steps) on the tensor cores, the weight as the MMA's wide side ("swap AB").

An MMA tile is at least 64 rows on Hopper's wgmma, so a product of one to sixteen activation rows wastes most of
each tile when the activations are the rows, as cuBLAS's kernels for x @ W^T do at batch 1. Here each program
computes out^T for BLOCK_N weight rows: tl.dot(W tile (BLOCK_N, BLOCK_K), x^T tile (BLOCK_K, 16)), so the weight
fills the tile and x (padded to 16 rows by masked loads) is the narrow side. The weight bytes are the e4m3 rows
torch._scaled_mm reads for longer products (no second layout); out = (x·W^T) · x_scale · w_scale in float32, then
out's dtype.

A weight of few row blocks (o and down: N / BLOCK_N programs against 132 multiprocessors) splits K over `split`
programs per block: each writes its float32 partial product to a workspace and counts itself in at the block's
counter; the last to arrive sums the partials, writes out and sets the counter back to zero, so one launch does it
all and the workspace needs no clearing between calls.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from . import tuning
from .launch import launch_args, shared_memory, wait_for_inputs
from .tuning import Fp8DecodeTile

MAX_ROWS = 16
MIN_BLOCK_K = 32       # the K of one FP8 MMA


@triton.jit
def _fp8_decode_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr, part_ptr, count_ptr, M, N,
                       K: tl.constexpr, ROW_SCALES: tl.constexpr, IMPRECISE: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """out (M ≤ 16, N) = (x @ w^T) · x_scale[m] · w_scale[n] (ROW_SCALES; else the one w_scale[0]); x (M, K) and w
    (N, K) e4m3, row-major; program (i, s) takes weight rows i·BLOCK_N.. over the s-th of SPLIT slices of K, each a
    multiple of BLOCK_K. Rows of x past M load as zeros. IMPRECISE: products the tensor cores sum at their reduced
    precision before adding into float32 (None: Triton's default, all of them). SPLIT > 1: partials (SPLIT, 16, N)
    float32 at part_ptr, one int32 counter a row block at count_ptr (zero between calls)."""
    ROWS: tl.constexpr = 16
    SLICE: tl.constexpr = K // SPLIT
    block = tl.program_id(0)
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, ROWS)
    k = tl.program_id(1) * SLICE + tl.arange(0, BLOCK_K)
    n_ok = n < N
    m_ok = m < M
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * K + k[None, :]
    x_ptrs = x_ptr + m[None, :] * K + k[:, None]
    wait_for_inputs(PDL)
    acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
    for _ in tl.range(0, SLICE, BLOCK_K, num_stages=STAGES):
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
    out_ptrs = out_ptr + m[None, :] * N + n[:, None]
    out_ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        slot = m[None, :] * N + n[:, None]
        tl.store(part_ptr + tl.program_id(1) * ROWS * N + slot, acc, mask=out_ok)
        tl.debug_barrier()                                 # every thread's partial written before the count
        arrived = tl.atomic_add(count_ptr + block, 1, sem="acq_rel")
        if arrived == SPLIT - 1:                           # the last of the block's programs sums them
            total = tl.zeros((BLOCK_N, ROWS), tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(part_ptr + s * ROWS * N + slot, mask=out_ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(count_ptr + block, 0)


def config(n: int, k: int) -> Fp8DecodeTile | None:
    """The tile of an (N, K) weight: tuning.FP8_DECODE_CONFIGS', else tuning.FP8_DECODE_CONFIG with BLOCK_K halved
    until its split slices of K divide into it; None where not even 32 does (the product stays on cuBLAS)."""
    if (n, k) in tuning.FP8_DECODE_CONFIGS:
        return tuning.FP8_DECODE_CONFIGS[n, k]
    tile = tuning.FP8_DECODE_CONFIG
    block_k = tile.block_k
    while k % (block_k * tile.split):
        block_k //= 2
    return replace(tile, block_k=block_k) if block_k >= MIN_BLOCK_K else None


def fitted(tile: Fp8DecodeTile, device: torch.device) -> Fp8DecodeTile:
    """The tile with no more operand stages (weight and x tiles, one byte a value) than `device`'s shared memory holds
    beside 4 KB for the rest: the tuned 6 stages of 64 × 256 take 120 KB, which Hopper has and GeForce cards (~100
    KB) do not."""
    stage = (tile.block_n + MAX_ROWS) * tile.block_k
    stages = max(1, min(tile.num_stages, (shared_memory(device) - (4 << 10)) // stage))
    return replace(tile, num_stages=stages)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether fp8_decode_matmul computes this product: at most tuning.FP8_DECODE_ROWS rows, a row-major weight and a
    K it steps evenly."""
    return (x.shape[0] <= min(MAX_ROWS, tuning.FP8_DECODE_ROWS) and weight.is_contiguous()
            and config(weight.shape[0], weight.shape[1]) is not None)


_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, parts: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's float32 partials (at least `parts`) and zeroed int32 counters (at least `blocks`), grown as
    needed. Products on one device run one after another on its stream, so one workspace serves them all."""
    held = _workspaces.get(device)
    if held is None or held[0].numel() < parts or held[1].numel() < blocks:
        parts = max(parts, held[0].numel() if held else 0)
        blocks = max(blocks, held[1].numel() if held else 0)
        held = _workspaces[device] = (torch.empty(parts, dtype=torch.float32, device=device),
                                      torch.zeros(blocks, dtype=torch.int32, device=device))
    return held


def fp8_decode_matmul(qx: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      out_dtype: torch.dtype, fast_accumulation: bool = True, tile: Fp8DecodeTile | None = None,
                      launch: dict | None = None) -> torch.Tensor:
    """(qx @ weight^T) · x_scale · weight_scale as out_dtype: qx (M ≤ 16, K) e4m3 with one float32 scale per row
    (M or (M, 1)), weight (N, K) e4m3 with one scale per row (N) or one for all. fast_accumulation as
    torch._scaled_mm's use_fast_accum (off: sums promoted to float32 every 32 products). tile: config's by
    default."""
    m, k = qx.shape
    n = weight.shape[0]
    tile = fitted(tile or config(n, k), qx.device)
    blocks = triton.cdiv(n, tile.block_n)
    out = torch.empty((m, n), dtype=out_dtype, device=qx.device)
    parts, counts = _workspace(qx.device, tile.split * MAX_ROWS * n, blocks) if tile.split > 1 else (out, out)
    _fp8_decode_kernel[(blocks, tile.split)](
        qx.contiguous(), x_scale.reshape(-1).contiguous(), weight, weight_scale.reshape(-1), out, parts, counts, m, n,
        k, ROW_SCALES=weight_scale.numel() > 1, IMPRECISE=None if fast_accumulation else 32, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, SPLIT=tile.split, STAGES=tile.num_stages, num_warps=tile.num_warps,
        **launch_args(launch))
    return out
