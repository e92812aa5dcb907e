"""Decode attention over an 8-bit KV cache (e4m3 or int8) on mma.sync, with every cached byte loaded straight into
the register where the tensor cores take it: no shared memory, no layout conversions.

Why: the Triton kernel (paged_attention._paged_attention_kernel) reads a quantized cache at 1.6-1.7 TB/s against
3.7 TB/s for bf16, because the converted tiles reach the tensor cores through shared memory (the attn_sweep phase of
gpu_suite: tuning.py). Here one warp is one (sequence, KV head, partition); it walks its keys 16 at a time.

Fragments of `mma.sync.m16n8k16` (lane l = 4g + t): A rows g, g + 8 at columns 2t, 2t + 1, 2t + 8, 2t + 9; B column
g at rows 2t, 2t + 1, 2t + 8, 2t + 9; C rows g, g + 8 at columns 2t, 2t + 1. The N side (8 columns) is the query
heads of the KV head (GROUP ≤ 8; the others are zero columns, never stored).

- Sᵀ = K·Qᵀ: 16 keys are A's rows, head dims the reduction in DIM/16 chunks. A chunk's dim order is the kernel's
  choice as long as K and Q agree: lane t's dims 2t, 2t + 1, 2t + 8, 2t + 9 of chunk c are the cached dims
  off(c, t) + 0..3, off = 64·(c // 4) + 16t + 4·(c % 4). So lane (g, t) loads 16 contiguous bytes of key g's row
  (and key 8 + g's) per 64 dims; each int32 word is half of its A fragment after two cvt instructions.
- Oᵀ = Vᵀ·Pᵀ: head dims are A's rows, keys the reduction; Pᵀ (B) is Sᵀ's accumulators packed to fp16 and transposed
  8×8 at a time (movmatrix). Row g of output tile mt is dim (DIM/8)·g + 2·mt, row g + 8 the dim after it, so lane
  (g, t) loads keys 2t, 2t + 1, 2t + 8, 2t + 9 at dims (DIM/8)·g … + DIM/8 - 1 (16 bytes for DIM 128) and pairs
  their bytes with prmt.
Lane (g, t) keeps heads 2t and 2t + 1 (softmax statistics and output), so the rescaling needs no shuffles. Scores
in base-2 exponent units, the online softmax and the split-K partials (for paged_attention._merge_kernel) follow the
Triton kernel; the KV scales are applied once, to the scores and to the output.
"""
from __future__ import annotations

import torch

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:                               # no Triton or no Gluon: the Triton kernel (or the reference) serves
    triton = gluon = gl = None

CHUNK = 16                                        # keys per step of the walk


def available(device: torch.device | str) -> bool:
    """Gluon is importable and the GPU runs mma.sync with e4m3 conversions (cvt.f16x2.e4m3x2: sm_89+)."""
    device = torch.device(device)
    return gluon is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def takes(kv_dtype: torch.dtype, head_dim: int, group: int, tokens_per_block: int) -> bool:
    """Whether this kernel covers a decode step: an e4m3 or int8 cache, 64- or 128-dim heads, ≤ 8 query heads per KV
    head, blocks of whole 16-key chunks."""
    return (kv_dtype in (torch.float8_e4m3fn, torch.int8) and head_dim in (64, 128) and 1 <= group <= 8
            and tokens_per_block % CHUNK == 0)


def _convert(src: str, lo: str, hi: str, int8: bool) -> str:
    """PTX: the four 8-bit values of word `src` → fp16 pairs lo (bytes 0, 1) and hi (bytes 2, 3), exactly."""
    if int8:        # each byte, sign flipped, is the low byte of the fp16 1024 + (q + 128); 1152 is subtracted
        return (f"xor.b32 u, {src}, 0x80808080; prmt.b32 {lo}, u, 0x64646464, 0x4140; "
                f"prmt.b32 {hi}, u, 0x64646464, 0x4342; sub.f16x2 {lo}, {lo}, bias; sub.f16x2 {hi}, {hi}, bias; ")
    return f"mov.b32 {{h0, h1}}, {src}; cvt.rn.f16x2.e4m3x2 {lo}, h0; cvt.rn.f16x2.e4m3x2 {hi}, h1; "


_REGS = ".reg .b32 u, bias, a0, a1, a2, a3, a4, a5, a6, a7, x0, x1, x2, x3; .reg .b16 h0, h1; "
_INIT = "mov.b32 bias, 0x64806480; "
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"


