"""Greedy sampling's argmax over the vocabulary on the GPU (reference: reference.argmax_rows)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch_args, wait_for_inputs

CHUNK = 4096       # columns a program of the first kernel reduces


@triton.jit
def _argmax_chunks_kernel(x_ptr, value_ptr, index_ptr, V, stride, CHUNKS, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """The largest value of one chunk of one row and its first column."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)                       # NaN wins, as in torch.argmax
    best = tl.max(x, axis=0)
    tl.store(value_ptr + row * CHUNKS + tl.program_id(1), best)
    tl.store(index_ptr + row * CHUNKS + tl.program_id(1), tl.min(tl.where(x == best, cols, V), axis=0))


@triton.jit
def _argmax_rows_kernel(value_ptr, index_ptr, out_ptr, CHUNKS, CHUNKS_PAD: tl.constexpr, PDL: tl.constexpr):
    """One row: the first chunk holding the row's largest value gives its first column."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    at = tl.arange(0, CHUNKS_PAD)
    values = tl.load(value_ptr + row * CHUNKS + at, mask=at < CHUNKS, other=float("-inf"))
    chunk = tl.min(tl.where(values == tl.max(values, axis=0), at, CHUNKS_PAD), axis=0)
    tl.store(out_ptr + row, tl.load(index_ptr + row * CHUNKS + chunk).to(tl.int64))


def argmax_rows(x: torch.Tensor, launch: dict | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """x.argmax(dim=-1) of rows over a vocabulary (greedy decoding) in two small kernels, `chunk` columns a program
    of the first: torch's reduction gives one row to one block (~36 µs for 128k logits on an H200). Ties go to the
    first column and a NaN beats every number, as in torch's."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    launch = launch_args(launch)
    rows, vocab = x.shape
    chunks = triton.cdiv(vocab, chunk)
    values = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    indices = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    out = torch.empty((rows,), dtype=torch.int64, device=x.device)
    _argmax_chunks_kernel[(rows, chunks)](x, values, indices, vocab, x.stride(0), chunks, CHUNK=chunk, num_warps=4,
                                          **launch)
    _argmax_rows_kernel[(rows,)](values, indices, out, chunks, CHUNKS_PAD=max(2, triton.next_power_of_2(chunks)),
                                 num_warps=1, **launch)
    return out
