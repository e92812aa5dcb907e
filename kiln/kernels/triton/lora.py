"""Batched LoRA products on the GPU: many adapters in one step, each token under its own (reference: reference.lora).

A step's tokens are grouped by adapter slot (LoraBatch.rows: packed rows sorted by slot; LoraBatch.starts: where
each slot's run begins). Each slot's run is cut into row blocks of BLOCK_M rows; the row blocks of all slots, one
after another, are the first grid axis of both kernels, and each program finds its slot and block from `starts`
(a prefix sum over the slots), so the grid is the step's blocks (at most cdiv(T, BLOCK_M) + min(slots, T) - 1)
whatever the grouping, and both kernels are captured in CUDA graphs with the grouping read from device memory:
  shrink  (row block, K split) → partial[split, row] = x[row, K part]·A[slot]ᵀ          (float32, P·R columns)
  expand  (row block, column tile) → out[row, tile] += scale[slot, p]·(Σ partial[:, row, p·R:(p+1)·R])·B_pᵀ
where p is the projection (q, k, v, gate, up) the column tile belongs to. Splitting K keeps a decode step's few
tokens spread over the GPU; the partial sums are reduced by the expand, so nothing is zeroed first. Larger steps
are not split. The shrink needs only the layer's input: TritonOps runs it beside the base product (on a side
stream), the expand after it. The few variants compiled (decode-sized or not) do not depend on the token count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import launch_args, wait_for_inputs

MAX_SPLIT = 8       # K splits of a decode-sized step (the expand sums them per row block)
SPLIT_TOKENS = 64   # steps of more tokens are not split: their rows fill the GPU, and the expand reads a row
                    # block's partial sums once per column tile


@triton.jit
def _block_rows(rows_ptr, starts_ptr, pid, SLOTS: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(the packed rows of the step's pid-th row block, a mask for those past its slot's run, its slot): blocks are
    numbered slot after slot; a pid past the step's blocks gets slot SLOTS and no rows."""
    s = tl.arange(0, SLOTS_PAD)
    begin = tl.load(starts_ptr + s, mask=s < SLOTS, other=0)
    end = tl.load(starts_ptr + s + 1, mask=s < SLOTS, other=0)
    blocks = (end - begin + BLOCK_M - 1) // BLOCK_M
    through = tl.cumsum(blocks, 0)                               # blocks of slots 0..s
    slot = tl.sum((through <= pid).to(tl.int32), 0)
    mine = s == slot
    first = tl.sum(tl.where(mine, begin + (pid - through + blocks) * BLOCK_M, 0), 0)
    last = tl.sum(tl.where(mine, end, 0), 0)
    at = first + tl.arange(0, BLOCK_M)
    in_slot = at < last
    rows = tl.load(rows_ptr + at, mask=in_slot, other=0).to(tl.int64)
    return rows, in_slot, slot


@triton.jit(do_not_specialize=["T"])          # T varies step to step: no recompiles for it
def _lora_shrink_kernel(x_ptr, a_ptr, rows_ptr, starts_ptr, partial_ptr, T, K, stride_x, stride_a,
                        SLOTS: tl.constexpr, SLOTS_PAD: tl.constexpr, PR: tl.constexpr, PR_PAD: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                        PDL: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    wait_for_inputs(PDL)
    rows, in_slot, slot = _block_rows(rows_ptr, starts_ptr, pid_m, SLOTS, SLOTS_PAD, BLOCK_M)
    if slot < SLOTS:
        r = tl.arange(0, PR_PAD)
        kk = tl.arange(0, BLOCK_K)
        a_slot = a_ptr + slot.to(tl.int64) * stride_a
        acc = tl.zeros((BLOCK_M, PR_PAD), dtype=tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, SPLIT * BLOCK_K):
            k = k0 + kk
            x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=in_slot[:, None] & (k[None, :] < K),
                        other=0.0)
            a = tl.load(a_slot + r[None, :] * K + k[:, None], mask=(r[None, :] < PR) & (k[:, None] < K), other=0.0)
            acc = tl.dot(x, a, acc, input_precision=PRECISION)
        out = partial_ptr + (pid_k * T + rows[:, None]) * PR_PAD + r[None, :]
        tl.store(out, acc, mask=in_slot[:, None])