def _score_asm(int8: bool) -> str:
    """Four dim chunks r = 0..3: key words $4+r (row g), $8+r (row g + 8), head g's q pairs $12+r, $16+r → the
    scores $0..$3 (keys g, g + 8 × heads 2t, 2t + 1), one accumulator chain."""
    text = "{ " + _REGS + ".reg .f32 zf; mov.f32 zf, 0f00000000; " + _INIT
    for r in range(4):
        acc = "zf, zf, zf, zf" if r == 0 else "$0, $1, $2, $3"
        text += (_convert(f"${4 + r}", "a0", "a2", int8) + _convert(f"${8 + r}", "a1", "a3", int8)
                 + f"{_MMA} {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{${12 + r}, ${16 + r}}}, {{{acc}}}; ")
    return text + "}"


def _value_asm(int8: bool) -> str:
    """One word of each value row ($8..$11: keys 2t, 2t + 1, 8 + 2t, 9 + 2t; bytes = 4 dims), Pᵀ's B fragment
    ($12, $13) and the accumulators of output tiles 2w ($14..$17) and 2w + 1 ($18..$21) → $0..$7 updated."""
    return ("{ " + _REGS + _INIT
            + "prmt.b32 x0, $8, $9, 0x5140; prmt.b32 x1, $8, $9, 0x7362; "
            + "prmt.b32 x2, $10, $11, 0x5140; prmt.b32 x3, $10, $11, 0x7362; "
            + _convert("x0", "a0", "a1", int8) + _convert("x2", "a2", "a3", int8)
            + _convert("x1", "a4", "a5", int8) + _convert("x3", "a6", "a7", int8)
            + f"{_MMA} {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{$12, $13}}, {{$14, $15, $16, $17}}; "
            + f"{_MMA} {{$4, $5, $6, $7}}, {{a4, a5, a6, a7}}, {{$12, $13}}, {{$18, $19, $20, $21}}; }}")


_PACK_ASM = "cvt.rn.f16x2.f32 $0, $2, $1;"        # two float32 → fp16 pair ($1 low)
_PACK_T_ASM = "{ .reg .b32 p; cvt.rn.f16x2.f32 p, $2, $1; movmatrix.sync.aligned.m8n8.trans.b16 $0, p; }"
_XOR_ASM = "shfl.sync.bfly.b32 $0, $1, {}, 0x1f, 0xffffffff;"


