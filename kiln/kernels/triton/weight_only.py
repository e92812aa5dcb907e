"""Weight-only (W4A16 / W8A16) matrix products for more rows than the decode GEMV takes (prompts, large decode
batches): a tensor-core kernel that unpacks the weight in registers, and for long prompts a dequantize-to-float
kernel followed by cuBLAS.

Both read the engine layout (kernels/quant.py) or the interleaved one (gemv.interleave_weight). A weight
row is read in units: int32 words (interleaved, or the engine layout when a row is a whole number of words) or
bytes. Value j of unit u stands for column VALS·u + j (engine layout; VALS values per unit) or, interleaved, for
column 4j + u % 4 of the unit's 16-byte block. The tensor-core kernel never restores the column order: a product
summed over K does not care about it, so it reads x's columns in the weight's order instead (every value j of a
tile's units, then j + 1, ...).

Levels become floats without an int→float conversion: OR-ed into the mantissa of a power of two (fp16 1024,
float32 2^23) they form that power plus the level, and one subtraction leaves the level, exactly. The
kernel multiplies integer levels (exact in bf16/fp16) by x and applies each group's scale and zero point to the
float32 sums: Σ x·(q - z)·s = s·(Σ x·q - z·Σ x).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import DEQUANTIZE_MIN_ROWS, MMA_CONFIGS, PLANES, RESHAPE, MmaConfig


@triton.jit
def _tile_columns(u, j, VALS: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Column, from the tile's first, of value j of unit u."""
    if INTERLEAVED:
        return (u // 4) * (4 * VALS) + 4 * j + u % 4
    return u * VALS + j


@triton.jit
def _levels(units, j, BITS: tl.constexpr):
    """Value j of every unit as an unsigned int32 level (int8: q + 128)."""
    v = (units.to(tl.int32) >> (BITS * j)) & ((1 << BITS) - 1)
    if BITS == 8:
        v = v ^ 0x80
    return v


@triton.jit
def _as_float(v, OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    """Levels v (0 ≤ v < 2^BITS) minus OFFSET, exactly, in DTYPE: v OR-ed into a power of two's mantissa."""
    if DTYPE == tl.float16:
        return (v | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 + OFFSET)
    # bf16 goes through float32 (its 7 mantissa bits cannot hold int8 levels, and Triton's interpreter gets bf16
    # arithmetic on bitcast values wrong); the cast rounds nothing and packs two values an instruction
    f = (v | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)
    return f.to(DTYPE)


@triton.jit
def _fp16_half(pairs, SHIFT: tl.constexpr):
    """The fp16 value in bits SHIFT..SHIFT+15 of int32 words, as float32."""
    return ((pairs >> SHIFT) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_scale_zero(scale_ptr, zero_ptr, at, mask, HALF_SCALES: tl.constexpr):
    """Scales and zero points `at` (per row and group) as float32: from their own float32 tensors, or (HALF_SCALES)
    from one int32 per group holding both as fp16, the scale in the low half (half_scale_pairs)."""
    if HALF_SCALES:
        pairs = tl.load(scale_ptr + at, mask=mask, other=None if mask is None else 0)
        scale = _fp16_half(pairs, 0)
        zero = _fp16_half(pairs, 16)
    else:
        scale = tl.load(scale_ptr + at, mask=mask, other=None if mask is None else 0.0)
        zero = tl.load(zero_ptr + at, mask=mask, other=None if mask is None else 0.0)
    return scale, zero


def half_scale_pairs(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """float32 scales and zero points (N, G) → one int32 per group: fp16 scale in the low half, fp16 zero above."""
    return torch.stack([scale.half(), zero.half()], dim=-1).view(torch.int32).squeeze(-1)


def has_half_scales(scale: torch.Tensor) -> bool:
    return scale.dtype == torch.int32


@triton.jit
def _load_x(x_ptr, rm, cols, K, EVEN_K: tl.constexpr):
    """x's columns `cols` (BLOCK_K,) of rows rm, transposed: (BLOCK_K, BLOCK_M)."""
    ptrs = x_ptr + rm[None, :].to(tl.int64) * K + cols[:, None]
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(cols < K)[:, None], other=0.0)


@triton.jit
def _load_units(w_rows, u, ROW_UNITS, EVEN_K: tl.constexpr):
    """Units u (any shape broadcasting against w_rows (BLOCK_N, 1)) of the rows; none past a row's end."""
    if EVEN_K:
        return tl.load(w_rows + u)
    return tl.load(w_rows + u, mask=u < ROW_UNITS, other=0)


@triton.jit
def _tile_product(x_ptr, w_rows, rm, k0, K, ROW_UNITS, BITS: tl.constexpr, VALS: tl.constexpr,
                  INTERLEAVED: tl.constexpr, OFFSET: tl.constexpr, UNPACK: tl.constexpr, EVEN_K: tl.constexpr,
                  PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Σ over the tile's BLOCK_K columns of (level - OFFSET)·x: (BLOCK_N, BLOCK_M) float32, and x summed over the
    columns (BLOCK_M,) for zero points."""
    KU: tl.constexpr = BLOCK_K // VALS
    unit0 = k0 // VALS
    dtype = x_ptr.dtype.element_ty
    if UNPACK == 1:                                       # PLANES: one dot per value plane
        u = tl.arange(0, KU)
        units = _load_units(w_rows, unit0 + u[None, :], ROW_UNITS, EVEN_K)
        part = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        x_sum = tl.zeros([BLOCK_M], tl.float32)
        for j in tl.static_range(VALS):
            x = _load_x(x_ptr, rm, k0 + _tile_columns(u, j, VALS, INTERLEAVED), K, EVEN_K)
            w = _as_float(_levels(units, j, BITS), OFFSET, dtype)
            part = tl.dot(w, x, part, input_precision=PRECISION)
            x_sum += tl.sum(x.to(tl.float32), axis=0)
        return part, x_sum
    t = tl.arange(0, BLOCK_K)
    if UNPACK == 3:                                       # tile position t holds value t % VALS of unit t // VALS
        x = _load_x(x_ptr, rm, k0 + _tile_columns(t // VALS, t % VALS, VALS, INTERLEAVED), K, EVEN_K)
    else:                                                 # value t // KU of unit t % KU
        x = _load_x(x_ptr, rm, k0 + _tile_columns(t % KU, t // KU, VALS, INTERLEAVED), K, EVEN_K)
    if UNPACK == 0:                                       # GATHER
        units = _load_units(w_rows, unit0 + (t % KU)[None, :], ROW_UNITS, EVEN_K)
        w = _as_float(_levels(units, (t // KU)[None, :], BITS), OFFSET, dtype)
    else:                                                 # converted before the reshape: half the bytes to move
        u = tl.arange(0, KU)
        j = tl.arange(0, VALS)
        units = _load_units(w_rows, unit0 + u[None, :], ROW_UNITS, EVEN_K)
        if UNPACK == 2:
            w = _as_float(_levels(units[:, None, :], j[None, :, None], BITS), OFFSET, dtype)
        else:
            w = _as_float(_levels(units[:, :, None], j[None, None, :], BITS), OFFSET, dtype)
        w = tl.reshape(w, [BLOCK_N, BLOCK_K])
    return tl.dot(w, x, input_precision=PRECISION), tl.sum(x.to(tl.float32), axis=0)


@triton.jit(do_not_specialize=["M", "TILES_PER_SPLIT"])
def _weight_only_mma_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, ROW_UNITS, GROUPS, TILES_PER_SPLIT,
                            BITS: tl.constexpr, UNIT_BITS: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr,
                            HALF_SCALES: tl.constexpr, INTERLEAVED: tl.constexpr, UNPACK: tl.constexpr,
                            EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """out (M, N) = x (M, K) @ dequant(w)^T on tensor cores, computed transposed: the weight tile (BLOCK_N rows) is
    the dot's left operand, so that few rows of x need only a narrow right one. GROUP 0: one scale (and zero) per
    row, applied once at the end; otherwise BLOCK_K divides GROUP and each step applies its group's. With a third
    grid dimension (split K) program (n, m, s) sums its share of K's steps into out[s], a float32 (splits, M, N)
    buffer. HALF_SCALES: scale and zero point come as fp16 pairs (load_scale_zero)."""
    VALS: tl.constexpr = UNIT_BITS // BITS
    if BITS == 8:
        OFFSET: tl.constexpr = 128.0
    elif HAS_ZERO:
        OFFSET: tl.constexpr = 0.0
    else:
        OFFSET: tl.constexpr = 8.0
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = rn < N, rm < M
    rn_safe, rm_safe = tl.where(n_ok, rn, 0), tl.where(m_ok, rm, 0)   # rows past the end read row 0, stored nowhere
    w_rows = w_ptr + rn_safe[:, None].to(tl.int64) * ROW_UNITS
    first = tl.program_id(2) * TILES_PER_SPLIT
    last = tl.minimum(first + TILES_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    x_total = tl.zeros([BLOCK_M], tl.float32)
    for tile in range(first, last):
        k0 = tile * BLOCK_K
        part, x_sum = _tile_product(x_ptr, w_rows, rm_safe, k0, K, ROW_UNITS, BITS, VALS, INTERLEAVED, OFFSET,
                                    UNPACK, EVEN_K, PRECISION, BLOCK_N, BLOCK_M, BLOCK_K)
        if GROUP == 0:
            acc += part
            if HAS_ZERO:                                    # (a loop-carried sum would stay even if unused)
                x_total += x_sum
        else:
            at = rn_safe * GROUPS + k0 // GROUP
            if HAS_ZERO:
                scale, zero = load_scale_zero(scale_ptr, zero_ptr, at, None, HALF_SCALES)
                part -= zero[:, None] * x_sum[None, :]
            else:
                scale = tl.load(scale_ptr + at)
            acc += scale[:, None] * part
    if GROUP == 0:
        if HAS_ZERO:
            scale, zero = load_scale_zero(scale_ptr, zero_ptr, rn_safe, None, HALF_SCALES)
            acc -= zero[:, None] * x_total[None, :]
        else:
            scale = tl.load(scale_ptr + rn_safe)
        acc *= scale[:, None]
    out = out_ptr + tl.program_id(2).to(tl.int64) * M * N + rm[None, :].to(tl.int64) * N + rn[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, SIZE, SPLIT, BLOCK: tl.constexpr):
    """out = Σ over SPLIT of the float32 (SPLIT, SIZE) partial products, in out's dtype."""
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = at < SIZE
    total = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLIT):
        total += tl.load(part_ptr + s * SIZE + at, mask=ok, other=0.0)
    tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequantize_kernel(w_ptr, scale_ptr, zero_ptr, out_ptr, N, K, ROW_UNITS, GROUPS,
                       BITS: tl.constexpr, UNIT_BITS: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr,
                       HALF_SCALES: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """out (N, K) in out's dtype = (level - zero)·scale, rounded once from float32 like quant.dequantize_weight's
    matrix cast to x's dtype. Each column reads the unit that holds it (a unit's other columns hit the cache)."""
    VALS: tl.constexpr = UNIT_BITS // BITS
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rn < N)[:, None] & (rk < K)[None, :]
    if INTERLEAVED:                                   # column 4j + i of a block is value j of the block's word i
        unit = (rk // (4 * VALS)) * 4 + rk % 4
        j = (rk % (4 * VALS)) // 4
    else:
        unit = rk // VALS
        j = rk % VALS
    rows = rn[:, None].to(tl.int64)
    levels = _levels(tl.load(w_ptr + rows * ROW_UNITS + unit[None, :], mask=ok, other=0), j[None, :], BITS)
    if BITS == 8:
        q = levels.to(tl.float32) - 128.0
    elif HAS_ZERO:
        q = levels.to(tl.float32)
    else:
        q = levels.to(tl.float32) - 8.0
    if GROUP == 0:
        at = rows * GROUPS + 0 * rk[None, :]
    else:
        at = rows * GROUPS + (rk // GROUP)[None, :]
    if HAS_ZERO:
        scale, zero = load_scale_zero(scale_ptr, zero_ptr, at, ok, HALF_SCALES)
        w = (q - zero) * scale
    else:
        w = q * tl.load(scale_ptr + at, mask=ok, other=0.0)
    tl.store(out_ptr + rows * K + rk[None, :], w.to(out_ptr.dtype.element_ty), mask=ok)


# --- launchers ---------------------------------------------------------------------------------------------------
def _units(weight: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The weight viewed as the units its rows are read in: int32 words where a row is whole words, else bytes."""
    row_bytes = weight.shape[1] * weight.element_size()
    as_bytes = weight.view(torch.uint8)
    if interleaved or (row_bytes % 4 == 0 and as_bytes.data_ptr() % 4 == 0):
        return as_bytes.view(torch.int32)
    return as_bytes


def _group(k: int, scale2d: torch.Tensor) -> int:
    """The group size of a (N, groups) scale, 0 for one per row."""
    from ..quant import int4_group_size

    groups = scale2d.shape[1]
    return 0 if groups == 1 else int4_group_size(k, groups)


_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a GPU (cached: asked on every product; 132 off CUDA)."""
    if device.type != "cuda":
        return 132
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def mma_config(m: int, bits: int) -> MmaConfig:
    return next(config for bound, config in MMA_CONFIGS[bits] if m <= bound)


def _split(config: MmaConfig, tiles: int, steps: int, device: torch.device) -> int:
    """How many programs share each output tile's K: enough for two per SM (a lone program per SM hides too little
    memory latency), each keeping ≥ 4 steps."""
    if config.split:
        return min(config.split, steps)
    return max(1, min(-(-2 * sm_count(device) // tiles), steps // 4, 16))


def _step(config: MmaConfig, group: int) -> int:
    """Columns per step: the config's, within one group."""
    return min(config.block_k, group) if group else config.block_k


def mma_supported(bits: int, group: int, interleaved: bool, config: MmaConfig) -> bool:
    """Whether the tensor-core kernel takes this shape: a step (within one group) must be a dot at least 16 deep
    and hold whole interleaved blocks."""
    return _step(config, group) >= (4 * 32 // bits if interleaved else 16)


def _unpacking(config: MmaConfig, block_k: int, unit_bits: int, bits: int) -> int:
    """The config's unpacking, except where a value plane would be a dot less than 16 deep (RESHAPE then)."""
    return RESHAPE if config.unpack == PLANES and block_k * bits // unit_bits < 16 else config.unpack


def tiled_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                 interleaved: bool = False, config: MmaConfig | None = None) -> torch.Tensor:
    """x (M, K) @ dequant(w)^T by the tensor-core kernel (the shape must pass mma_supported)."""
    m, k = x.shape
    n = weight.shape[0]
    config = config or mma_config(m, bits)
    scale2d = scale.reshape(n, -1)
    group = _group(k, scale2d)
    units = _units(weight, interleaved)
    block_k = _step(config, group)
    steps = triton.cdiv(k, block_k)
    grid_nm = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m))
    split = _split(config, grid_nm[0] * grid_nm[1], steps, x.device)
    per_split = triton.cdiv(steps, split)
    split = triton.cdiv(steps, per_split)               # no program without a step
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _weight_only_mma_kernel[grid_nm + (split,)](
        x.contiguous(), units, scale2d, scale2d if zero is None else zero.reshape(n, -1), target, m, n, k,
        units.shape[1], scale2d.shape[1], per_split, BITS=bits, UNIT_BITS=units.element_size() * 8,
        HAS_ZERO=zero is not None or has_half_scales(scale), GROUP=group, HALF_SCALES=has_half_scales(scale),
        INTERLEAVED=interleaved,
        UNPACK=_unpacking(config, block_k, units.element_size() * 8, bits),
        EVEN_K=k % block_k == 0, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_N=config.block_n, BLOCK_M=config.block_m, BLOCK_K=block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](target, out, m * n, SPLIT=split, BLOCK=1024, num_warps=4)
    return out


def dequantize(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, k: int,
               interleaved: bool, dtype: torch.dtype) -> torch.Tensor:
    """The (N, K) matrix the quantized weight stands for, in `dtype` (one Triton kernel)."""
    n = weight.shape[0]
    scale2d = scale.reshape(n, -1)
    units = _units(weight, interleaved)
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    _dequantize_kernel[(triton.cdiv(n, 32), triton.cdiv(k, 128))](
        units, scale2d, scale2d if zero is None else zero.reshape(n, -1), out, n, k, units.shape[1],
        scale2d.shape[1], BITS=bits, UNIT_BITS=units.element_size() * 8,
        HAS_ZERO=zero is not None or has_half_scales(scale), GROUP=_group(k, scale2d),
        HALF_SCALES=has_half_scales(scale), INTERLEAVED=interleaved, BLOCK_N=32, BLOCK_K=128, num_warps=4)
    return out


def dequantized_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                       bits: int, interleaved: bool = False) -> torch.Tensor:
    """x @ dequant(w)^T by cuBLAS on the weight dequantized to x's dtype (a scratch matrix)."""
    return torch.nn.functional.linear(x, dequantize(weight, scale, zero, bits, x.shape[1], interleaved, x.dtype))


def weight_only_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                       bits: int, interleaved: bool = False) -> torch.Tensor:
    """out (M, N) = x (M, K) @ dequant(w)^T in x's dtype, for int8 ((N, K)) or packed int4 ((N, K/2)) weights in the
    engine or the interleaved layout with float32 scales (and zero points) per row or group, or an int32 `scale` of
    fp16 (scale, zero point) pairs per group (half_scale_pairs; `zero` None): the tensor-core
    kernel, or dequantize + cuBLAS from DEQUANTIZE_MIN_ROWS rows (and for groups too small for the kernel)."""
    config = mma_config(x.shape[0], bits)
    group = _group(x.shape[1], scale.reshape(weight.shape[0], -1))
    if x.shape[0] >= DEQUANTIZE_MIN_ROWS[bits] or not mma_supported(bits, group, interleaved, config):
        return dequantized_matmul(x, weight, scale, zero, bits, interleaved)
    return tiled_matmul(x, weight, scale, zero, bits, interleaved, config)
