"""Triton kernels for NVIDIA GPUs. Each has its pure-torch twin in reference.py (the oracle in tests).

Shapes follow the reference: packed tokens (T, ·), KV cache per layer (2, num_blocks, tokens_per_block, KH, D).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import int4_mma, mma_decode_attention
from .folded import DeferredNorm, ResidualSum
from .quant import Fp8Rows
from .triton_weight_only import half_scale_pairs, has_half_scales, load_scale_zero

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:                                   # Triton < 3.4: no programmatic dependent launch
    gdc_launch_dependents = gdc_wait = None


# --- programmatic dependent launch (Hopper) ------------------------------------------------------------------
# Every kernel here is launched with launch_pdl on sm_90+, so it may start while the kernel before it is still
# running (inside CUDA graphs too): its programs are resident when the previous grid ends, and the decode GEMV
# has its first weight loads in flight. `_wait_for_inputs` (griddepcontrol.wait) must therefore come before any
# load of what an earlier kernel wrote and before any store; loads of constant weights may precede it.
# KILN_PDL=0 turns it off.
PDL_ENABLED: bool | None = None       # None: decided on first use (a module attribute, so benchmarks can flip it)


def _pdl() -> bool:
    global PDL_ENABLED
    if PDL_ENABLED is None:
        PDL_ENABLED = (gdc_wait is not None and os.environ.get("KILN_PDL", "1") != "0"
                       and os.environ.get("TRITON_INTERPRET", "0") == "0" and torch.cuda.is_available()
                       and torch.cuda.get_device_capability()[0] >= 9)
    return PDL_ENABLED


def _launch() -> dict:
    """Launch options of every kernel: PDL (the constexpr) and launch_pdl, together."""
    return {"PDL": True, "launch_pdl": True} if _pdl() else {"PDL": False}


@triton.jit
def _wait_for_inputs(PDL: tl.constexpr):
    """Wait until the kernels before this one have finished and their writes are visible, then let the next kernel
    start launching."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# --- RMSNorm (+ residual add) --------------------------------------------------------------------------------
@triton.jit
def _fp8_row_scale(y):
    """A float32 row's per-token e4m3 scale: its largest magnitude / 448, as quant.quantize_activations_fp8."""
    return tl.math.div_rn(tl.maximum(tl.max(tl.abs(y), axis=0), 1e-8), 448.0)


@triton.jit
def _store_fp8_row(y, scale, ok, q_ptr, scale_ptr, row):
    """A float32 row y as e4m3 values y / scale (rounded division, as torch's) at q_ptr, and its scale."""
    tl.store(q_ptr, tl.clamp(tl.math.div_rn(y, scale), -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, n_cols, eps, HAS_RES: tl.constexpr,
                     BLOCK: tl.constexpr, FP8_OUT: tl.constexpr, PDL: tl.constexpr):
    """One row: RMSNorm (of x + residual, the sum written back as the new residual); out in x's dtype, or
    (FP8_OUT) the same values as per-token e4m3 with their scales."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    _wait_for_inputs(PDL)
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        tl.store(res_ptr + row * n_cols + cols, x, mask=mask)          # the new residual, in place
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = w * (xf * inv).to(x.dtype)
    if FP8_OUT:
        yf = y.to(tl.float32)
        _store_fp8_row(yf, _fp8_row_scale(yf), mask, out_ptr + row * n_cols + cols, scale_ptr, row)
    else:
        tl.store(out_ptr + row * n_cols + cols, y, mask=mask)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, fp8: bool):
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=torch.float8_e4m3fn if fp8 else x.dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if fp8 else out
    _rms_norm_kernel[(rows,)](x, x if residual is None else residual, weight, out, scale, cols, eps,
                              HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(cols), FP8_OUT=fp8,
                              num_warps=8, **_launch())
    return Fp8Rows(out, scale, x.dtype) if fp8 else out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps, fp8=False)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual); the sum is written into `residual`."""
    return _norm(x, residual, weight, eps, fp8=False), residual


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Rows:
    return _norm(x, None, weight, eps, fp8=True)


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    return _norm(x, residual, weight, eps, fp8=True), residual


# --- SiLU(gate) * up -----------------------------------------------------------------------------------------
@triton.jit
def _silu_mul(gate, up):
    """SiLU(gate)·up in up's dtype, rounded as reference.silu_and_mul (SiLU rounded, then the product)."""
    g = gate.to(tl.float32)
    return (g / (1.0 + tl.exp(-g))).to(up.dtype) * up


@triton.jit
def _gate_and_up(x_ptr, row, cols, mask, n_cols, PAIRED: tl.constexpr):
    """Columns `cols` of a row's gate and up halves; PAIRED: the row alternates gate, up (pair_gate_up_rows)."""
    if PAIRED:
        both = tl.load(x_ptr + row * 2 * n_cols + 2 * cols[:, None] + tl.arange(0, 2)[None, :], mask=mask[:, None],
                       other=0.0)
        return tl.split(both)
    gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0)
    return gate, tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, PAIRED: tl.constexpr, PDL: tl.constexpr):
    _wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate, up = _gate_and_up(x_ptr, row, cols, mask, n_cols, PAIRED)
    tl.store(out_ptr + row * n_cols + cols, _silu_mul(gate, up), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One whole row (its per-token scale needs all of it): SiLU(gate) * up as per-token e4m3."""
    _wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate, up = _gate_and_up(x_ptr, row, cols, mask, n_cols, False)
    act = _silu_mul(gate, up).to(tl.float32)
    _store_fp8_row(act, _fp8_row_scale(act), mask, q_ptr + row * n_cols + cols, scale_ptr, row)


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Rows:
    rows, n = x.shape[0], x.shape[-1] // 2
    q = torch.empty((rows, n), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n)
    _silu_and_mul_fp8_kernel[(rows,)](x, q, scale, n, BLOCK=block, num_warps=min(16, max(4, block // 1024)),
                                      **_launch())
    return Fp8Rows(q, scale, x.dtype)


def silu_and_mul(x: torch.Tensor, paired: bool = False) -> torch.Tensor:
    """SiLU(gate)·up of x = [gate | up] per row, or (paired) x's columns alternating gate, up."""
    n = x.shape[-1] // 2
    out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
    block = 1024
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, n, BLOCK=block, PAIRED=paired, num_warps=4,
                                                               **_launch())
    return out


# --- rotary embedding + KV-cache write -----------------------------------------------------------------------
@triton.jit
def _to_cache(x, scale, cache_ptr, KV_QUANT: tl.constexpr):
    """A float32 k or v block in the cache's dtype (KV_QUANT 1: int8, 2: fp8, both divided by scale)."""
    if KV_QUANT == 1:
        y = x / scale
        return tl.clamp(tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5)), -127.0, 127.0).to(tl.int8)
    elif KV_QUANT == 2:
        return tl.clamp(x / scale, -448.0, 448.0).to(cache_ptr.dtype.element_ty)
    else:
        return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _rope_and_cache_kernel(qkv_ptr, pos_ptr, cos_sin_ptr, slot_ptr, cache_ptr, q_out_ptr, cache_half, kv_scale_ptr,
                           HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                           HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr, KV_QUANT: tl.constexpr, PDL: tl.constexpr):
    """One program per token: rotate its q heads into q_out, its k heads into the cache, copy its v heads."""
    _wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    dim = 2 * HALF
    row = qkv_ptr + token * (HEADS + 2 * KV_HEADS) * dim
    d = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * dim + d)[None, :]
    sin = tl.load(cos_sin_ptr + pos * dim + HALF + d)[None, :]
    h = tl.arange(0, HEADS_PAD)
    qm = (h < HEADS)[:, None]
    src = row + h[:, None] * dim + d[None, :]
    x1 = tl.load(src, mask=qm, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=qm, other=0.0).to(tl.float32)
    dst = q_out_ptr + (token * HEADS + h[:, None]) * dim + d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=qm)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=qm)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:                                        # padded rows of a CUDA graph carry slot -1
        kh = tl.arange(0, KV_PAD)
        km = (kh < KV_HEADS)[:, None]
        k_src = row + (HEADS + kh[:, None]) * dim + d[None, :]
        k1 = tl.load(k_src, mask=km, other=0.0).to(tl.float32)
        k2 = tl.load(k_src + HALF, mask=km, other=0.0).to(tl.float32)
        k_scale = 1.0
        v_scale = 1.0
        if KV_QUANT > 0:
            k_scale = tl.load(kv_scale_ptr)
            v_scale = tl.load(kv_scale_ptr + 1)
        k_dst = cache_ptr + (slot * KV_HEADS + kh[:, None]) * dim + d[None, :]
        tl.store(k_dst, _to_cache(k1 * cos - k2 * sin, k_scale, cache_ptr, KV_QUANT), mask=km)
        tl.store(k_dst + HALF, _to_cache(k2 * cos + k1 * sin, k_scale, cache_ptr, KV_QUANT), mask=km)
        v_src = k_src + KV_HEADS * dim
        v1 = tl.load(v_src, mask=km, other=0.0).to(tl.float32)
        v2 = tl.load(v_src + HALF, mask=km, other=0.0).to(tl.float32)
        tl.store(k_dst + cache_half, _to_cache(v1, v_scale, cache_ptr, KV_QUANT), mask=km)
        tl.store(k_dst + cache_half + HALF, _to_cache(v2, v_scale, cache_ptr, KV_QUANT), mask=km)