if gluon is not None:
    _SCORE_E4M3 = gl.constexpr(_score_asm(False))
    _SCORE_INT8 = gl.constexpr(_score_asm(True))
    _VALUE_E4M3 = gl.constexpr(_value_asm(False))
    _VALUE_INT8 = gl.constexpr(_value_asm(True))
    _PACK = gl.constexpr(_PACK_ASM)
    _PACK_T = gl.constexpr(_PACK_T_ASM)
    _XOR4 = gl.constexpr(_XOR_ASM.format(4))
    _XOR8 = gl.constexpr(_XOR_ASM.format(8))
    _XOR16 = gl.constexpr(_XOR_ASM.format(16))

    @gluon.jit
    def _pack(lo, hi):
        return gl.inline_asm_elementwise(_PACK, "=r,f,f", [lo, hi], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _pack_transposed(lo, hi):
        """fp16 pairs (lo, hi) of an 8×8 matrix's C fragment → the transpose's (movmatrix, warp-wide)."""
        return gl.inline_asm_elementwise(_PACK_T, "=r,f,f", [lo, hi], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _xor(x, asm: gl.constexpr):
        return gl.inline_asm_elementwise(asm, "=f,f", [x], dtype=gl.float32, is_pure=False, pack=1)

    @gluon.jit
    def _over_keys_max(x):
        """Max over the 8 lanes (g) holding a head's keys."""
        x = gl.maximum(x, _xor(x, _XOR4))
        x = gl.maximum(x, _xor(x, _XOR8))
        return gl.maximum(x, _xor(x, _XOR16))

    @gluon.jit
    def _over_keys_sum(x):
        x = x + _xor(x, _XOR4)
        x = x + _xor(x, _XOR8)
        return x + _xor(x, _XOR16)

    @gluon.jit
    def _quarters(x):
        """(32, NC) → its columns 4i + r for r = 0..3, each (32, NC/4) (register moves only)."""
        x = gl.reshape(x, [32, x.shape[1] // 4, 2, 2])                    # (…, a, b): r = 2a + b
        b0, b1 = gl.split(x)
        r0, r2 = gl.split(b0)
        r1, r3 = gl.split(b1)
        return r0, r1, r2, r3

    @gluon.jit
    def _scores(ka, kb, qa, qb, SC: gl.constexpr, INT8: gl.constexpr):
        """The chunk's scores: keys g, g + 8 (rows ka, kb) × heads 2t, 2t + 1, over all dim chunks."""
        if INT8:
            asm: gl.constexpr = _SCORE_INT8
        else:
            asm: gl.constexpr = _SCORE_E4M3
        a0, a1, a2, a3 = _quarters(ka)
        b0, b1, b2, b3 = _quarters(kb)
        s0, s1, s2, s3 = gl.inline_asm_elementwise(asm, "=f,=f,=f,=f" + ",r" * 16,
                                                   [a0, a1, a2, a3, b0, b1, b2, b3, qa[0], qa[1], qa[2], qa[3],
                                                    qb[0], qb[1], qb[2], qb[3]],
                                                   dtype=(gl.float32,) * 4, is_pure=True, pack=1)
        return (gl.convert_layout(gl.sum(s0, axis=1), SC, assert_trivial=True),
                gl.convert_layout(gl.sum(s1, axis=1), SC, assert_trivial=True),
                gl.convert_layout(gl.sum(s2, axis=1), SC, assert_trivial=True),
                gl.convert_layout(gl.sum(s3, axis=1), SC, assert_trivial=True))

    @gluon.jit
    def _rows(cache_words, base, k0, r, last, off, kv_row, BLOCK_TOKENS: gl.constexpr, ROW_WORDS: gl.constexpr):
        """Words `off` of keys k0 + r (a tensor of rows per lane; base: their block's first slot) of this KV head,
        keys past `last` read as `last`: their scores are masked, so no load needs a mask."""
        slot = base + gl.minimum(k0 + r, last) % BLOCK_TOKENS
        return gl.load(cache_words + (slot * ROW_WORDS + kv_row) + off)

    @gluon.jit
    def _load_chunk(cache_words, table, k0, last, kv_row, k_off, v_off, gk, tv, BLOCK_TOKENS: gl.constexpr,
                    ROW_WORDS: gl.constexpr):
        """Keys k0 … k0 + 15 (one cache block: k0 is a multiple of 16, so is BLOCK_TOKENS): key rows g and 8 + g at
        this lane's dims (k_off), value rows 2t, 2t + 1, 8 + 2t, 9 + 2t at dims (DIM/8)·g… (v_off: past the keys'
        half). Past the sequence (the prefetch after the last chunk) the last key is read again."""
        base = gl.load(table + gl.minimum(k0, last) // BLOCK_TOKENS).to(gl.int64) * BLOCK_TOKENS
        ka = _rows(cache_words, base, k0, gk, last, k_off, kv_row, BLOCK_TOKENS, ROW_WORDS)
        kb = _rows(cache_words, base, k0, gk + 8, last, k_off, kv_row, BLOCK_TOKENS, ROW_WORDS)
        v0 = _rows(cache_words, base, k0, 2 * tv, last, v_off, kv_row, BLOCK_TOKENS, ROW_WORDS)
        v1 = _rows(cache_words, base, k0, 2 * tv + 1, last, v_off, kv_row, BLOCK_TOKENS, ROW_WORDS)
        v2 = _rows(cache_words, base, k0, 2 * tv + 8, last, v_off, kv_row, BLOCK_TOKENS, ROW_WORDS)
        v3 = _rows(cache_words, base, k0, 2 * tv + 9, last, v_off, kv_row, BLOCK_TOKENS, ROW_WORDS)
        return ka, kb, v0, v1, v2, v3

    @gluon.jit
    def _masked(s, key, stop, lowest, window):
        return gl.where((key < stop) & ((key >= lowest) | (window <= 0)), s, float("-inf"))

    @gluon.jit
    def _store_head(at, o_e0, o_e1, o_f0, o_f1, factor, ok, LO: gl.constexpr):
        """One head's DIM/8 dims of this lane (at: their addresses), times factor: output tiles 2w (o_e0: row g,
        o_e1: row g + 8) and 2w + 1 (o_f0, o_f1) hold dims 4w + 0..3."""
        vals = gl.reshape(gl.join(gl.join(o_e0, o_f0), gl.join(o_e1, o_f1)), [32, 4 * o_e0.shape[1]])
        f = gl.expand_dims(gl.convert_layout(factor, gl.SliceLayout(1, LO), assert_trivial=True), 1)
        gl.store(at, (gl.convert_layout(vals, LO) * f).to(at.dtype.element_ty), mask=ok)

    @gluon.jit
    def _query(q_ptr, head0, LC: gl.constexpr, GROUP: gl.constexpr, DIM: gl.constexpr):
        """This lane's key offsets (words of dims off(c, t) … + 3), its key rows g, and head g's B fragments of
        the scores (dims 2t, 2t + 1 and 2t + 8, 2t + 9 of every chunk: quarters of (32, DIM/16) fp16 pairs)."""
        NC: gl.constexpr = DIM // 16
        lane = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(1, LC)), 1)     # (32, 1)
        c = gl.expand_dims(gl.arange(0, NC, layout=gl.SliceLayout(0, LC)), 0)
        gk = lane // 4
        k_off = (c // 4) * 16 + 4 * (lane % 4) + c % 4
        at = q_ptr + (head0 + gk) * DIM + 4 * k_off
        ok = (gk < GROUP) & (c >= 0)
        qa = _quarters(_pack(gl.load(at, mask=ok, other=0.0).to(gl.float32),
                             gl.load(at + 1, mask=ok, other=0.0).to(gl.float32)))
        qb = _quarters(_pack(gl.load(at + 2, mask=ok, other=0.0).to(gl.float32),
                             gl.load(at + 3, mask=ok, other=0.0).to(gl.float32)))
        return k_off, gk, qa, qb

    @gluon.jit
    def _softmax_step(s0, s1, s2, s3, m_a, m_b, l_a, l_b):
        """Online softmax over one chunk's scores (keys g, g + 8 × heads 2t = a, 2t + 1 = b): the probabilities,
        the factors that rescale what came before, and the updated maxima and sums (this lane's keys only)."""
        new_a = gl.maximum(m_a, _over_keys_max(gl.maximum(s0, s2)))
        new_b = gl.maximum(m_b, _over_keys_max(gl.maximum(s1, s3)))
        safe_a = gl.where(new_a == float("-inf"), 0.0, new_a)
        safe_b = gl.where(new_b == float("-inf"), 0.0, new_b)
        alpha_a = gl.exp2(m_a - safe_a)
        alpha_b = gl.exp2(m_b - safe_b)
        p0 = gl.exp2(s0 - safe_a)
        p1 = gl.exp2(s1 - safe_b)
        p2 = gl.exp2(s2 - safe_a)
        p3 = gl.exp2(s3 - safe_b)
        return p0, p1, p2, p3, alpha_a, alpha_b, new_a, new_b, l_a * alpha_a + p0 + p2, l_b * alpha_b + p1 + p3

    @gluon.jit
    def _accumulate(v0, v1, v2, v3, p0, p1, p2, p3, alpha_a, alpha_b, o0, o1, o2, o3, o4, o5, o6, o7,
                    SW: gl.constexpr, INT8: gl.constexpr):
        """Oᵀ = alpha·Oᵀ + Vᵀ·Pᵀ for one chunk: P transposed into B fragments, each value word pair one mma per
        output tile (o0..o3: tile 2w, o4..o7: tile 2w + 1; even: head 2t, odd: head 2t + 1)."""
        if INT8:
            asm: gl.constexpr = _VALUE_INT8
        else:
            asm: gl.constexpr = _VALUE_E4M3
        pt01 = gl.expand_dims(gl.convert_layout(_pack_transposed(p0, p1), SW, assert_trivial=True), 1)
        pt23 = gl.expand_dims(gl.convert_layout(_pack_transposed(p2, p3), SW, assert_trivial=True), 1)
        fa = gl.expand_dims(gl.convert_layout(alpha_a, SW, assert_trivial=True), 1)
        fb = gl.expand_dims(gl.convert_layout(alpha_b, SW, assert_trivial=True), 1)
        return gl.inline_asm_elementwise(
            asm, "=f,=f,=f,=f,=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f,f,f,f,f",
            [v0, v1, v2, v3, pt01, pt23, o0 * fa, o1 * fb, o2 * fa, o3 * fb, o4 * fa, o5 * fb, o6 * fa, o7 * fb],
            dtype=(gl.float32,) * 8, is_pure=True, pack=1)

    @gluon.jit
    def _finish(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, head0, part, m_a, m_b, l_a, l_b, v_scale,
                o0, o1, o2, o3, o4, o5, o6, o7, SC: gl.constexpr, LO: gl.constexpr, GROUP: gl.constexpr,
                DIM: gl.constexpr, NUM_PARTS: gl.constexpr):
        """The normalized output of this lane's heads (2t, 2t + 1) at its DIM/8 dims, or the partition's (m, l,
        unnormalized acc) for _merge_kernel."""
        LOG2E: gl.constexpr = 1.4426950408889634
        l_a = _over_keys_sum(l_a)
        l_b = _over_keys_sum(l_b)
        lane = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(1, LO)), 1)
        d = gl.expand_dims(gl.arange(0, DIM // 8, layout=gl.SliceLayout(0, LO)), 0)
        head_a = 2 * (lane % 4)                                            # this lane's heads: head_a, head_a + 1
        dims = (lane // 4) * (DIM // 8) + d
        ok_a = (head_a < GROUP) & (d >= 0)
        ok_b = (head_a + 1 < GROUP) & (d >= 0)
        if NUM_PARTS == 1:
            at = out_ptr + (head0 + head_a) * DIM + dims
            _store_head(at, o0, o2, o4, o6, v_scale / gl.where(l_a == 0.0, 1.0, l_a), ok_a, LO)
            _store_head(at + DIM, o1, o3, o5, o7, v_scale / gl.where(l_b == 0.0, 1.0, l_b), ok_b, LO)
        else:
            lane_c = gl.arange(0, 32, layout=SC)
            g = lane_c // 4
            t = lane_c % 4
            idx = (head0 + 2 * t) * NUM_PARTS + part                       # stored by the lanes of g = 0
            gl.store(part_m_ptr + idx, m_a / LOG2E, mask=(2 * t < GROUP) & (g == 0))
            gl.store(part_l_ptr + idx, l_a, mask=(2 * t < GROUP) & (g == 0))
            gl.store(part_m_ptr + idx + NUM_PARTS, m_b / LOG2E, mask=(2 * t + 1 < GROUP) & (g == 0))
            gl.store(part_l_ptr + idx + NUM_PARTS, l_b, mask=(2 * t + 1 < GROUP) & (g == 0))
            at = part_acc_ptr + ((head0 + head_a) * NUM_PARTS + part) * DIM + dims
            v = gl.full([32], 1.0, gl.float32, SC) * v_scale
            _store_head(at, o0, o2, o4, o6, v, ok_a, LO)
            _store_head(at + NUM_PARTS * DIM, o1, o3, o5, o7, v, ok_b, LO)

    @gluon.jit
    def _mma_decode_kernel(q_ptr, cache_ptr, cache_half, block_tables_ptr, bt_stride, seq_lens_ptr, q_start_ptr,
                           out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, scale, window, kv_scale_ptr,
                           KV_HEADS: gl.constexpr, GROUP: gl.constexpr, DIM: gl.constexpr,
                           BLOCK_TOKENS: gl.constexpr, PART_TOKENS: gl.constexpr, NUM_PARTS: gl.constexpr,
                           INT8: gl.constexpr, PDL: gl.constexpr):
        """One warp: the query token of one sequence × the GROUP heads of one KV head, over the keys of one
        partition, 16 at a time (the next chunk's loads in flight while one is multiplied)."""
        W: gl.constexpr = DIM // 32                                       # words of a value row per lane
        LC: gl.constexpr = gl.BlockedLayout([1, DIM // 16], [32, 1], [1, 1], [1, 0])
        LW: gl.constexpr = gl.BlockedLayout([1, W], [32, 1], [1, 1], [1, 0])
        LO: gl.constexpr = gl.BlockedLayout([1, 4 * W], [32, 1], [1, 1], [1, 0])
        SC: gl.constexpr = gl.SliceLayout(1, LC)
        SW: gl.constexpr = gl.SliceLayout(1, LW)
        ROW_WORDS: gl.constexpr = KV_HEADS * DIM // 4
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        seq = gl.program_id(0)
        kv_head = gl.program_id(1)
        part = gl.program_id(2)
        seq_len = gl.load(seq_lens_ptr + seq).to(gl.int32)
        q_start = gl.load(q_start_ptr + seq).to(gl.int32)
        if gl.load(q_start_ptr + seq + 1).to(gl.int32) == q_start:        # a padded row: no query token
            return
        first = part * PART_TOKENS
        stop = gl.minimum(first + PART_TOKENS, seq_len)
        lowest = seq_len - window                                          # window: keys from here on
        if window > 0:
            first = gl.maximum(first, (gl.maximum(lowest, 0) // 16) * 16)
        head0 = q_start.to(gl.int64) * (KV_HEADS * GROUP) + kv_head * GROUP   # this KV head's first query row
        k_off, gk, qa, qb = _query(q_ptr, head0, LC, GROUP, DIM)

        lane_w = gl.expand_dims(gl.arange(0, 32, layout=SW), 1)            # (32, 1) in LW
        tv = lane_w % 4
        v_off = cache_half // 4 + (lane_w // 4) * W + gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(0, LW)), 0)
        cache_words = cache_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        table = block_tables_ptr + seq.to(gl.int64) * bt_stride
        kv_row = kv_head * (DIM // 4)
        g = gl.arange(0, 32, layout=SC) // 4
        scale2 = scale * gl.load(kv_scale_ptr) * 1.4426950408889634        # scores in base-2 exponent units
        m_a = gl.full([32], float("-inf"), gl.float32, SC)                 # head 2t
        m_b = gl.full([32], float("-inf"), gl.float32, SC)                 # head 2t + 1
        l_a = gl.zeros([32], gl.float32, SC)
        l_b = gl.zeros([32], gl.float32, SC)
        zero = gl.zeros([32, W], gl.float32, LW)
        o0, o1, o2, o3, o4, o5, o6, o7 = zero, zero, zero, zero, zero, zero, zero, zero
        last = gl.maximum(stop - 1, 0)                                     # a real sequence has key 0
        ka, kb, v0, v1, v2, v3 = _load_chunk(cache_words, table, first, last, kv_row, k_off, v_off, gk, tv,
                                             BLOCK_TOKENS, ROW_WORDS)
        for k0 in range(first, stop, 16):
            na, nb, n0, n1, n2, n3 = _load_chunk(cache_words, table, k0 + 16, last, kv_row, k_off, v_off, gk, tv,
                                                 BLOCK_TOKENS, ROW_WORDS)
            s0, s1, s2, s3 = _scores(ka, kb, qa, qb, SC, INT8)             # keys g, g + 8 × heads 2t, 2t + 1
            s0 = _masked(s0 * scale2, k0 + g, stop, lowest, window)
            s1 = _masked(s1 * scale2, k0 + g, stop, lowest, window)
            s2 = _masked(s2 * scale2, k0 + g + 8, stop, lowest, window)
            s3 = _masked(s3 * scale2, k0 + g + 8, stop, lowest, window)
            p0, p1, p2, p3, alpha_a, alpha_b, m_a, m_b, l_a, l_b = _softmax_step(s0, s1, s2, s3, m_a, m_b, l_a, l_b)
            o0, o1, o2, o3, o4, o5, o6, o7 = _accumulate(v0, v1, v2, v3, p0, p1, p2, p3, alpha_a, alpha_b,
                                                         o0, o1, o2, o3, o4, o5, o6, o7, SW, INT8)
            ka, kb, v0, v1, v2, v3 = na, nb, n0, n1, n2, n3
        _finish(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, head0, part, m_a, m_b, l_a, l_b,
                gl.load(kv_scale_ptr + 1), o0, o1, o2, o3, o4, o5, o6, o7, SC, LO, GROUP, DIM, NUM_PARTS)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, scale: float, sliding_window: int | None, kv_scale: torch.Tensor,
                     out: torch.Tensor, partials: tuple | None, num_parts: int, part_tokens: int, launch: dict):
    """One query token per sequence (q (T, H, D)) over an 8-bit paged cache (takes()) → out; with num_parts > 1
    the (m, l, acc) partials of paged_attention._merge_kernel instead (part_tokens a multiple of 16)."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, tokens_per_block = kv_cache.shape[-2], kv_cache.shape[2]
    part_m, part_l, part_acc = partials if partials is not None else (out, out, out)
    _mma_decode_kernel[(seq_lens.shape[0], kv_heads, num_parts)](
        q, kv_cache, kv_cache[0].numel(), block_tables, block_tables.stride(0), seq_lens, query_start_loc, out,
        part_m, part_l, part_acc, scale, sliding_window or 0, kv_scale, KV_HEADS=kv_heads, GROUP=heads // kv_heads,
        DIM=dim, BLOCK_TOKENS=tokens_per_block, PART_TOKENS=part_tokens, NUM_PARTS=num_parts,
        INT8=kv_cache.dtype == torch.int8, num_warps=1, **launch)
    return out
