"""int4 weights in the tensor cores' fragment layout, made at load (never stored): packing of the levels and, in
fragment order, of the scales and zero points; the dequantize kernel for products of more rows than int4_mma.gemv
takes.

A row block of 16 rows × a chunk of 128 columns is 256 words; lane l = 4g + t holds words 8l … 8l + 7 (planes
p = 0..7: 32 contiguous bytes, two 16-byte loads). As mma.sync.m16n8k16's A fragment, plane p of lane (g, t) holds
rows g and g + 8 at fragment columns 2t, 2t + 1, 2t + 8, 2t + 9: nibble h + 2·kh + 4·ki is row g + 8h, fragment
column c = 8kh + 2t + ki. Fragment columns are not the chunk's columns in order: a product is the same for any
order of its reduction as long as A and B agree, and the kernel's is column 32t + 4p + 2kh + ki of the chunk, so
that lane t's B fragments for all eight planes are x's 32 contiguous columns 32t … 32t + 31 (64 bytes, four 16-byte
loads; words 2p, 2p + 1 are plane p's). Chunks of 128 columns hold one group: g128 or one group per row. Each
chunk's scales and zero points come in one 16-byte load per lane (pack_grid; as separate (N, G) float32 rows they
cost the 8B gate_up 30.0 -> 22.9 µs).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                               # a CPU-only install: packing only
    triton = tl = None

ROW_BLOCK, CHUNK = 16, 128


def takes(shape: tuple[int, int], groups: int) -> bool:
    """Whether a (N, K) int4 layer with `groups` groups per row fits the layout: whole row blocks and chunks, and
    one group per chunk (g128) or per row."""
    n, k = shape
    return n % ROW_BLOCK == 0 and k % CHUNK == 0 and (groups == 1 or groups * CHUNK == k)


def _fragment_view(levels: torch.Tensor) -> torch.Tensor:
    """(N, K) levels → (row blocks, chunks, lanes g, t, planes p, nibbles ki, kh, h) by their place in a word; the
    chunk's column of (t, p, kh, ki) is 32t + 4p + 2kh + ki."""
    n, k = levels.shape
    v = levels.reshape(n // 16, 2, 8, k // CHUNK, 4, 8, 2, 2)       # rb, h, g, kc, t, p, kh, ki
    return v.permute(0, 3, 2, 4, 5, 7, 6, 1)                          # rb, kc, g, t, p, ki, kh, h


def pack(weight: torch.Tensor) -> torch.Tensor:
    """Engine int4 (uint8 (N, K/2), low nibble = even column) → fragment-layout words, int32 (N, K/8)."""
    from ..quant import unpack_int4

    levels = unpack_int4(weight).to(torch.int32)
    n, k = levels.shape
    nibbles = _fragment_view(levels).reshape(-1, 8)
    shifts = torch.arange(0, 32, 4, device=weight.device, dtype=torch.int32)
    # disjoint bit fields: their int32 sum (wrapping at the top nibble) is their bitwise OR
    return (nibbles << shifts).sum(dim=1, dtype=torch.int32).reshape(n, k // 8)


def unpack(words: torch.Tensor) -> torch.Tensor:
    """pack's inverse: int32 (N, K/8) → engine int4 uint8 (N, K/2)."""
    from ..quant import pack_int4

    n, k = words.shape[0], words.shape[1] * 8
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int64)
    nibbles = (words.reshape(-1, 1).to(torch.int64) >> shifts) & 0xF       # (words, 8): rb, kc, g, t, p | ki, kh, h
    levels = nibbles.reshape(n // 16, k // CHUNK, 8, 4, 8, 2, 2, 2).permute(0, 7, 2, 1, 3, 4, 6, 5)
    return pack_int4(levels.reshape(n, k).to(torch.uint8))


def pack_grid(scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """Scales and zero points (N, G) (zero None: 8, symmetric) → float32 (N/16, G, 8, 4) with (s_g, s_g+8, z_g,
    z_g+8) for row block, group and g: lane (g, t)'s four values for a chunk in one 16-byte load, the 8 lanes of a
    t 128 contiguous bytes."""
    n = scale.shape[0]
    scale = scale.reshape(n, -1).float()
    zero = torch.full_like(scale, 8.0) if zero is None else zero.reshape(n, -1).float()
    blocks = lambda t: t.reshape(n // 16, 2, 8, t.shape[1]).permute(0, 3, 2, 1)    # rb, group, g, h  # noqa: E731
    return torch.cat([blocks(scale), blocks(zero)], dim=-1).contiguous()


def pair_blocks(t: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """A gate/up projection's rows [gate | up] (any trailing shape) → their 16-row blocks alternating gate block i,
    up block i, which gemv(silu=True) reads in pairs; `inverse` undoes it."""
    n = t.shape[0]
    blocks = (n // (2 * ROW_BLOCK), 2) if inverse else (2, n // (2 * ROW_BLOCK))
    return t.reshape(*blocks, ROW_BLOCK, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


if triton is not None:
    @triton.jit
    def _dequantize_kernel(w_ptr, grid_ptr, out_ptr, K, GROUPS, GROUPED: tl.constexpr, BLOCK: tl.constexpr):
        """BLOCK fragment-layout words → their 8 values each, (q - z)·s in out's dtype, at their (row, column); the
        two values of a column pair (ki = 0, 1) are stored together."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        word = tl.load(w_ptr + i)
        nchunk = K // 128
        lane = (i // 8) % 32
        p = i % 8
        kc = (i // 256) % nchunk
        rb = i // (256 * nchunk)
        g = lane // 4
        t = lane % 4
        for pair in tl.static_range(4):                       # pair = h + 2·kh; nibbles pair and pair + 4 (ki = 0, 1)
            row = rb * 16 + g + 8 * (pair % 2)
            col = kc * 128 + 32 * t + 4 * p + 2 * (pair // 2)
            entry = ((rb * GROUPS + (kc if GROUPED else 0)) * 8 + g) * 4 + pair % 2      # pack_grid's (s, ·, z, ·)
            s = tl.load(grid_ptr + entry)
            z = tl.load(grid_ptr + entry + 2)
            lo = ((word >> (4 * pair)) & 0xF).to(tl.float32)
            hi = ((word >> (4 * pair + 16)) & 0xF).to(tl.float32)
            both = tl.join((lo - z) * s, (hi - z) * s).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + (row * K + col)[:, None] + tl.arange(0, 2)[None, :], both)


def dequantize(words: torch.Tensor, grid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (N, K) float matrix of fragment-layout words and their pack_grid, in `dtype` (products of more rows than
    int4_mma.gemv takes)."""
    n, k = words.shape[0], words.shape[1] * 8
    out = torch.empty((n, k), dtype=dtype, device=words.device)
    block = 256                                           # one row block × chunk: always whole
    _dequantize_kernel[(words.numel() // block,)](words, grid, out, k, grid.shape[1], GROUPED=grid.shape[1] > 1,
                                                  BLOCK=block, num_warps=4)
    return out