def _kv_quant(kv_cache: torch.Tensor) -> int:
    return {torch.int8: 1, torch.float8_e4m3fn: 2}.get(kv_cache.dtype, 0)


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                   kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate q and k of the fused projection qkv (T, (H + 2KH) D); k, v go to their cache slots.
    Returns the rotated q (T, H, D)."""
    tokens = qkv.shape[0]
    q = torch.empty((tokens, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    _rope_and_cache_kernel[(tokens,)](qkv, positions, cos_sin, slot_mapping, kv_cache, q, kv_cache[0].numel(),
                                      cos_sin if kv_scale is None else kv_scale,
                                      HEADS=heads, KV_HEADS=kv_heads, HALF=head_dim // 2,
                                      HEADS_PAD=triton.next_power_of_2(heads),
                                      KV_PAD=triton.next_power_of_2(kv_heads), KV_QUANT=_kv_quant(kv_cache), num_warps=4,
                                      **_launch())
    return q


# --- attention over the paged cache --------------------------------------------------------------------------
# Four cached int8 or e4m3 values of one int32 word → four fp16 values ($0..$3, in column order). int8: each byte,
# sign flipped, becomes the low byte of the fp16 1024 + (q + 128), then 1152 is subtracted; e4m3: two
# cvt.rn.f16x2.e4m3x2. Both are exact.
_INT8_WORD_TO_FP16 = tl.constexpr(
    "{ .reg .b32 u, a, b, c; xor.b32 u, $4, 0x80808080; prmt.b32 a, u, 0x64646464, 0x4140; "
    "prmt.b32 b, u, 0x64646464, 0x4342; mov.b32 c, 0x64806480; sub.f16x2 a, a, c; sub.f16x2 b, b, c; "
    "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }")
_FP8_WORD_TO_FP16 = tl.constexpr(
    "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
    "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }")


@triton.jit
def _cache_words_to_fp16(words, KV_QUANT: tl.constexpr, TILE: tl.constexpr, DIM: tl.constexpr):
    """(TILE, DIM/4) int32 words of a quantized cache → (TILE, DIM) fp16, converted in registers in the layout the
    words were loaded in, so that the tile reaches the tensor cores through shared memory as 16-bit values (an
    8-bit tile read transposed from shared memory goes a byte at a time)."""
    if KV_QUANT == 1:
        asm: tl.constexpr = _INT8_WORD_TO_FP16
    else:
        asm: tl.constexpr = _FP8_WORD_TO_FP16
    p0, p1, p2, p3 = tl.inline_asm_elementwise(asm, "=h,=h,=h,=h,r", [words],
                                               dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                               is_pure=True, pack=1)
    return tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), [TILE, DIM])


@triton.jit
def _cache_rows(table, start, stop, t, kv_head, KV_HEADS: tl.constexpr, BLOCK_TOKENS: tl.constexpr):
    """The (TILE,) cache rows of positions start + t of a sequence (its block table at `table`) and which of them
    are before stop."""
    kv_pos = start + t
    in_range = kv_pos < stop
    block = tl.load(table + kv_pos // BLOCK_TOKENS, mask=in_range, other=0).to(tl.int64)
    return (block * BLOCK_TOKENS + kv_pos % BLOCK_TOKENS) * KV_HEADS + kv_head, in_range


@triton.jit
def _kv_tile(cache_ptr, cache_half, table, start, stop, t, d, kv_head, KV_HEADS: tl.constexpr,
             BLOCK_TOKENS: tl.constexpr, DIM: tl.constexpr):
    """Keys and values (TILE, DIM) of cache positions start + t (zeros from stop on)."""
    cached, in_range = _cache_rows(table, start, stop, t, kv_head, KV_HEADS, BLOCK_TOKENS)
    offsets = cached[:, None] * DIM + d[None, :]
    return (tl.load(cache_ptr + offsets, mask=in_range[:, None], other=0.0),
            tl.load(cache_ptr + cache_half + offsets, mask=in_range[:, None], other=0.0))


@triton.jit
def _load_cache_words(cache_ptr, cache_half, table, start, stop, t, w, kv_head, KV_HEADS: tl.constexpr,
                      BLOCK_TOKENS: tl.constexpr, DIM: tl.constexpr):
    """The (TILE, DIM/4) int32 words of keys and of values of cache positions start + t (zeros from stop on)."""
    cached, in_range = _cache_rows(table, start, stop, t, kv_head, KV_HEADS, BLOCK_TOKENS)
    words = cache_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + cached[:, None] * (DIM // 4) + w[None, :]
    return (tl.load(words, mask=in_range[:, None], other=0),
            tl.load(words + cache_half // 4, mask=in_range[:, None], other=0))


@triton.jit
def _online_softmax(s, v, m, l, acc, PRECISION: tl.constexpr):
    """The running max m, sum l and output acc of each row advanced over one tile's masked scores s and values v."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit(do_not_specialize=["bt_stride", "window"])     # both vary between steps: no recompiles for them
