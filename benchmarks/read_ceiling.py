"""How fast the int4 decode GEMVs' weight bytes can be read at all (H200): kernels that only load the words of the
8B shapes' int4 matrices and fold them with XOR, one launch per weight copy in a CUDA graph (as gpu_suite times the
GEMVs), so that the GEMVs' 2–3 TB/s can be set beside what their access pattern and a plain stream reach.

    python3 benchmarks/read_ceiling.py            # one line per shape and variant: µs and TB/s

rows BNxW: the decode GEMV's pattern (BLOCK_N rows per program, each thread 16 bytes of every row per step, the
next step's loads issued before the current one is used, W/32 warps for W 16-byte blocks); flat CxU/wN: each
program streams one contiguous chunk of C KB, U loads in flight per thread, N warps; torch: `Tensor.sum`.
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kiln import benchmark as bench  # noqa: E402

SHAPES = {"qkv": (6144, 512), "o": (4096, 512), "gate_up": (28672, 512), "down": (4096, 1792),
          "lm_head": (128256, 512)}                   # int32 words of int4 rows (K/8 words)


@triton.jit
def _rows_read(w_ptr, out_ptr, ROW_WORDS, BLOCK_N: tl.constexpr, W: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + n[:, None].to(tl.int64) * ROW_WORDS
    kw = tl.arange(0, W)
    acc = tl.zeros([BLOCK_N, W], tl.int32)
    words = tl.load(rows + kw[None, :])
    for start in range(W, ROW_WORDS + W, W):
        following = tl.load(rows + (tl.minimum(start, ROW_WORDS - W) + kw)[None, :])
        acc ^= words
        words = following
    tl.store(out_ptr + n, tl.xor_sum(acc, axis=1))


@triton.jit
def _flat_read(w_ptr, out_ptr, CHUNK_WORDS, TILE: tl.constexpr, UNROLL: tl.constexpr):
    base = w_ptr + tl.program_id(0).to(tl.int64) * CHUNK_WORDS
    offs = tl.arange(0, TILE)
    acc = tl.zeros([TILE], tl.int32)
    for start in range(0, CHUNK_WORDS, TILE * UNROLL):
        for u in tl.static_range(UNROLL):
            acc ^= tl.load(base + start + u * TILE + offs)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, axis=0))


def _rows(w, out, block_n, blocks):
    _rows_read[(w.shape[0] // block_n,)](w, out, w.shape[1], BLOCK_N=block_n, W=4 * blocks, num_warps=blocks // 32)


def _flat(w, out, chunk_kb, unroll, warps):
    chunk = chunk_kb * 256                             # words
    _flat_read[(w.numel() // chunk,)](w, out, chunk, TILE=warps * 128, UNROLL=unroll, num_warps=warps)


def main():
    for name, (n, words) in SHAPES.items():
        nbytes = n * words * 4
        copies = max(2, -(-(512 << 20) // nbytes))
        weights = [torch.randint(-2**31, 2**31 - 1, (n, words), device="cuda", dtype=torch.int32)
                   for _ in range(copies)]
        out = torch.empty(n, dtype=torch.int32, device="cuda")
        variants = {f"rows {bn}x{b}": (lambda w, bn=bn, b=b: _rows(w, out, bn, b))
                    for bn in (4, 8, 16) for b in (64, 128)}
        variants.update({f"flat {c}x{u}/w{wp}": (lambda w, c=c, u=u, wp=wp: _flat(w, out, c, u, wp))
                         for c in (16, 64) for u in (1, 4) for wp in (4, 8)
                         if (n * words) % (c * 256) == 0})
        variants["torch"] = lambda w: w.sum()
        results = []
        for label, launch in variants.items():
            sec = bench.graph_seconds([lambda w=w, launch=launch: launch(w) for w in weights], repeats=5)
            results.append(f"{label}: {sec * 1e6:.1f}us {nbytes / sec / 1e12:.2f}TB/s")
        print(f"{name} ({nbytes / 1e6:.1f} MB): " + " | ".join(results), flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
