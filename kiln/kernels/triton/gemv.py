"""The weight-only decode GEMV on CUDA cores (≤ 4 rows of x: decode steps), for int8 and int4 layers in the
interleaved layout made at load, each weight byte read once.

The engine stores int4 weights as bytes (low nibble = even column) and int8 weights row-major (kernels/quant.py).
At load the GPU re-packs them (interleave_weight) so that each 16-byte block of a row is four int32 words whose
j-th values are four consecutive columns: word i, value j holds column 4j + i of the block (a block spans 32
columns of int4, 16 of int8). The GEMV then multiplies value j of four adjacent words by one contiguous slice of x,
with 16-byte weight loads and no gathers. On a gate/up projection whose rows alternate gate, up (pair_gate_up_rows)
it writes SiLU(gate)·up itself.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .launch import launch_args, wait_for_inputs
from .norms import silu_mul
from .weight_only import has_half_scales, load_scale_zero

MAX_ROWS = 4


def block_columns(bits: int) -> int:
    """Columns of one 16-byte block of the interleaved layout: 32 of int4, 16 of int8."""
    return 4 * 32 // bits


def interleave_weight(weight: torch.Tensor, bits: int, inverse: bool = False) -> torch.Tensor:
    """Engine layout → interleaved layout of an int4 (uint8 (N, K/2)) or int8 ((N, K)) matrix; `inverse` undoes it.
    K must be a multiple of the block (32 int4 / 16 int8 columns)."""
    from ..quant import pack_int4, unpack_int4

    values = unpack_int4(weight) if bits == 4 else weight
    n, k = values.shape
    per_word = 32 // bits
    shape = (n, k // block_columns(bits), 4, per_word) if inverse else (n, k // block_columns(bits), per_word, 4)
    values = values.reshape(shape).transpose(2, 3).reshape(n, k)
    return pack_int4(values) if bits == 4 else values.contiguous()


def pair_gate_up_rows(t: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rows [gate 0..I-1 | up 0..I-1] → gate i at row 2i, up i at 2i + 1 (any trailing shape); `inverse` undoes it."""
    halves = t.reshape(t.shape[0] // 2, 2, *t.shape[1:]) if inverse else t.reshape(2, t.shape[0] // 2, *t.shape[1:])
    return halves.transpose(0, 1).reshape(t.shape).contiguous()


@triton.jit
def _unpack(words, j: tl.constexpr, BITS: tl.constexpr):
    """Value j of every word, unsigned (int8 words arrive with each byte's sign flipped: q + 128), as the float
    v·2^(POS-149): its bits masked in place at bit POS form a subnormal float, which the FMA multiplies exactly
    and at full rate, unlike an int→float conversion (an eighth of the rate). Values that sit too high are first
    shifted down, one shift for the three (int4) or two (int8) top values. Also returns 2^(149-POS-64), the factor
    for x's column: every product comes out as v·x·2^-64. (This needs subnormals kept: Triton emits float32 FMAs
    without .ftz; the GEMV tests would fail if they were flushed.)"""
    if BITS == 4:
        if j < 5:
            SH: tl.constexpr = 0
        else:
            SH: tl.constexpr = 12
        POS: tl.constexpr = 4 * j - SH
    else:
        if j < 2:
            SH: tl.constexpr = 0
        else:
            SH: tl.constexpr = 16
        POS: tl.constexpr = 8 * j - SH
    if SH > 0:
        words = words >> SH
    f = (words & (((1 << BITS) - 1) << POS)).to(tl.float32, bitcast=True)
    return f, 2.0 ** (85 - POS)


@triton.jit
def _row_products(f, x_factor, x_ptr, cols, ok, p, x_sum):
    """One value of every word times x's matching columns into p (Σ v·x·2^-64); x summed for the zero point.
    cols is (1, W) like a row of the words, so that x arrives in their register layout, loaded once for all rows."""
    x = tl.load(x_ptr + cols, mask=ok, other=None if ok is None else 0.0).to(tl.float32)
    return p + f * (x * x_factor), x_sum + x


@triton.jit
def _add_blocks(acc, p, x_sum, scale, zero, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr):
    """Per 16-byte block (four words, one thread's): Σ (v - zero)·x·scale = scale·2^64·(Σp - zero·2^-64·Σx);
    `scale` and `zero` (per row and block) come multiplied and divided by 2^64."""
    p_block = tl.sum(tl.reshape(p, [BLOCK_N, BLOCKS, 4]), axis=2)
    x_block = tl.sum(tl.reshape(x_sum, [1, BLOCKS, 4]), axis=2)
    return acc + scale * (p_block - zero * x_block)


@triton.jit
def _next_words(w_rows, start, kw0, n_ok, ROW_WORDS, W: tl.constexpr, EVEN: tl.constexpr):
    """The words of the blocks after those at `start`. EVEN: unmasked (no mask to compute: 832 → 814 instructions
    per loop iteration of the int4 BLOCK_N 8 program in sm_90 SASS); past the last block it re-reads the last one,
    which the loop never uses."""
    if EVEN:
        return tl.load(w_rows + (tl.minimum(start + W, ROW_WORDS - W) + kw0)[None, :])
    return _load_words(w_rows, start + W + kw0, n_ok, ROW_WORDS, False)


@triton.jit
def _load_words(w_rows, kw, n_ok, ROW_WORDS, EVEN: tl.constexpr):
    """(BLOCK_N, W) words kw of the rows (none past a row's end)."""
    if EVEN:
        return tl.load(w_rows + kw[None, :])
    return tl.load(w_rows + kw[None, :], mask=n_ok[:, None] & (kw < ROW_WORDS)[None, :], other=0)


@triton.jit
def _store_row(out_ptr, acc, row, n, n_ok, row_scale, N, BLOCK_N: tl.constexpr, SILU: tl.constexpr):
    """Row `row` of the products with the program's weight rows n, in out's dtype. SILU (the rows alternate gate,
    up): SiLU(gate)·up of each pair into out's N/2 columns, rounded as the GEMV's output and silu_and_mul are."""
    y = (tl.sum(acc, axis=1) * row_scale).to(out_ptr.dtype.element_ty)
    if SILU:
        gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        c = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + row * (N // 2) + c, silu_mul(gate, up), mask=c < N // 2)
    else:
        tl.store(out_ptr + row * N + n, y, mask=n_ok)


_UNIT = tl.constexpr(2.0 ** 64)     # _unpack's products are v·x·2^-64


@triton.jit
def _block_products(words, b0, n, n_ok, x_ptr, scale_ptr, zero_ptr, K, ROW_WORDS, GROUPS, num_blocks,
                    acc0, acc1, acc2, acc3,
                    BITS: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr, HALF_SCALES: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, EVEN: tl.constexpr):
    """The accumulators plus the products of the blocks b0 … b0 + BLOCKS - 1 (`words`) of rows n with every x row."""
    VALS: tl.constexpr = 32 // BITS
    COLS: tl.constexpr = 4 * VALS
    W: tl.constexpr = 4 * BLOCKS
    kw = 4 * b0 + tl.arange(0, W)
    cols = ((kw // 4) * COLS + kw % 4)[None, :]              # column of each word's value 0
    x_ok = None if EVEN else (kw < ROW_WORDS)[None, :]
    if BITS == 8:
        words = words ^ -0x7F7F7F80                         # 0x80808080: q + 128 in every byte
    p0 = tl.zeros([BLOCK_N, W], tl.float32)
    p1 = tl.zeros([BLOCK_N, W], tl.float32)
    p2 = tl.zeros([BLOCK_N, W], tl.float32)
    p3 = tl.zeros([BLOCK_N, W], tl.float32)
    x0 = tl.zeros([1, W], tl.float32)
    x1 = tl.zeros([1, W], tl.float32)
    x2 = tl.zeros([1, W], tl.float32)
    x3 = tl.zeros([1, W], tl.float32)
    for j in tl.static_range(VALS):
        f, x_factor = _unpack(words, j, BITS)
        at = cols + 4 * j
        p0, x0 = _row_products(f, x_factor, x_ptr, at, x_ok, p0, x0)
        if ROWS > 1:
            p1, x1 = _row_products(f, x_factor, x_ptr + K, at, x_ok, p1, x1)
        if ROWS > 2:
            p2, x2 = _row_products(f, x_factor, x_ptr + 2 * K, at, x_ok, p2, x2)
        if ROWS > 3:
            p3, x3 = _row_products(f, x_factor, x_ptr + 3 * K, at, x_ok, p3, x3)
    if BITS == 8:                                            # the row's scale comes at the end
        scale = 1.0
        zero = 128.0 / _UNIT
    else:
        blk = b0 + tl.arange(0, BLOCKS)
        if GROUP == 0:
            at = n[:, None] * GROUPS + 0 * blk[None, :]
        else:
            at = n[:, None] * GROUPS + ((COLS * blk) // GROUP)[None, :]
        ok = None if EVEN else n_ok[:, None] & (blk < num_blocks)[None, :]
        if HAS_ZERO:
            scale, zero = load_scale_zero(scale_ptr, zero_ptr, at, ok, HALF_SCALES)
            scale = _UNIT * scale
            zero = zero / _UNIT
        else:
            scale = _UNIT * tl.load(scale_ptr + at, mask=ok, other=None if EVEN else 0.0)
            zero = 8.0 / _UNIT
    acc0 = _add_blocks(acc0, p0, x0, scale, zero, BLOCK_N, BLOCKS)
    if ROWS > 1:
        acc1 = _add_blocks(acc1, p1, x1, scale, zero, BLOCK_N, BLOCKS)
    if ROWS > 2:
        acc2 = _add_blocks(acc2, p2, x2, scale, zero, BLOCK_N, BLOCKS)
    if ROWS > 3:
        acc3 = _add_blocks(acc3, p3, x3, scale, zero, BLOCK_N, BLOCKS)
    return acc0, acc1, acc2, acc3


@triton.jit
def _store_rows(out_ptr, scale_ptr, acc0, acc1, acc2, acc3, n, n_ok, N, BITS: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_N: tl.constexpr, SILU: tl.constexpr):
    """Every x row's products with the weight rows n (int8: times each row's scale)."""
    if BITS == 8:
        row_scale = _UNIT * tl.load(scale_ptr + n, mask=n_ok, other=0.0)
    else:
        row_scale = tl.full([BLOCK_N], 1.0, tl.float32)
    _store_row(out_ptr, acc0, 0, n, n_ok, row_scale, N, BLOCK_N, SILU)
    if ROWS > 1:
        _store_row(out_ptr, acc1, 1, n, n_ok, row_scale, N, BLOCK_N, SILU)
    if ROWS > 2:
        _store_row(out_ptr, acc2, 2, n, n_ok, row_scale, N, BLOCK_N, SILU)
    if ROWS > 3:
        _store_row(out_ptr, acc3, 3, n, n_ok, row_scale, N, BLOCK_N, SILU)


@triton.jit
def _weight_only_gemv_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, N, K, ROW_WORDS, GROUPS,
                             BITS: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr,
                             HALF_SCALES: tl.constexpr, ROWS: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, EVEN: tl.constexpr,
                             PREFETCH: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr):
    """out (ROWS ≤ 4, N) = x @ dequant(w)^T on interleaved words (w viewed as int32, ROW_WORDS per row). Each program
    streams BLOCK_N weight rows, BLOCKS 16-byte blocks of each at a time: with num_warps = BLOCKS / 32 every thread
    holds one block of all BLOCK_N rows, so x's columns arrive in the words' register layout and are loaded and
    converted once for all rows. Products are summed per block and scaled once per block. GROUP 0: one scale per
    row; HALF_SCALES: int4 scale and zero point as one fp16 pair per group (weight_only.load_scale_zero);
    EVEN: N and the blocks divide evenly (no masks); PREFETCH: load the next blocks before this one's math; SILU:
    the weight rows alternate gate, up and out (ROWS, N/2) gets SiLU(gate)·up."""
    COLS: tl.constexpr = 4 * (32 // BITS)
    W: tl.constexpr = 4 * BLOCKS
    num_blocks = K // COLS
    kw0 = tl.arange(0, W)
    acc0 = tl.zeros([BLOCK_N, BLOCKS], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCKS], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCKS], tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCKS], tl.float32)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = w_ptr + n[:, None].to(tl.int64) * ROW_WORDS
    words = _load_words(w_rows, kw0, n_ok, ROW_WORDS, EVEN)      # in flight while the kernel before finishes
    wait_for_inputs(PDL)
    for b0 in range(0, num_blocks, BLOCKS):
        if PREFETCH:                                             # the next blocks' loads fly during this math
            following = _next_words(w_rows, 4 * b0, kw0, n_ok, ROW_WORDS, W, EVEN)
        acc0, acc1, acc2, acc3 = _block_products(
            words, b0, n, n_ok, x_ptr, scale_ptr, zero_ptr, K, ROW_WORDS, GROUPS, num_blocks,
            acc0, acc1, acc2, acc3, BITS, HAS_ZERO, GROUP, HALF_SCALES, ROWS, BLOCK_N, BLOCKS, EVEN)
        if PREFETCH:
            words = following
        else:
            words = _next_words(w_rows, 4 * b0, kw0, n_ok, ROW_WORDS, W, EVEN)
    _store_rows(out_ptr, scale_ptr, acc0, acc1, acc2, acc3, n, n_ok, N, BITS, ROWS, BLOCK_N, SILU)


def gemv_config(n: int, k: int, rows: int, bits: int) -> tuple[int, int, bool]:
    """(BLOCK_N, BLOCKS, PREFETCH) of the decode GEMV (tuning.GEMV_CONFIGS for the measured shapes); it runs
    BLOCKS / 32 warps. More rows of x take more registers per weight row (two rows and BLOCK_N 8 spill), hence
    BLOCK_N 4."""
    blocks = 64 if k // block_columns(bits) >= 64 else 32
    if rows > 1:
        return 4, blocks, True
    return tuning.GEMV_CONFIGS.get((n, k, bits), (8 if n >= 6144 else 4, blocks, True))


def weight_only_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                     bits: int, config: tuple | None = None, silu: bool = False,
                     launch: dict | None = None) -> torch.Tensor:
    """x (at most MAX_ROWS rows: decoding) @ dequant(w)^T for interleaved weights (interleave_weight), reading each
    weight byte once; config: (BLOCK_N, BLOCKS, PREFETCH), gemv_config's by default. silu: the rows alternate gate,
    up (pair_gate_up_rows) and the result is SiLU(gate)·up, (rows, N/2)."""
    from ..quant import int4_group_size

    rows = x.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    scale2d = scale.reshape(n, -1)
    groups = scale2d.shape[1]
    block_n, blocks, prefetch = config or gemv_config(n, k, m, bits)
    even = n % block_n == 0 and (k // block_columns(bits)) % blocks == 0
    out = torch.empty((m, n // 2 if silu else n), dtype=rows.dtype, device=rows.device)
    half = has_half_scales(scale)
    _weight_only_gemv_kernel[(triton.cdiv(n, block_n),)](
        rows, weight.view(torch.int32), scale2d, scale2d if zero is None else zero, out, n, k, k * bits // 32, groups,
        BITS=bits, HAS_ZERO=zero is not None or half, GROUP=0 if groups == 1 else int4_group_size(k, groups),
        HALF_SCALES=half, ROWS=m, BLOCK_N=block_n, BLOCKS=blocks, EVEN=even, PREFETCH=prefetch, SILU=silu,
        num_warps=blocks // 32, **launch_args(launch))
    return out