def _paged_attention_kernel(
        q_ptr, cache_ptr, cache_half, block_tables_ptr, bt_stride, seq_lens_ptr, q_start_ptr, out_ptr,
        part_m_ptr, part_l_ptr, part_acc_ptr, scale, window, kv_scale_ptr,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr, TILE: tl.constexpr, BLOCK_Q: tl.constexpr, PART_TOKENS: tl.constexpr,
        NUM_PARTS: tl.constexpr, PRECISION: tl.constexpr, KV_QUANT: tl.constexpr, WORD_LOADS: tl.constexpr,
        PDL: tl.constexpr):
    """One program: BLOCK_Q query tokens of one sequence × the GROUP query heads of one KV head, over the keys of
    one partition of the sequence, TILE tokens at a time (each token's cache block looked up in the block
    table). With NUM_PARTS > 1 the partitions' softmax statistics are merged by _merge_kernel (split-K).
    WORD_LOADS (quantized caches): read the cache as int32 words converted by _cache_words_to_fp16; otherwise as
    8-bit values converted by Triton."""
    _wait_for_inputs(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    qblock_part = tl.program_id(2)
    qblock = qblock_part // NUM_PARTS
    part = qblock_part % NUM_PARTS
    heads = KV_HEADS * GROUP
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    q_start = tl.load(q_start_ptr + seq).to(tl.int32)
    q_len = tl.load(q_start_ptr + seq + 1).to(tl.int32) - q_start
    if qblock * BLOCK_Q >= q_len:
        return
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = qblock * BLOCK_Q + rows // GROUP_PAD                      # query token within the sequence
    g = rows % GROUP_PAD
    row_ok = (token < q_len) & (g < GROUP)
    q_pos = seq_len - q_len + token                                   # its position in the sequence
    d = tl.arange(0, DIM)
    q_rows = (q_start + token).to(tl.int64) * heads + kv_head * GROUP + g
    q = tl.load(q_ptr + q_rows[:, None] * DIM + d[None, :], mask=row_ok[:, None], other=0.0)
    end = seq_len - q_len + tl.minimum(q_len, (qblock + 1) * BLOCK_Q)  # keys [0, end) can be attended to
    first = part * PART_TOKENS
    stop = tl.minimum(first + PART_TOKENS, end)
    if window > 0:
        lowest = tl.maximum(seq_len - q_len + qblock * BLOCK_Q - window + 1, 0)
        first = tl.maximum(first, (lowest // TILE) * TILE)
    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM], tl.float32)
    if KV_QUANT > 0:
        # A quantized cache is multiplied as it is stored (int8 and e4m3 convert exactly to fp16, one instruction
        # per value pair) with its scales applied once: the key scale to the scores, the value scale to the output.
        scale = scale * tl.load(kv_scale_ptr)
        if q.dtype != tl.float32:
            q = q.to(tl.float16)
    t = tl.arange(0, TILE)
    w = tl.arange(0, DIM // 4)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    WORDS: tl.constexpr = KV_QUANT > 0 and q.dtype == tl.float16 and WORD_LOADS
    for start in range(first, stop, TILE):
        kv_pos = start + t
        in_range = kv_pos < stop
        if WORDS:
            k_words, v_words = _load_cache_words(cache_ptr, cache_half, table, start, stop, t, w, kv_head, KV_HEADS,
                                                 BLOCK_TOKENS, DIM)
            k = _cache_words_to_fp16(k_words, KV_QUANT, TILE, DIM)
            v = _cache_words_to_fp16(v_words, KV_QUANT, TILE, DIM)
        else:
            k, v = _kv_tile(cache_ptr, cache_half, table, start, stop, t, d, kv_head, KV_HEADS, BLOCK_TOKENS, DIM)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (rows, TILE)
        ok = (kv_pos[None, :] <= q_pos[:, None]) & row_ok[:, None] & in_range[None, :]
        if window > 0:
            ok = ok & (kv_pos[None, :] > q_pos[:, None] - window)
        m, l, acc = _online_softmax(tl.where(ok, s, float("-inf")), v, m, l, acc, PRECISION)
    if KV_QUANT > 0:
        acc = acc * tl.load(kv_scale_ptr + 1)
    if NUM_PARTS == 1:
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + q_rows[:, None] * DIM + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        idx = q_rows * NUM_PARTS + part
        tl.store(part_m_ptr + idx, m, mask=row_ok)
        tl.store(part_l_ptr + idx, l, mask=row_ok)
        tl.store(part_acc_ptr + idx[:, None] * DIM + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_row(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, row, NUM_PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
               DIM: tl.constexpr, CACHE: tl.constexpr):
    """Combine the per-partition softmax statistics of one (token, head) row into its output (all partitions
    loads in flight together). CACHE: the loads' cache modifier (".cg" where other SMs wrote them in this kernel)."""
    parts = tl.arange(0, PARTS_PAD)
    real = parts < NUM_PARTS
    m = tl.load(part_m_ptr + row * NUM_PARTS + parts, mask=real, other=float("-inf"), cache_modifier=CACHE)
    l = tl.load(part_l_ptr + row * NUM_PARTS + parts, mask=real, other=0.0, cache_modifier=CACHE)
    d = tl.arange(0, DIM)
    acc = tl.load(part_acc_ptr + (row * NUM_PARTS + parts)[:, None] * DIM + d[None, :], mask=real[:, None], other=0.0,
                  cache_modifier=CACHE)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
    total = tl.sum(acc * w[:, None], axis=0)
    norm = tl.sum(l * w, axis=0)
    tl.store(out_ptr + row * DIM + d, (total / tl.where(norm == 0.0, 1.0, norm)).to(out_ptr.dtype.element_ty))


@triton.jit
def _merge_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, NUM_PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
                  DIM: tl.constexpr, PDL: tl.constexpr):
    """Combine the per-partition softmax statistics of one (token, head) row."""
    _wait_for_inputs(PDL)
    _merge_row(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, tl.program_id(0).to(tl.int64), NUM_PARTS, PARTS_PAD,
               DIM, "")


# --- decode steps: rope + cache write + attention + split-K merge in one kernel --------------------------------
FUSED_DECODE = True     # one-token steps over a 16-bit cache take _decode_attention_kernel instead of three kernels
DECODE_PRELOAD = True   # its first tile of cached keys loaded before the PDL wait
UNROLLED_MERGE = tl.constexpr(16)   # up to this many partitions the last program merges them in the layout of the
                                    # accumulators, all loads issued at once; more: row by row (_merge_row)


@triton.jit
def _rotated(src, d, cos, sin, mask, HALF: tl.constexpr, DIM: tl.constexpr):
    """Rows at src (columns d) rotated as _rope_and_cache_kernel rotates them (the same float32 operations):
    x·cos - partner·sin in the first half, x·cos + partner·sin in the second."""
    x = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(src + ((d + HALF) % DIM)[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.where((d < HALF)[None, :], x * cos[None, :] - partner * sin[None, :],
                    x * cos[None, :] + partner * sin[None, :])


@triton.jit
def _merge_partials(part_m_ptr, part_l_ptr, part_acc_ptr, first_part, row_ok, d, NUM_PARTS: tl.constexpr,
                    DIM: tl.constexpr):
    """The rows' attention output from the NUM_PARTS partials (m, l, acc) at first_part + p, read past L1 (other
    SMs wrote them)."""
    m = tl.full(first_part.shape, float("-inf"), tl.float32)
    l = tl.zeros(first_part.shape, tl.float32)
    acc = tl.zeros([first_part.shape[0], DIM], tl.float32)
    for p in tl.static_range(NUM_PARTS):
        idx = first_part + p
        m_p = tl.load(part_m_ptr + idx, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        l_p = tl.load(part_l_ptr + idx, mask=row_ok, other=0.0, cache_modifier=".cg")
        acc_p = tl.load(part_acc_ptr + idx[:, None] * DIM + d[None, :], mask=row_ok[:, None], other=0.0,
                        cache_modifier=".cg")
        m_new = tl.maximum(m, m_p)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        beta = tl.exp(m_p - m_safe)
        l = l * alpha + l_p * beta
        acc = acc * alpha[:, None] + acc_p * beta[:, None]
        m = m_new
    return acc / tl.where(l == 0.0, 1.0, l)[:, None]


@triton.jit
def _attend_tile(q, k, v, kv_pos, stop, low, scale, row_ok, m, l, acc, PRECISION: tl.constexpr):
    """The online softmax (m, l, acc) of q's rows advanced over one tile of cached keys k and values v at positions
    kv_pos (those from stop on, or at or below low, masked)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale      # (ROWS, TILE)
    s = tl.where(row_ok[:, None] & ((kv_pos < stop) & (kv_pos > low))[None, :], s, float("-inf"))
    return _online_softmax(s, v, m, l, acc, PRECISION)


@triton.jit
def _attend_new_key(q, k_new, v_new, scale, m, l, acc):
    """The online softmax advanced over the one new key and value (rounded to the cache's dtype, as if read back
    from it), with p rounded as the tiles' products round it."""
    s = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
    m_new = tl.maximum(m, s)
    p = tl.exp(s - m_new)
    alpha = tl.exp(m - m_new)
    p = p.to(v_new.dtype).to(tl.float32)
    return m_new, l * alpha + p, acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]


@triton.jit(do_not_specialize=["bt_stride", "window"])
def _decode_attention_kernel(
        qkv_ptr, pos_ptr, cos_sin_ptr, slot_ptr, cache_ptr, cache_half, block_tables_ptr, bt_stride, seq_lens_ptr,
        out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, arrivals_ptr, scale, window,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr, TILE: tl.constexpr, PART_TOKENS: tl.constexpr, NUM_PARTS: tl.constexpr,
        PARTS_PAD: tl.constexpr, PRELOAD: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """A one-token step of sequence `seq`, its KV head `kv_head`, keys of partition `part`: the GROUP query heads
    rotated from the fused projection qkv, attention over the partition's cached keys, and — in the program whose
    partition holds the new position — over the new key and value (rotated, rounded to the cache's dtype) from
    registers, which that program also writes to their cache slot. With NUM_PARTS > 1 each program stores its
    softmax partials and counts itself in at arrivals_ptr; the last to arrive merges them and sets the count back to
    0. PRELOAD: the first tile of cached keys is loaded before the PDL wait (no kernel of this step writes them)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    HALF: tl.constexpr = DIM // 2
    heads = KV_HEADS * GROUP
    d = tl.arange(0, DIM)
    t = tl.arange(0, TILE)
    r = tl.arange(0, ROWS)
    row_ok = r < GROUP
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)                # 0 on a CUDA graph's padded rows
    new_pos = seq_len - 1
    part_first = part * PART_TOKENS
    part_end = part_first + PART_TOKENS
    first = part_first
    low = -1                                                          # keys at or below it are outside the window
    if window > 0:
        low = new_pos - window
        first = tl.maximum(first, (tl.maximum(low + 1, 0) // TILE) * TILE)
    owner = (new_pos >= part_first) & (new_pos < part_end)
    stop = tl.minimum(part_end, new_pos)                              # cached keys: those before the new one
    pos = tl.load(pos_ptr + seq).to(tl.int64)                         # step inputs: no kernel of the step writes
    cos = tl.load(cos_sin_ptr + pos * DIM + d % HALF)                 # them, so they are read before the PDL wait
    sin = tl.load(cos_sin_ptr + pos * DIM + HALF + d % HALF)
    if PRELOAD:
        k, v = _kv_tile(cache_ptr, cache_half, table, first, stop, t, d, kv_head, KV_HEADS, BLOCK_TOKENS, DIM)
    _wait_for_inputs(PDL)
    row = qkv_ptr + seq.to(tl.int64) * (heads + 2 * KV_HEADS) * DIM
    q = _rotated(row + (kv_head * GROUP + r)[:, None] * DIM, d, cos, sin, row_ok[:, None], HALF, DIM)
    q = q.to(qkv_ptr.dtype.element_ty)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM], tl.float32)
    begin = first
    if PRELOAD:
        if first < stop:
            m, l, acc = _attend_tile(q, k, v, first + t, stop, low, scale, row_ok, m, l, acc, PRECISION)
        begin = first + TILE
    for start in range(begin, stop, TILE):
        k, v = _kv_tile(cache_ptr, cache_half, table, start, stop, t, d, kv_head, KV_HEADS, BLOCK_TOKENS, DIM)
        m, l, acc = _attend_tile(q, k, v, start + t, stop, low, scale, row_ok, m, l, acc, PRECISION)
    if owner:
        k_src = row + (heads + kv_head) * DIM
        k_new = tl.sum(_rotated(k_src, d, cos, sin, (d < DIM)[None, :], HALF, DIM), axis=0)     # (DIM,)
        k_new = k_new.to(cache_ptr.dtype.element_ty)
        v_new = tl.load(k_src + KV_HEADS * DIM + d).to(cache_ptr.dtype.element_ty)
        m, l, acc = _attend_new_key(q, k_new, v_new, scale, m, l, acc)
        slot = tl.load(slot_ptr + seq)
        if slot >= 0:                                    # padded rows of a CUDA graph carry slot -1
            k_dst = cache_ptr + (slot * KV_HEADS + kv_head) * DIM + d
            tl.store(k_dst, k_new)
            tl.store(k_dst + cache_half, v_new)
    q_rows_first = seq.to(tl.int64) * heads + kv_head * GROUP
    q_rows = q_rows_first + r
    out_at = out_ptr + q_rows[:, None] * DIM + d[None, :]
    if NUM_PARTS == 1:
        tl.store(out_at, (acc / tl.where(l == 0.0, 1.0, l)[:, None]).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        idx = q_rows * NUM_PARTS + part
        tl.store(part_m_ptr + idx, m, mask=row_ok)
        tl.store(part_l_ptr + idx, l, mask=row_ok)
        tl.store(part_acc_ptr + idx[:, None] * DIM + d[None, :], acc, mask=row_ok[:, None])
        tl.debug_barrier()                                   # every thread's partials before the count
        counter = arrivals_ptr + seq * KV_HEADS + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == NUM_PARTS - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            if NUM_PARTS <= UNROLLED_MERGE:
                out = _merge_partials(part_m_ptr, part_l_ptr, part_acc_ptr, q_rows * NUM_PARTS, row_ok, d,
                                      NUM_PARTS, DIM)
                tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
            else:
                for g in tl.static_range(GROUP):
                    _merge_row(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, q_rows_first + g, NUM_PARTS, PARTS_PAD,
                               DIM, ".cg")


def _partition_tokens(num_parts: int, part_tokens: int | None, block_tables: torch.Tensor, tokens_per_block: int,
                      step: int) -> int:
    """Keys per split-K partition (the PART_TOKENS constexpr), a multiple of the kernel's step: ONE_PARTITION
    unsplit (the table's width varies between steps and would recompile), by default the whole block table."""
    if num_parts == 1:
        return ONE_PARTITION
    if part_tokens is None:
        part_tokens = block_tables.shape[1] * tokens_per_block
    return triton.cdiv(part_tokens, step) * step


def _split_k_partials(out: torch.Tensor, num_parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 (m, l, acc) of every (token, head) row of out (T, H, D) and partition; out itself (unused) for one
    partition."""
    if num_parts == 1:
        return out, out, out
    tokens, heads, dim = out.shape
    part_m = torch.empty((tokens * heads * num_parts,), dtype=torch.float32, device=out.device)
    return part_m, torch.empty_like(part_m), torch.empty((part_m.numel(), dim), dtype=torch.float32, device=out.device)


_ARRIVALS: list[torch.Tensor] = []    # zeroed counters per device; older ones stay alive for graphs captured on them


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """n int32 counters at 0 (the fused decode kernel leaves them at 0). One set per device serves every launch
    because the runtime issues a device's kernels on one stream: two decode kernels never run at once."""
    for counters in reversed(_ARRIVALS):
        if counters.device == device and counters.numel() >= n:
            return counters
    _ARRIVALS.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return _ARRIVALS[-1]


def fused_decode_takes(qkv: torch.Tensor, kv_cache: torch.Tensor, max_query_len: int, num_parts: int, head_dim: int,
                       kv_scale: torch.Tensor | None) -> bool:
    """Whether a step goes to decode_attention: one token per sequence split into partitions (the small batches that
    model_runner.decode_partitions splits: on an H200 one kernel beats three there, 6.1 -> 5.0 µs a layer at batch 1
    over 256 keys, 8.4 -> 6.0 over 1024, 11.9 -> 6.9 at batch 8 over 256; unsplit batches of 64-256 sequences were
    faster on the three), a 16-bit cache, a power-of-two head size."""
    return (FUSED_DECODE and max_query_len == 1 and num_parts > 1 and kv_scale is None and kv_cache.dtype == qkv.dtype
            and qkv.dtype in (torch.float16, torch.bfloat16) and head_dim == triton.next_power_of_2(head_dim))


def decode_attention(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, heads: int,
                     kv_heads: int, head_dim: int, scale: float, sliding_window: int | None, num_parts: int = 1,
                     part_tokens: int | None = None, tile: int | None = None,
                     preload: bool | None = None) -> torch.Tensor:
    """rope_and_cache then paged_attention of a one-token step (fused_decode_takes) in one kernel: the attention
    output (T, H, D), k and v of the new tokens written to their cache slots. tile: keys per iteration
    (attention_config's by default); preload: the first tile before the PDL wait (DECODE_PRELOAD by default)."""
    tokens = qkv.shape[0]
    tokens_per_block = kv_cache.shape[2]
    tile = tile or attention_config(1, kv_cache.dtype)[0]
    part_tokens = _partition_tokens(num_parts, part_tokens, block_tables, tokens_per_block, tile)
    out = torch.empty((tokens, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    part_m, part_l, part_acc = _split_k_partials(out, num_parts)
    group = heads // kv_heads
    _decode_attention_kernel[(tokens, kv_heads, num_parts)](
        qkv, positions, cos_sin, slot_mapping, kv_cache, kv_cache[0].numel(), block_tables, block_tables.stride(0),
        seq_lens, out, part_m, part_l, part_acc, _arrival_counters(qkv.device, tokens * kv_heads), scale,
        sliding_window or 0, KV_HEADS=kv_heads, GROUP=group, ROWS=max(16, triton.next_power_of_2(group)),
        DIM=head_dim, BLOCK_TOKENS=tokens_per_block, TILE=tile, PART_TOKENS=part_tokens, NUM_PARTS=num_parts,
        PARTS_PAD=triton.next_power_of_2(num_parts), PRELOAD=DECODE_PRELOAD if preload is None else preload,
        PRECISION="tf32", num_warps=4, num_stages=2, **_launch())
    return out


def attention_config(max_query_len: int, kv_dtype: torch.dtype) -> tuple[int, tuple[int, int], bool]:
    """(keys per tile, (num_warps, num_stages), word loads of a quantized cache) of the paged attention kernel.
    Decode over an e4m3 cache takes tiles of 128 keys: 5% faster at 512 sequences of 128-256 keys, 14% at 256 of
    1-2k (benchmarks/gpu_suite.py --phases attn_sweep on an H200; bf16 and int8 caches are fastest at 64)."""
    if max_query_len == 1 and kv_dtype == torch.float8_e4m3fn:
        return 128, (4, 2), True
    return 64, (4, 2), True


ONE_PARTITION = 1 << 30     # PART_TOKENS of an unsplit sequence: more keys than any sequence has
DECODE_MMA = True           # decode steps over an e4m3/int8 cache on mma.sync (kernels/mma_decode_attention.py):
                            # 2.0x faster than _paged_attention_kernel at 512 x 128-256 keys, 1.7x at 256 x 1-2k


def decode_mma(kv_dtype: torch.dtype, head_dim: int, group: int, tokens_per_block: int, device,
               mma: bool | None = None) -> bool:
    """Whether decode attention over this cache runs on mma_decode_attention (one warp per program; split-K
    partitions are chosen for that: model_runner.decode_partitions). mma: None follows DECODE_MMA."""
    return ((DECODE_MMA if mma is None else mma)
            and mma_decode_attention.takes(kv_dtype, head_dim, group, tokens_per_block)
            and mma_decode_attention.available(device))


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, max_query_len: int, scale: float, sliding_window: int | None,
                    num_parts: int = 1, part_tokens: int | None = None, tile: int | None = None,
                    kv_scale: torch.Tensor | None = None, launch: tuple[int, int] | None = None,
                    word_loads: bool | None = None, mma: bool | None = None) -> torch.Tensor:
    """Causal attention of packed queries q (T, H, D) over each sequence's paged keys/values → (T, H, D).

    num_parts > 1 splits each sequence's keys into partitions of part_tokens (multi_block_mode) and merges them.
    tile (keys per iteration), launch (num_warps, num_stages) and word_loads default to attention_config's choice.
    mma (default DECODE_MMA): a decode step over an 8-bit cache goes to mma_decode_attention where it takes it."""
    tokens, heads, dim = q.shape
    kv_heads, tokens_per_block = kv_cache.shape[-2], kv_cache.shape[2]
    default_tile, default_launch, default_words = attention_config(max_query_len, kv_cache.dtype)
    tile, (num_warps, num_stages) = tile or default_tile, launch or default_launch
    word_loads = default_words if word_loads is None else word_loads
    group = heads // kv_heads
    group_pad = max(1, triton.next_power_of_2(group))
    block_q = 1 if max_query_len == 1 else max(1, 64 // group_pad)
    block_q = max(block_q, triton.cdiv(16, group_pad))                  # tl.dot needs at least 16 rows
    one_warp = (max_query_len == 1 and kv_scale is not None
                and decode_mma(kv_cache.dtype, dim, group, tokens_per_block, q.device, mma))
    part_tokens = _partition_tokens(num_parts, part_tokens, block_tables, tokens_per_block,
                                    mma_decode_attention.CHUNK if one_warp else tile)
    out = torch.empty_like(q)
    part_m, part_l, part_acc = _split_k_partials(out, num_parts)
    if one_warp:
        mma_decode_attention.decode_attention(
            q, kv_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, kv_scale, out,
            (part_m, part_l, part_acc) if num_parts > 1 else None, num_parts, part_tokens, _launch())
    else:
        grid = (seq_lens.shape[0], kv_heads, triton.cdiv(max_query_len, block_q) * num_parts)
        _paged_attention_kernel[grid](
            q, kv_cache, kv_cache[0].numel(), block_tables, block_tables.stride(0), seq_lens, query_start_loc, out,
            part_m, part_l, part_acc, scale, sliding_window or 0, q if kv_scale is None else kv_scale,
            KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, DIM=dim, BLOCK_TOKENS=tokens_per_block, TILE=tile,
            BLOCK_Q=block_q, PART_TOKENS=part_tokens, NUM_PARTS=num_parts,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_QUANT=_kv_quant(kv_cache),
            WORD_LOADS=word_loads, num_warps=num_warps, num_stages=num_stages, **_launch())
    if num_parts > 1:
        _merge_kernel[(tokens * heads,)](part_m, part_l, part_acc, out, NUM_PARTS=num_parts,
                                         PARTS_PAD=triton.next_power_of_2(num_parts), DIM=dim, num_warps=4,
                                         **_launch())
    return out



# --- matrix products on quantized weights ----------------------------------------------------------------------
# The engine stores int4 weights as bytes (low nibble = even column) and int8 weights row-major (kernels/quant.py).
# At load the GPU re-packs them (interleave_weight) so that each 16-byte block of a row is four int32 words whose
# j-th values are four consecutive columns: word i, value j holds column 4j + i of the block (a block spans 32
# columns of int4, 16 of int8). The decode GEMV then multiplies value j of four adjacent words by one contiguous
# slice of x, with 16-byte weight loads and no gathers.
#
# Fusions of the decode GEMV, each a switch read when a network is loaded (benchmarks/gpu_suite.py's decode_fusions
# phase flips them between loads to measure each off and on; docs/quantization.md). Defaults follow the H200
# measurements; a switch not yet measured on a GPU stays off until it is.
GEMV_SILU = (8,)      # bit widths whose gate_up rows are paired at load, so that the GEMV writes SiLU(gate)·up (no
                      # silu_and_mul kernel); True: every width. int8 +4.4% at batch 1, int4 -6.4% (docs/performance.md)
GEMV_NORMS = False    # o/down GEMVs add the residual and sum its squares; qkv/gate_up GEMVs apply the RMSNorm as
                      # they load x (no add_rms_norm kernels; one rank only: kernels/folded.py); read per call, i.e.
                      # when a CUDA graph is captured. GPU tests pass, but slower: W8A16 338.6 -> 329.8 tok/s,
                      # W4A16_AWQ 392.6 -> 350.1 (normalizing x in every program costs more than the kernels saved)
GEMV_HALF_SCALES = True   # int4 group scales and zero points as fp16 pairs (4 bytes a group instead of 8) where fp16
                          # holds them. GPU tests pass; never slower in three H200 runs: W4A16_AWQ 392.6 -> 393.8,
                          # 371.4 -> 403.2, 392.7 -> 400.6 tok/s (docs/performance.md, sixth session)
GEMV_MMA = True       # int4 layers that fit (int4_mma.takes) in the tensor cores' fragment layout and run faster on
                      # it (_prefers_mma): products of ≤ 16 rows on mma.sync (kernels/int4_mma.py), more rows
                      # dequantized for cuBLAS; wins over the pairs of GEMV_SILU and the fp16 scales of
                      # GEMV_HALF_SCALES, which that kernel does not read. H200, one row after a short kernel
                      # (fourteenth session's int4_mma): o 3.1 µs, down 10.8, gate_up 18.5 (CUDA-core 21.4), LM head
                      # 73.9 (86.6); qkv 4.2 vs 6.0 µs alone, no faster in the model until MMA_NORMS folded its
                      # RMSNorm in (W4A16_AWQ batch 1, 5 runs: 553.3 tok/s on the CUDA-core GEMV, 573.2 on int4_mma)
                      # "all": every int4 layer int4_mma takes
# (N, K) → whether int4_mma's one-row product beats the CUDA-core GEMV in the model (benchmarks/gpu_suite.py --phases
# int4_mma and decode batch 1, H200, Llama-3.1-8B shapes); other shapes: int4_mma where it has at most two row
# blocks per SM, as o and down do (the CUDA-core GEMV lags with few, long rows)
GEMV_MMA_MEASURED = {(4096, 4096): True, (4096, 14336): True, (6144, 4096): True, (28672, 4096): True,
                     (128256, 4096): True}
MMA_SILU = True       # gate/up projections on int4_mma pair their 16-row blocks at load (int4_mma.pair_blocks), so
                      # that a program of a gate block and its up block writes SiLU(gate)·up (no silu_and_mul kernel)
MMA_NORMS = True      # at one row, o/down on int4_mma add the residual, store it times the next RMSNorm's weight and
                      # sum its squares; qkv/gate_up on int4_mma multiply their products by 1/rms (no add_rms_norm
                      # kernels; one rank only: kernels/folded.py); read per call. H200, 8B W4A16_AWQ batch 1 (22
                      # runs, medians): 550.4 -> 578.6 tok/s with qkv on int4_mma (docs/performance.md)
GEMV_SWITCHES = ("GEMV_SILU", "GEMV_NORMS", "GEMV_HALF_SCALES", "GEMV_MMA", "MMA_SILU", "MMA_NORMS")


@dataclass(frozen=True)
class Interleaved:
    """The GPU's layout of a weight-only layer, made at load and never stored: columns interleaved within 16-byte
    blocks (interleave_weight); paired_rows: a gate/up projection's gate and up rows alternate (pair_gate_up_rows),
    so that each GEMV program holds matching pairs and writes SiLU(gate)·up; half_scales: an int4 layer's group
    scales and zero points as fp16 pairs, one int32 per group in `weight_scale` (no `weight_zero`); fragments: an
    int4 layer in int4_mma's layout (half_scales False; paired_rows: its 16-row blocks alternate, int4_mma.pair_blocks,
    read by int4_mma.gemv(silu=True))."""
    paired_rows: bool = False
    half_scales: bool = False
    fragments: bool = False


INTERLEAVED = Interleaved()


def _block_columns(bits: int) -> int:
    return 4 * 32 // bits


def interleave_weight(weight: torch.Tensor, bits: int, inverse: bool = False) -> torch.Tensor:
    """Engine layout → interleaved layout of an int4 (uint8 (N, K/2)) or int8 ((N, K)) matrix; `inverse` undoes it.
    K must be a multiple of the block (32 int4 / 16 int8 columns)."""
    from .quant import pack_int4, unpack_int4

    values = unpack_int4(weight) if bits == 4 else weight
    n, k = values.shape
    per_word = 32 // bits
    shape = (n, k // _block_columns(bits), 4, per_word) if inverse else (n, k // _block_columns(bits), per_word, 4)
    values = values.reshape(shape).transpose(2, 3).reshape(n, k)
    return pack_int4(values) if bits == 4 else values.contiguous()


def pair_gate_up_rows(t: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rows [gate 0..I-1 | up 0..I-1] → gate i at row 2i, up i at 2i + 1 (any trailing shape); `inverse` undoes it."""
    halves = t.reshape(t.shape[0] // 2, 2, *t.shape[1:]) if inverse else t.reshape(2, t.shape[0] // 2, *t.shape[1:])
    return halves.transpose(0, 1).reshape(t.shape).contiguous()


def _weight_only(algo: str) -> bool:
    return algo == "W8A16" or algo.startswith("W4A16")


def _bits(algo: str) -> int:
    """Bits per weight of a weight-only mode."""
    return 8 if algo == "W8A16" else 4


def _paired(params: dict) -> bool:
    layout = params.get("layout")
    return isinstance(layout, Interleaved) and layout.paired_rows


def pack_quant(algo: str, params: dict, gated: bool = False) -> tuple[Interleaved, dict] | None:
    """The GPU's own layout of a quantized layer's parameters, made once at load: (layout, replaced tensors), or None
    where the engine layout is used as it is. gated: a gate/up projection without bias, read by quant_linear_silu."""
    if not _weight_only(algo):
        return None
    bits = _bits(algo)
    weight = params["weight"]
    grid = {name: params[name] for name in ("weight_scale", "weight_zero") if name in params}
    if bits == 4 and _takes_fragments(params):
        paired = gated and MMA_SILU and weight.shape[0] % (2 * int4_mma.ROW_BLOCK) == 0
        if paired:
            weight = int4_mma.pair_blocks(weight)
            grid = {name: t if t is None else int4_mma.pair_blocks(t) for name, t in grid.items()}
        return Interleaved(paired_rows=paired, fragments=True), {
            "weight": int4_mma.pack(weight), "weight_zero": None,
            "weight_scale": int4_mma.pack_grid(grid["weight_scale"], grid.get("weight_zero"))}
    if (weight.shape[1] * 8 // bits) % _block_columns(bits):
        return None                        # the tiled kernel reads the engine layout
    tensors = {"weight": interleave_weight(weight, bits), **grid}
    paired = gated and (GEMV_SILU is True or bits in (GEMV_SILU or ()))
    if paired:
        tensors = {name: pair_gate_up_rows(t) for name, t in tensors.items()}
    half = GEMV_HALF_SCALES and bits == 4 and _fp16_keeps(params)
    if half:
        tensors["weight_scale"] = half_scale_pairs(tensors["weight_scale"], tensors["weight_zero"])
        tensors["weight_zero"] = None
    return Interleaved(paired_rows=paired, half_scales=half), tensors


def _takes_fragments(params: dict) -> bool:
    weight = params["weight"]
    shape = (weight.shape[0], weight.shape[1] * 2)
    return (GEMV_MMA and int4_mma.available(weight.device)
            and int4_mma.takes(shape, params["weight_scale"].reshape(weight.shape[0], -1).shape[1])
            and (GEMV_MMA == "all" or _prefers_mma(shape, weight.device)))


def _prefers_mma(shape: tuple[int, int], device: torch.device) -> bool:
    """Whether an int4 (N, K) layer's decode products run faster on int4_mma than on the CUDA-core GEMV."""
    if shape in GEMV_MMA_MEASURED:
        return GEMV_MMA_MEASURED[shape]
    return int4_mma.few_row_blocks(shape[0], device)


FP16_ZERO_LIMIT = 64.0     # below it fp16 holds a zero point to 1/64 of a level (int4 rounding itself: ±1/2)


def _fp16_keeps(params: dict) -> bool:
    """Whether fp16 holds an int4 layer's group scales (all within fp16's normal range: 11 significant bits) and
    zero points (|zero| < FP16_ZERO_LIMIT); otherwise the layer keeps float32."""
    scale, zero = params["weight_scale"], params.get("weight_zero")
    if zero is None or scale.dim() < 2 or scale.shape[1] == 1:
        return False                       # symmetric or per channel: nothing worth halving
    fp16 = torch.finfo(torch.float16)
    return bool(((scale >= fp16.tiny) & (scale <= fp16.max)).all() and (zero.abs() < FP16_ZERO_LIMIT).all())


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
def _row_products(f, x_factor, x_ptr, cols, ok, norm_w, inv, p, x_sum, NORM_X: tl.constexpr):
    """One value of every word times x's matching columns into p (Σ v·x·2^-64); x summed for the zero point.
    cols is (1, W) like a row of the words, so that x arrives in their register layout, loaded once for all rows.
    NORM_X: x is the residual stream, RMS-normalized here as reference.rms_norm rounds it (1/rms `inv`)."""
    x = tl.load(x_ptr + cols, mask=ok, other=None if ok is None else 0.0)
    if NORM_X:
        x = norm_w * (x.to(tl.float32) * inv).to(x.dtype)
    x = x.to(tl.float32)
    return p + f * (x * x_factor), x_sum + x


@triton.jit
def _norm_weight(norm_w_ptr, cols, ok, NORM_X: tl.constexpr):
    """The RMSNorm weight of x's columns (NORM_X), loaded once for all rows."""
    weight = 1.0
    if NORM_X:
        weight = tl.load(norm_w_ptr + cols, mask=ok, other=None if ok is None else 0.0)
    return weight


@triton.jit
def _inv_rms(sumsq_ptr, parts, K, eps, PARTS_PAD: tl.constexpr, NORM_X: tl.constexpr):
    """1/rms of a row of K columns from the `parts` partial sums of squares its producer wrote (in a fixed order:
    the same result on every run)."""
    inv = 1.0
    if NORM_X:
        at = tl.arange(0, PARTS_PAD)
        inv = tl.rsqrt(tl.sum(tl.load(sumsq_ptr + at, mask=at < parts, other=0.0), axis=0) / K + eps)
    return inv


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
def _store_row(out_ptr, sumsq_ptr, acc, row, n, n_ok, row_scale, N, BLOCK_N: tl.constexpr, SILU: tl.constexpr,
               ADD_RESIDUAL: tl.constexpr):
    """Row `row` of the products with the program's weight rows n, in out's dtype. SILU (the rows alternate gate,
    up): SiLU(gate)·up of each pair into out's N/2 columns, rounded as the GEMV's output and silu_and_mul are.
    ADD_RESIDUAL: out holds the residual; the product is added to it in place (rounded as add_rms_norm's sum) and
    the sum of squares of the program's columns goes to the program's slot of sumsq_ptr's row."""
    y = (tl.sum(acc, axis=1) * row_scale).to(out_ptr.dtype.element_ty)
    if SILU:
        gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        c = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + row * (N // 2) + c, _silu_mul(gate, up), mask=c < N // 2)
    elif ADD_RESIDUAL:
        h = y + tl.load(out_ptr + row * N + n, mask=n_ok, other=0.0)
        tl.store(out_ptr + row * N + n, h, mask=n_ok)
        hf = tl.where(n_ok, h.to(tl.float32), 0.0)
        tl.store(sumsq_ptr + row * tl.num_programs(0) + tl.program_id(0), tl.sum(hf * hf, axis=0))
    else:
        tl.store(out_ptr + row * N + n, y, mask=n_ok)


_UNIT = tl.constexpr(2.0 ** 64)     # _unpack's products are v·x·2^-64


@triton.jit
def _block_products(words, b0, n, n_ok, x_ptr, scale_ptr, zero_ptr, norm_w_ptr, K, ROW_WORDS, GROUPS, num_blocks,
                    inv0, inv1, inv2, inv3, acc0, acc1, acc2, acc3,
                    BITS: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr, HALF_SCALES: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, EVEN: tl.constexpr,
                    NORM_X: tl.constexpr):
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
        norm_w = _norm_weight(norm_w_ptr, at, x_ok, NORM_X)
        p0, x0 = _row_products(f, x_factor, x_ptr, at, x_ok, norm_w, inv0, p0, x0, NORM_X)
        if ROWS > 1:
            p1, x1 = _row_products(f, x_factor, x_ptr + K, at, x_ok, norm_w, inv1, p1, x1, NORM_X)
        if ROWS > 2:
            p2, x2 = _row_products(f, x_factor, x_ptr + 2 * K, at, x_ok, norm_w, inv2, p2, x2, NORM_X)
        if ROWS > 3:
            p3, x3 = _row_products(f, x_factor, x_ptr + 3 * K, at, x_ok, norm_w, inv3, p3, x3, NORM_X)
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
def _store_rows(out_ptr, sumsq_ptr, scale_ptr, acc0, acc1, acc2, acc3, n, n_ok, N, BITS: tl.constexpr,
                ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SILU: tl.constexpr, ADD_RESIDUAL: tl.constexpr):
    """Every x row's products with the weight rows n (int8: times each row's scale)."""
    if BITS == 8:
        row_scale = _UNIT * tl.load(scale_ptr + n, mask=n_ok, other=0.0)
    else:
        row_scale = tl.full([BLOCK_N], 1.0, tl.float32)
    _store_row(out_ptr, sumsq_ptr, acc0, 0, n, n_ok, row_scale, N, BLOCK_N, SILU, ADD_RESIDUAL)
    if ROWS > 1:
        _store_row(out_ptr, sumsq_ptr, acc1, 1, n, n_ok, row_scale, N, BLOCK_N, SILU, ADD_RESIDUAL)
    if ROWS > 2:
        _store_row(out_ptr, sumsq_ptr, acc2, 2, n, n_ok, row_scale, N, BLOCK_N, SILU, ADD_RESIDUAL)
    if ROWS > 3:
        _store_row(out_ptr, sumsq_ptr, acc3, 3, n, n_ok, row_scale, N, BLOCK_N, SILU, ADD_RESIDUAL)


@triton.jit
def _weight_only_gemv_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, norm_w_ptr, sumsq_in_ptr, sumsq_out_ptr,
                             N, K, ROW_WORDS, GROUPS, PARTS, eps,
                             BITS: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr,
                             HALF_SCALES: tl.constexpr, ROWS: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, EVEN: tl.constexpr,
                             PREFETCH: tl.constexpr, SILU: tl.constexpr, NORM_X: tl.constexpr,
                             PARTS_PAD: tl.constexpr, ADD_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """out (ROWS ≤ 4, N) = x @ dequant(w)^T on interleaved words (w viewed as int32, ROW_WORDS per row). Each program
    streams BLOCK_N weight rows, BLOCKS 16-byte blocks of each at a time: with num_warps = BLOCKS / 32 every thread
    holds one block of all BLOCK_N rows, so x's columns arrive in the words' register layout and are loaded and
    converted once for all rows. Products are summed per block and scaled once per block. GROUP 0: one scale per
    row; HALF_SCALES: int4 scale and zero point as one fp16 pair per group (triton_weight_only.load_scale_zero);
    EVEN: N and the blocks divide evenly (no masks); PREFETCH: load the next blocks before this one's math; SILU:
    the weight rows alternate gate, up and out (ROWS, N/2) gets SiLU(gate)·up. NORM_X: x is the residual stream,
    RMS-normalized as it is loaded (weight norm_w_ptr, 1/rms from the (ROWS, PARTS) partial sums of squares at
    sumsq_in_ptr). ADD_RESIDUAL: out is the residual, the product is added to it and each program writes its sum
    of squares to sumsq_out_ptr (ROWS, programs). (Not both: the residual would be read while written.)"""
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
    _wait_for_inputs(PDL)
    inv0 = _inv_rms(sumsq_in_ptr, PARTS, K, eps, PARTS_PAD, NORM_X)
    inv1 = _inv_rms(sumsq_in_ptr + PARTS, PARTS, K, eps, PARTS_PAD, NORM_X and ROWS > 1)
    inv2 = _inv_rms(sumsq_in_ptr + 2 * PARTS, PARTS, K, eps, PARTS_PAD, NORM_X and ROWS > 2)
    inv3 = _inv_rms(sumsq_in_ptr + 3 * PARTS, PARTS, K, eps, PARTS_PAD, NORM_X and ROWS > 3)
    for b0 in range(0, num_blocks, BLOCKS):
        if PREFETCH:                                             # the next blocks' loads fly during this math
            following = _next_words(w_rows, 4 * b0, kw0, n_ok, ROW_WORDS, W, EVEN)
        acc0, acc1, acc2, acc3 = _block_products(
            words, b0, n, n_ok, x_ptr, scale_ptr, zero_ptr, norm_w_ptr, K, ROW_WORDS, GROUPS, num_blocks,
            inv0, inv1, inv2, inv3, acc0, acc1, acc2, acc3, BITS, HAS_ZERO, GROUP, HALF_SCALES, ROWS, BLOCK_N,
            BLOCKS, EVEN, NORM_X)
        if PREFETCH:
            words = following
        else:
            words = _next_words(w_rows, 4 * b0, kw0, n_ok, ROW_WORDS, W, EVEN)
    _store_rows(out_ptr, sumsq_out_ptr, scale_ptr, acc0, acc1, acc2, acc3, n, n_ok, N, BITS, ROWS, BLOCK_N,
                SILU, ADD_RESIDUAL)


GEMV_MAX_ROWS = 4
GEMV_SWEEP = [(8, 64, True), (8, 64, False), (16, 64, True), (4, 64, True), (8, 128, True), (4, 128, True),
              (8, 32, True), (16, 32, True)]
# (BLOCK_N, BLOCKS, PREFETCH) measured by the GPU suite


# (N, K, bits) → (BLOCK_N, BLOCKS, PREFETCH) fastest at one decode row on an H200 for the Llama-3.1-8B shapes
# (benchmarks/gpu_suite.py --phases quant_kernels, docs/quantization.md); other shapes use the rule below.
GEMV_MEASURED = {(6144, 4096, 4): (8, 64, True), (4096, 4096, 4): (4, 64, True), (28672, 4096, 4): (8, 64, True),
                 (4096, 14336, 4): (4, 64, True), (6144, 4096, 8): (4, 64, True), (4096, 4096, 8): (4, 128, True),
                 (28672, 4096, 8): (8, 128, True), (4096, 14336, 8): (4, 128, True)}


def gemv_config(n: int, k: int, rows: int, bits: int) -> tuple[int, int, bool]:
    """(BLOCK_N, BLOCKS, PREFETCH) of the decode GEMV; it runs BLOCKS / 32 warps. More rows of x take more registers
    per weight row (two rows and BLOCK_N 8 spill), hence BLOCK_N 4."""
    blocks = 64 if k // _block_columns(bits) >= 64 else 32
    if rows > 1:
        return 4, blocks, True
    return GEMV_MEASURED.get((n, k, bits), (8 if n >= 6144 else 4, blocks, True))


def weight_only_gemv(x: torch.Tensor | DeferredNorm, weight: torch.Tensor, scale: torch.Tensor,
                     zero: torch.Tensor | None, bits: int, config: tuple | None = None, silu: bool = False,
                     residual: torch.Tensor | None = None) -> torch.Tensor | ResidualSum:
    """x (at most GEMV_MAX_ROWS rows: decoding) @ dequant(w)^T for interleaved weights (interleave_weight),
    reading each weight byte once; config: (BLOCK_N, BLOCKS, PREFETCH), gemv_config's by default. x may be a
    DeferredNorm (normalized as it is loaded). silu: the rows alternate gate, up (pair_gate_up_rows) and the result
    is SiLU(gate)·up, (rows, N/2). residual: the product is added to it in place and returned as a ResidualSum with
    the sums of squares of its programs."""
    from .quant import int4_group_size

    normed = isinstance(x, DeferredNorm)
    if normed and residual is not None:
        raise ValueError("a GEMV cannot both normalize the residual stream and add to it")
    rows = (x.residual if normed else x).contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    scale2d = scale.reshape(n, -1)
    groups = scale2d.shape[1]
    block_n, blocks, prefetch = config or gemv_config(n, k, m, bits)
    programs = triton.cdiv(n, block_n)
    even = n % block_n == 0 and (k // _block_columns(bits)) % blocks == 0
    if residual is None:
        out = sumsq_out = torch.empty((m, n // 2 if silu else n), dtype=rows.dtype, device=rows.device)
    else:
        out, sumsq_out = residual, torch.empty((m, programs), dtype=torch.float32, device=rows.device)
    # a plain x: placeholders (and one partial, so that PARTS_PAD adds no specializations)
    norm_w, sumsq_in, parts, eps = (x.weight, x.sum_squares, x.sum_squares.shape[1], x.eps) if normed else \
        (rows, sumsq_out, 1, 0.0)
    half = has_half_scales(scale)
    _weight_only_gemv_kernel[(programs,)](
        rows, weight.view(torch.int32), scale2d, scale2d if zero is None else zero, out, norm_w, sumsq_in, sumsq_out,
        n, k, k * bits // 32, groups, parts, eps, BITS=bits, HAS_ZERO=zero is not None or half,
        GROUP=0 if groups == 1 else int4_group_size(k, groups), HALF_SCALES=half, ROWS=m, BLOCK_N=block_n,
        BLOCKS=blocks, EVEN=even, PREFETCH=prefetch, SILU=silu, NORM_X=normed, PARTS_PAD=triton.next_power_of_2(parts),
        ADD_RESIDUAL=residual is not None, num_warps=blocks // 32, **_launch())
    return out if residual is None else ResidualSum(residual, sumsq_out)


# --- FP8 activations -------------------------------------------------------------------------------------------
@triton.jit
def _quantize_fp8_kernel(x_ptr, smoother_ptr, static_ptr, q_ptr, scale_ptr, K,
                         HAS_SMOOTHER: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row: (x / smoother) / scale → e4m3, scale = the row's largest magnitude / 448 (or the static scale)."""
    _wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_SMOOTHER:
        x = tl.math.div_rn(x, tl.load(smoother_ptr + cols, mask=ok, other=1.0))
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        scale = _fp8_row_scale(x)
    _store_fp8_row(x, scale, ok, q_ptr + row * K + cols, scale_ptr, row)


def quantize_fp8_rows(x: torch.Tensor, smoother: torch.Tensor | None = None,
                      static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel for quant.quantize_activations_fp8(x / smoother, static_scale): e4m3 rows and their (M, 1)
    float32 scales (the static scale repeated per row)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    _quantize_fp8_kernel[(m,)](x.contiguous(), x if smoother is None else smoother,
                               x if static_scale is None else static_scale, q, scale, k,
                               HAS_SMOOTHER=smoother is not None, STATIC=static_scale is not None, BLOCK=block,
                               num_warps=min(16, max(4, block // 1024)), **_launch())
    return q, scale


def quant_linear(x: torch.Tensor, algo: str, params: dict, bias: torch.Tensor | None,
                 fp8_fast_accumulation: bool = True) -> torch.Tensor:
    """Quantized linear layers on the GPU: weight-only int8/int4 by the decode GEMV (≤ 4 rows) or
    triton_weight_only (more), FP8 activations quantized by one Triton kernel into torch._scaled_mm (fast
    accumulation as the build chose), torch._int_mm for W8A8 (the reference where a product's shape is below
    those kernels' minimums)."""
    from . import quant

    if not (_gemv_takes(x, algo, params) or _fragments(params)):
        x = _applied(x)
    if _weight_only(algo):
        out = _weight_only_product(x, algo, params)
        if _paired(params):                              # back to [gate | up]
            out = _unpaired(out, params)
    elif algo.startswith("FP8"):
        if isinstance(x, Fp8Rows):
            qx, sx, dtype = x.values, x.scale, x.dtype
        else:
            qx, sx = quantize_fp8_rows(x, params.get("smoother"), params.get("input_scale"))
            dtype = x.dtype
        out = torch._scaled_mm(qx, params["weight"].t(), scale_a=sx, scale_b=params["weight_scale"][None, :],
                               out_dtype=dtype, use_fast_accum=fp8_fast_accumulation)
    elif x.shape[0] > 16 and x.shape[1] % 8 == 0 and params["weight"].shape[0] % 8 == 0:
        qx, sx = quant.quantized_activations(x, algo, params)
        acc = torch._int_mm(qx, params["weight"].t())
        out = (acc.float() * sx * params["weight_scale"][None, :]).to(x.dtype)
    else:
        return quant.quant_linear(x, algo, params, bias)
    return out if bias is None else out + bias


def _unpaired(out: torch.Tensor, params: dict) -> torch.Tensor:
    """A product's columns in the order of a paired layer's stored rows → [gate | up]."""
    run = int4_mma.ROW_BLOCK if _fragments(params) else 1
    return out.reshape(out.shape[0], -1, 2, run).transpose(1, 2).reshape(out.shape)


def _weight_only_product(x: torch.Tensor, algo: str, params: dict) -> torch.Tensor:
    """x @ dequant(w)^T of a weight-only layer, its columns in the order of the stored rows: the decode GEMV on the
    interleaved layout, triton_weight_only for more rows or the engine layout."""
    from . import triton_weight_only

    if _fragments(params):
        return _fragment_product(x, params)
    if _gemv_takes(x, algo, params):
        return _layer_gemv(x, algo, params)
    return triton_weight_only.weight_only_matmul(x, params["weight"], params["weight_scale"],
                                                 params.get("weight_zero"), _bits(algo),
                                                 isinstance(params.get("layout"), Interleaved))


def _fragments(params: dict) -> bool:
    layout = params.get("layout")
    return isinstance(layout, Interleaved) and layout.fragments


FRAGMENT_SLICES = 2   # products of up to this many 16-row slices of x on int4_mma, more rows dequantized for cuBLAS:
                      # two slices beat dequantize + cuBLAS (H200, 8B o: 2 × 13.9 vs 22.6 + ~13 µs, down: 2 × 30.4
                      # vs 74.4 + ~32; eighth session's int4_mma phase); at four they no longer do on o


def _fragment_product(x: torch.Tensor, params: dict, silu: bool = False) -> torch.Tensor:
    """x @ dequant(w)^T of an int4 layer in int4_mma's layout: mma.sync for ≤ FRAGMENT_SLICES slices of 16 rows of
    bf16/fp16, otherwise the weight dequantized to x's dtype for cuBLAS. silu (paired blocks): SiLU(gate)·up, by
    int4_mma itself where it multiplies. x may be a DeferredNorm: int4_mma scales its products by 1/rms where the
    GEMV before made the weighted sum (MMA_NORMS), otherwise the norm is applied first."""
    weight, grid = params["weight"], params["weight_scale"]                   # int4_mma.pack_grid's
    if isinstance(x, DeferredNorm):
        if x.weighted is not None and x.shape[0] == 1:
            return int4_mma.gemv(x.weighted, weight, grid, _launch(), silu=silu, rms_of=(x.sum_squares, x.eps))
        x = _applied(x)
    rows = x.shape[0]
    if rows <= FRAGMENT_SLICES * int4_mma.MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16):
        if rows <= int4_mma.MAX_ROWS:
            return int4_mma.gemv(x, weight, grid, _launch(), silu=silu)
        return torch.cat([int4_mma.gemv(part, weight, grid, _launch(), silu=silu)
                          for part in x.split(int4_mma.MAX_ROWS)])
    out = x @ int4_mma.dequantize(weight, grid, x.dtype).t()
    return silu_and_mul(_unpaired(out, params)) if silu else out


def _layer_gemv(x, algo: str, params: dict, **options):
    """weight_only_gemv on a weight-only layer's parameters (options: silu, residual)."""
    return weight_only_gemv(x, params["weight"], params["weight_scale"], params.get("weight_zero"), _bits(algo),
                            **options)


def quant_linear_silu(x: torch.Tensor, algo: str, params: dict, bias: torch.Tensor | None,
                      fp8_fast_accumulation: bool = True) -> torch.Tensor:
    """SiLU(gate)·up of a quantized gate/up projection: on paired rows (Interleaved.paired_rows) by the decode GEMV
    itself (≤ 4 rows; int4_mma: ≤ 32) or by silu_and_mul reading the pairs; otherwise quant_linear, then
    silu_and_mul."""
    if not _paired(params):
        return silu_and_mul(quant_linear(x, algo, params, bias, fp8_fast_accumulation))
    if _fragments(params):
        return _fragment_product(x, params, silu=True)
    if _gemv_takes(x, algo, params):
        return _layer_gemv(x, algo, params, silu=True)
    return silu_and_mul(_weight_only_product(_applied(x), algo, params), paired=True)


def quant_linear_before_norm(x: torch.Tensor, algo: str, params: dict, bias: torch.Tensor | None,
                             residual: torch.Tensor, norm_weight: torch.Tensor | None = None,
                             fp8_fast_accumulation: bool = True) -> torch.Tensor | ResidualSum:
    """quant_linear of a layer whose output is added to `residual` and RMS-normalized next (one rank: no all-reduce
    between; norm_weight: that norm's, where it is deferred to the layer after): the add folded in, a ResidualSum
    comes back — from int4_mma (MMA_NORMS, one row, with the sum times norm_weight) or the CUDA-core decode GEMV
    (GEMV_NORMS); otherwise the product alone, for add_rms_norm."""
    plain = (bias is None and isinstance(x, torch.Tensor) and residual.dtype == x.dtype
             and residual.is_contiguous())
    if (MMA_NORMS and plain and norm_weight is not None and _fragments(params) and x.shape[0] == 1
            and x.dtype in (torch.bfloat16, torch.float16)):
        weighted, sums = int4_mma.gemv(x, params["weight"], params["weight_scale"], _launch(), residual=residual,
                                       norm_weight=norm_weight)
        return ResidualSum(residual, sums, weighted)
    if GEMV_NORMS and plain and _gemv_takes(x, algo, params) and not _paired(params):
        return _layer_gemv(x, algo, params, residual=residual)
    return quant_linear(x, algo, params, bias, fp8_fast_accumulation)


def _gemv_takes(x, algo: str, params: dict) -> bool:
    """Whether the decode GEMV computes this product: a weight-only layer in the interleaved layout, ≤ 4 rows."""
    layout = params.get("layout")
    return (_weight_only(algo) and isinstance(layout, Interleaved) and not layout.fragments
            and x.shape[0] <= GEMV_MAX_ROWS)


def _applied(x):
    """x with a DeferredNorm applied by the standalone RMSNorm kernel (for products that cannot fold it in)."""
    return rms_norm(x.residual, x.weight, x.eps) if isinstance(x, DeferredNorm) else x


# --- greedy sampling -------------------------------------------------------------------------------------------
ARGMAX_CHUNK = 4096


@triton.jit
def _argmax_chunks_kernel(x_ptr, value_ptr, index_ptr, V, stride, CHUNKS, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """The largest value of one chunk of one row and its first column."""
    _wait_for_inputs(PDL)
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
    _wait_for_inputs(PDL)
    row = tl.program_id(0)
    at = tl.arange(0, CHUNKS_PAD)
    values = tl.load(value_ptr + row * CHUNKS + at, mask=at < CHUNKS, other=float("-inf"))
    chunk = tl.min(tl.where(values == tl.max(values, axis=0), at, CHUNKS_PAD), axis=0)
    tl.store(out_ptr + row, tl.load(index_ptr + row * CHUNKS + chunk).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of rows over a vocabulary (greedy decoding) in two small kernels: torch's reduction gives
    one row to one block (~36 µs for 128k logits on an H200). Ties go to the first column and a NaN
    beats every number, as in torch's."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, vocab = x.shape
    chunks = triton.cdiv(vocab, ARGMAX_CHUNK)
    values = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    indices = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    out = torch.empty((rows,), dtype=torch.int64, device=x.device)
    _argmax_chunks_kernel[(rows, chunks)](x, values, indices, vocab, x.stride(0), chunks, CHUNK=ARGMAX_CHUNK,
                                          num_warps=4, **_launch())
    _argmax_rows_kernel[(rows,)](values, indices, out, chunks, CHUNKS_PAD=max(2, triton.next_power_of_2(chunks)),
                                 num_warps=1, **_launch())
    return out