@triton.jit(do_not_specialize=["T"])
def _lora_expand_kernel(out_ptr, partial_ptr, b_ptr, scale_ptr, rows_ptr, starts_ptr, T, N, stride_out, stride_b,
                        stride_scale, BOUND1, BOUND2,
                        SLOTS: tl.constexpr, SLOTS_PAD: tl.constexpr, R: tl.constexpr, PR_PAD: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                        PDL: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    wait_for_inputs(PDL)
    rows, in_slot, slot = _block_rows(rows_ptr, starts_ptr, pid_m, SLOTS, SLOTS_PAD, BLOCK_M)
    first = pid_n * BLOCK_N
    part = (first >= BOUND1).to(tl.int32) + (first >= BOUND2).to(tl.int32)   # a tile lies in one projection
    scale = tl.load(scale_ptr + slot * stride_scale + part, mask=slot < SLOTS, other=0.0)
    if scale != 0.0:
        rr = tl.arange(0, R)
        shrunk = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for split in tl.static_range(SPLIT):                 # unrolled: the loads are issued together
            shrunk += tl.load(partial_ptr + (split * T + rows[:, None]) * PR_PAD + part * R + rr[None, :],
                              mask=in_slot[:, None], other=0.0)
        cols = first + tl.arange(0, BLOCK_N)
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_b + cols[None, :] * R + rr[:, None], mask=cols[None, :] < N,
                    other=0.0)                                                   # (R, BLOCK_N): B_pᵀ's tile
        delta = tl.dot(shrunk.to(b.dtype), b, input_precision=PRECISION) * scale
        at = out_ptr + rows[:, None] * stride_out + cols[None, :]
        keep = in_slot[:, None] & (cols[None, :] < N)
        before = tl.load(at, mask=keep, other=0.0)
        tl.store(at, (before.to(tl.float32) + delta).to(before.dtype), mask=keep)


def column_tile(bounds: tuple[int, ...]) -> int:
    """The expand's column tile for a layer whose projections start at `bounds`: a power of two dividing every
    projection's first row (so no tile straddles two), at most 128; 0 where that is under 16 (the products then
    run in torch)."""
    inner = math.gcd(*bounds[1:-1]) if len(bounds) > 2 else 0
    tile = 128 if inner == 0 else min(128, inner & -inner)
    return tile if tile >= 16 else 0


def takes(stack) -> bool:
    """Whether the kernels compute this layer's products (at most three projections, tiles that fit them)."""
    return stack.parts <= 3 and column_tile(stack.bounds) > 0


@dataclass
class Shrunk:
    """A layer's shrink of one step (the expand's input): float32 partial sums (split, T, P·R padded) and the row
    blocks both kernels share."""

    partial: torch.Tensor
    block_m: int
    row_blocks: int


def _grid_rows(tokens: int, slots: int, block_m: int) -> int:
    """Row blocks of a step of `tokens` grouped into at most `slots` runs: Σ cdiv(run, block_m) over the runs."""
    return triton.cdiv(tokens, block_m) + min(slots, tokens) - 1


def shrink(x: torch.Tensor, batch, stack, launch: dict | None = None) -> Shrunk:
    """x·A[slot]ᵀ of every token under an adapter (`batch`: the step's LoraBatch on the device), split along K."""
    launch = launch_args(launch)
    tokens, k = x.shape
    slots, pr = stack.a.shape[0], stack.a.shape[1]
    pr_pad = triton.next_power_of_2(pr)
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_m = 16 if tokens <= 64 or pr_pad > 128 else 64
    block_k = 128 if pr_pad <= 64 else 64
    row_blocks = _grid_rows(tokens, slots, block_m)
    split = min(MAX_SPLIT, triton.cdiv(k, block_k)) if tokens <= SPLIT_TOKENS else 1
    partial = torch.empty((split, tokens, pr_pad), dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(row_blocks, split)](
        x, stack.a, batch.rows, batch.starts, partial, tokens, k, x.stride(0), stack.a.stride(0), SLOTS=slots,
        SLOTS_PAD=triton.next_power_of_2(slots), PR=pr, PR_PAD=pr_pad, BLOCK_M=block_m, BLOCK_K=block_k, SPLIT=split,
        PRECISION=_precision(x.dtype), num_warps=4, **launch)
    return Shrunk(partial, block_m, row_blocks)


def expand(out: torch.Tensor, shrunk: Shrunk, batch, stack, launch: dict | None = None) -> torch.Tensor:
    """Add scale·shrunk·B[slot]ᵀ to the layer output `out` (T, N) in place, per projection."""
    launch = launch_args(launch)
    split, tokens, pr_pad = shrunk.partial.shape
    slots, n, tile = stack.a.shape[0], out.shape[1], column_tile(stack.bounds)
    inner = list(stack.bounds[1:-1]) + [n] * (3 - len(stack.bounds[1:-1]))
    _lora_expand_kernel[(shrunk.row_blocks, triton.cdiv(n, tile))](
        out, shrunk.partial, stack.b, stack.scale, batch.rows, batch.starts, tokens, n, out.stride(0),
        stack.b.stride(0), stack.scale.stride(0), inner[0], inner[1], SLOTS=slots,
        SLOTS_PAD=triton.next_power_of_2(slots), R=stack.rank, PR_PAD=pr_pad, BLOCK_M=shrunk.block_m, BLOCK_N=tile,
        SPLIT=split, PRECISION=_precision(out.dtype), num_warps=4, **launch)
    return out


def lora(out: torch.Tensor, x: torch.Tensor, batch, stack, launch: dict | None = None) -> torch.Tensor:
    """Add the step's LoRA products to the layer output `out` (T, N), in place (reference.lora's result); `stack`
    is the layer's LoraStack (kiln/kernels/lora.py), `batch` the step's LoraBatch with its rows and starts on the
    device."""
    return expand(out, shrink(x, batch, stack, launch), batch, stack, launch)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"
