"""int4 layers on the tensor cores: the decode product of ≤ 16 rows of x on mma.sync, on the fragment layout of
int4_fragments (reference: quant.quant_linear). Chosen for the layers where it beats the CUDA-core GEMV
(tuning.INT4_MMA_SHAPES); it writes SiLU(gate)·up itself on gate/up blocks paired at load, and at one row folds the
RMSNorm between two products in (kiln.kernels.fusion).

Why: the CUDA-core decode GEMV (gemv._weight_only_gemv_kernel) spends 3.2 instructions per int4 value in sm_90
SASS (824 a loop iteration of 256 values, ~375 on the half-rate integer pipe), and that, not DRAM, bounds it at
1.9–2.8 TB/s. Here one int32 word is exactly one lane's share of a 16×16 A operand of `mma.sync.m16n8k16`: four
`lop3`s (three shifts) OR the levels into the mantissa of a power of two M, giving M + q exactly, and one mma
multiplies the four pairs by x. bf16 (M = 128) multiplies M + q as it is and takes (M + z)·Σ x off per group;
fp16 (M = 1024, whose offset would cost too many of the accumulator's bits) first subtracts M + 8 with four packed
FMAs (signed levels). Weights, x and each chunk's scales and zero points come in 16-byte loads. Each group's
scale and zero point are applied to a chunk's float32 sums (fresh mma accumulators per chunk):
Σ x·(q - z)·s = s·(Σ x·a - (z - a₀)·Σ x) for the A operand's a = q - a₀ (a₀ = -M in bf16, 8 in fp16), Σ x coming
from mma on a ones matrix.

What bounds it at one row is instruction issue, not DRAM: on the H200 the 8B gate_up's words alone stream in 15.6 µs
through TMA into shared memory, the products alone (no weight loads) took 18.2 µs, and both 22.8 — so staging the
words in shared memory (TMA or cp.async), however deep, changes nothing, and every instruction saved a chunk counts.
Per chunk of a row block (sm_90 SASS, bf16, one row) the kernel spends 121 instructions with one row block a
program and 104 with two (gate_up): Σ x of a chunk is one mma instead of eight (_ROW_SUM; eight chained on the same
C registers, no zeroing, for more rows), shared by the RB row blocks of a program together with x's B fragments;
no products for x row 1 at one row; EVEN shapes without masks (masked loads zero their registers first). A warp
takes its chunks in steps of 1–8 (`config`, per shape: tuning.INT4_MMA_LAYOUTS) with the next step's words and
scales in flight, the first step's loaded before the PDL wait: o_proj's warps hold all their chunks before
attention ends.

B is x: lane (g, t) supplies column g (x row g; lanes past x's rows load nothing: their columns are never stored),
so column n of the result is x row n; lane (g, t) receives columns 2t and 2t + 1. The kernel is written in Gluon
(Triton's explicit-layout language), so that which lane holds which word is stated, not inferred.
"""
from __future__ import annotations

import torch

from . import tuning
from .int4_fragments import CHUNK, ROW_BLOCK

try:
    import triton
except ImportError:                               # a CPU-only install: nothing of this module runs
    triton = None
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:                               # Triton < 3.4: no Gluon; the CUDA-core GEMV serves
    gluon = gl = None

MAX_ROWS = 16                                     # x rows: 8 per mma (one mma, or two per plane)


def available(device: torch.device | str) -> bool:
    """Gluon is importable and the GPU runs bf16 mma.sync (sm_80+)."""
    device = torch.device(device)
    return (gluon is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8)


if gluon is not None:
    # PTX of the products. _PLANE: one lane's word → four pairs of levels OR-ed into the mantissa of M (M + q, exact;
    # fp16 then subtracts M + 8: signed levels), D += A·B. _SUMS: E += ones·B, the sums of x's columns over the
    # plane (its C chained through all four registers: no zeroing). _ROW_SUM: Σ of one x row's 128 values of a
    # chunk in one mma — A holds them as 8 rows × 16 (x[16g + k]; rows 8-15 zero), B is ones, so lane (g, t) gets
    # row g's sum, added over the 8 rows by three butterfly shuffles.
    def _kind(fp16: bool) -> tuple[str, str, str]:
        kind, magic, one = ("f16", "0x64006400", "0x3C003C00") if fp16 else ("bf16", "0x43004300", "0x3F803F80")
        return kind, magic, one

    def _mma(fp16: bool) -> str:
        kind = _kind(fp16)[0]
        return f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"

    def _plane_asm(fp16: bool) -> str:
        kind, magic, one = _kind(fp16)
        signed = f"fma.rn.{kind}x2 a{{i}}, a{{i}}, one, minus;" if fp16 else ""
        level = " ".join(f"lop3.b32 a{i}, s{i}, 0x000F000F, {magic}, 0xEA; " + signed.format(i=i) for i in range(4))
        constants = f".reg .b32 one, minus; mov.b32 one, {one}; mov.b32 minus, 0xE408E408; " if fp16 else ""
        return ("{ .reg .b32 a0, a1, a2, a3, s0, s1, s2, s3; " + constants +
                "mov.b32 s0, $4; shr.u32 s1, $4, 4; shr.u32 s2, $4, 8; shr.u32 s3, $4, 12; "
                f"{level} {_mma(fp16)} {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{$5, $6}}, {{$7, $8, $9, $10}}; }}")

    def _sums_asm(fp16: bool) -> str:
        return (f"{{ .reg .b32 one; mov.b32 one, {_kind(fp16)[2]}; "
                f"{_mma(fp16)} {{$0, $1, $2, $3}}, {{one, one, one, one}}, {{$4, $5}}, {{$6, $7, $8, $9}}; }}")

    def _row_sum_asm(fp16: bool) -> str:
        shuffles = " ".join(f"shfl.sync.bfly.b32 t, $0, {lane}, 0x1f, -1; add.f32 $0, $0, t;" for lane in (4, 8, 16))
        return ("{ .reg .b32 one, zr; .reg .f32 d1, d2, d3, z, t; "
                f"mov.b32 one, {_kind(fp16)[2]}; mov.b32 zr, 0; mov.f32 z, 0f00000000; "
                f"{_mma(fp16)} {{$0, d1, d2, d3}}, {{$1, zr, $2, zr}}, {{one, one}}, {{z, z, z, z}}; {shuffles} }}")

    _BF16_PLANE, _FP16_PLANE = gl.constexpr(_plane_asm(False)), gl.constexpr(_plane_asm(True))
    _BF16_SUMS, _FP16_SUMS = gl.constexpr(_sums_asm(False)), gl.constexpr(_sums_asm(True))
    _BF16_ROW_SUM, _FP16_ROW_SUM = gl.constexpr(_row_sum_asm(False)), gl.constexpr(_row_sum_asm(True))

    @gluon.jit
    def _plane(word, xa, xb, d0, d1, d2, d3, FP16: gl.constexpr):
        if FP16:
            asm: gl.constexpr = _FP16_PLANE
        else:
            asm: gl.constexpr = _BF16_PLANE
        return gl.inline_asm_elementwise(asm, "=f,=f,=f,=f,r,r,r,f,f,f,f", [word, xa, xb, d0, d1, d2, d3],
                                         dtype=(gl.float32,) * 4, is_pure=True, pack=1)

    @gluon.jit
    def _plane_sums(xa, xb, e0, e1, e2, e3, FP16: gl.constexpr):
        if FP16:
            asm: gl.constexpr = _FP16_SUMS
        else:
            asm: gl.constexpr = _BF16_SUMS
        return gl.inline_asm_elementwise(asm, "=f,=f,=f,=f,r,r,f,f,f,f", [xa, xb, e0, e1, e2, e3],
                                         dtype=(gl.float32,) * 4, is_pure=True, pack=1)

    @gluon.jit
    def _row_sum(xe, L: gl.constexpr, FP16: gl.constexpr):
        """Σ of x row 0's chunk from (NW, 32, 2) words (lane (g, t): words 8g + t and 8g + t + 4), in every lane."""
        if FP16:
            asm: gl.constexpr = _FP16_ROW_SUM
        else:
            asm: gl.constexpr = _BF16_ROW_SUM
        lo, hi = gl.split(xe)
        total = gl.inline_asm_elementwise(asm, "=f,r,r", [lo, hi], dtype=gl.float32, is_pure=True, pack=1)
        return gl.convert_layout(total, L, assert_trivial=True)

    @triton.constexpr_function
    def _in_eighths(shape):
        return [*shape[:-1], 2, 2, 2]

    @gluon.jit
    def _eighths(w, L: gl.constexpr):
        """(..., 8) → its entries j = 0..7 along the last dimension, each (...) in L (register moves only)."""
        w = gl.reshape(w, _in_eighths(w.shape))                          # j = 4a + 2b + c
        c0, c1 = gl.split(w)
        b00, b01 = gl.split(c0)
        b10, b11 = gl.split(c1)
        j0, j4 = gl.split(b00)
        j2, j6 = gl.split(b01)
        j1, j5 = gl.split(b10)
        j3, j7 = gl.split(b11)
        return (gl.convert_layout(j0, L, assert_trivial=True), gl.convert_layout(j1, L, assert_trivial=True),
                gl.convert_layout(j2, L, assert_trivial=True), gl.convert_layout(j3, L, assert_trivial=True),
                gl.convert_layout(j4, L, assert_trivial=True), gl.convert_layout(j5, L, assert_trivial=True),
                gl.convert_layout(j6, L, assert_trivial=True), gl.convert_layout(j7, L, assert_trivial=True))

    @gluon.jit
    def _index3(NW: gl.constexpr, C: gl.constexpr, LAY: gl.constexpr):
        """Warp (NW, 1, 1), lane (1, 32, 1) and entry (1, 1, C) indices of an (NW, 32, C) tensor in LAY."""
        warp = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, LAY)))
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LAY)))
        entry = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, LAY)))
        return (gl.expand_dims(gl.expand_dims(warp, 1), 2), gl.expand_dims(gl.expand_dims(lane, 0), 2),
                gl.expand_dims(gl.expand_dims(entry, 0), 1))

    @triton.constexpr_function
    def _lanes(warps, entries):
        """The layout of (warps, 32, entries): warp w's lanes hold its row, each lane `entries` entries."""
        return gl.BlockedLayout([1, 1, entries], [1, 32, 1], [warps, 1, 1], [2, 1, 0])

    @gluon.jit
    def _wide(t, L3: gl.constexpr):
        """(NW, 32) → (NW, 32, 1) in L3's slice: the same value for each of a program's row blocks."""
        return gl.expand_dims(gl.convert_layout(t, gl.SliceLayout(2, L3)), 2)

    @gluon.jit
    def _x_fragments(xs, L: gl.constexpr):
        """A lane's x words of a chunk (NW, 32, 16) → the B fragments of the 8 planes: plane i takes words 2i
        (xa[i]) and 2i + 1 (xb[i]), each (NW, 32) in L."""
        xa, xb = gl.split(gl.reshape(xs, [xs.shape[0], 32, 8, 2]))
        return _eighths(xa, L), _eighths(xb, L)

    @gluon.jit
    def _x_sums(xa, xb, L: gl.constexpr, FP16: gl.constexpr):
        """Σ of the chunk's columns of x for lane (g, t)'s B columns 2t, 2t + 1, from the planes' B fragments."""
        e0 = gl.zeros(xa[0].shape, gl.float32, L)
        e1, e2, e3 = e0, e0, e0
        for i in gl.static_range(8):
            e0, e1, e2, e3 = _plane_sums(xa[i], xb[i], e0, e1, e2, e3, FP16)
        return e0, e1

    @gluon.jit
    def _chunk(planes, xa, xb, e0, e1, s0, s1, c0, c1, a00, a01, a10, a11, L3: gl.constexpr, FP16: gl.constexpr,
               ONE_ROW: gl.constexpr):
        """One chunk of the program's RB row blocks (8 planes, each (NW, 32, RB)) times 8 x rows (their B fragments
        xa, xb) into
        the accumulators, each chunk's float32 sums from fresh mma accumulators (a long chain of tensor-core adds
        would lose bits) with the group's scales and zero points applied: Σ x·(q - z)·s = s·(Σ x·a - (z - a₀)·Σ x)
        for the A operand's a = q - a₀. ONE_ROW: x row 1 (columns 2t + 1) is not computed."""
        d0 = gl.zeros(planes[0].shape, gl.float32, L3)
        d1, d2, d3 = d0, d0, d0
        for i in gl.static_range(8):
            d0, d1, d2, d3 = _plane(planes[i], _wide(xa[i], L3), _wide(xb[i], L3), d0, d1, d2, d3, FP16)
        e0 = _wide(e0, L3)
        a00 = a00 + s0 * (d0 - c0 * e0)
        a10 = a10 + s1 * (d2 - c1 * e0)
        if not ONE_ROW:
            e1 = _wide(e1, L3)
            a01 = a01 + s0 * (d1 - c0 * e1)
            a11 = a11 + s1 * (d3 - c1 * e1)
        return a00, a01, a10, a11

    @gluon.jit
    def _result_rows(rb, half, RB: gl.constexpr, S: gl.constexpr):
        """Lane indices (32, 1) and the weight rows g + 8·half of row blocks rb … rb + RB - 1 that lane (g, t) holds,
        (32, RB), in a warp-summed result's layout S."""
        lane = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(1, S)), 1)
        block = gl.expand_dims(gl.arange(0, RB, layout=gl.SliceLayout(0, S)), 0)
        return lane, (rb + block) * 16 + lane // 4 + 8 * half

    @gluon.jit
    def _store_columns(out_ptr, acc, rb0, half, col, M, N, inv, L3: gl.constexpr, SILU: gl.constexpr):
        """The warps' sums (NW, 32, RB) of x rows col + 2t (lane (g, t)) for weight rows g + 8·half of the row blocks
        rb0 … rb0 + RB - 1 of an (M, N) result, times inv (x's 1/rms where its RMSNorm was deferred, else 1). SILU:
        the row blocks alternate gate, up (a gate/up projection paired by 16-row blocks) and each pair's
        SiLU(gate)·up goes to row block rb0/2 + pair of an (M, N/2) result, rounded as silu_and_mul rounds it (gate
        and up in out's dtype, then SiLU, then the product)."""
        NW: gl.constexpr = acc.shape[0]
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        if SILU:
            LP: gl.constexpr = _lanes(NW, acc.shape[2] // 2)
            gate, up = gl.split(gl.reshape(acc, [NW, 32, acc.shape[2] // 2, 2]))
            gate = (gl.sum(gl.convert_layout(gate, LP, assert_trivial=True), axis=0) * inv).to(dtype).to(gl.float32)
            up = (gl.sum(gl.convert_layout(up, LP, assert_trivial=True), axis=0) * inv).to(dtype)
            value = (gate / (1.0 + gl.exp(-gate))).to(dtype) * up
            S: gl.constexpr = gl.SliceLayout(0, LP)
            rb = rb0 // 2
            n = N // 2
        else:
            value = (gl.sum(acc, axis=0) * inv).to(dtype)
            S: gl.constexpr = gl.SliceLayout(0, L3)
            rb = rb0
            n = N
        lane, row = _result_rows(rb, half, value.shape[1], S)
        c = col + 2 * (lane % 4)
        gl.store(out_ptr + c * n + row, value, mask=(c < M) & (row < n))

    @gluon.jit
    def _store_residual_sum(out_ptr, res_ptr, norm_w_ptr, acc, rb0, half, N, L3: gl.constexpr):
        """One x row's sums (NW, 32, RB) for weight rows g + 8·half of row blocks rb0 … added to the residual stream
        in place (rounded as add_rms_norm's sum), and that sum times the next RMSNorm's weight into out: its input
        but for 1/rms, which the GEMV after applies to its products. Returns Σ of the sum's squares here."""
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        value = gl.sum(acc, axis=0).to(dtype)
        lane, row = _result_rows(rb0, half, value.shape[1], gl.SliceLayout(0, L3))
        ok = (lane % 4 == 0) & (row < N)                   # lanes (g, 0) hold x row 0
        total = value + gl.load(res_ptr + row, mask=ok, other=0.0)
        gl.store(res_ptr + row, total, mask=ok)
        gl.store(out_ptr + row, gl.load(norm_w_ptr + row, mask=ok, other=0.0) * total, mask=ok)
        squares = total.to(gl.float32)
        return gl.sum(gl.sum(gl.where(ok, squares * squares, 0.0), axis=1), axis=0)

    @gluon.jit
    def _grid_values(v, L3: gl.constexpr, FP16: gl.constexpr):
        """A lane's 16 bytes of pack_grid's for each row block, (NW, 32, 4·RB) → scales of rows g, g + 8 and their
        zero points in the A operand's units (z - 8 for fp16's signed levels, z + 128 for bf16's M + q), each
        (NW, 32, RB)."""
        v = gl.reshape(v, [v.shape[0], 32, v.shape[2] // 4, 2, 2])                 # entry 2·(zero?) + h
        h0, h1 = gl.split(v)
        s0, z0 = gl.split(h0)
        s1, z1 = gl.split(h1)
        if FP16:
            OFFSET: gl.constexpr = -8.0
        else:
            OFFSET: gl.constexpr = 128.0
        return (gl.convert_layout(s0, L3, assert_trivial=True), gl.convert_layout(s1, L3, assert_trivial=True),
                gl.convert_layout(z0, L3, assert_trivial=True) + OFFSET,
                gl.convert_layout(z1, L3, assert_trivial=True) + OFFSET)

    @gluon.jit
    def _take(v, c: gl.constexpr, PARTS: gl.constexpr, L: gl.constexpr):
        """Part c of a lane's PARTS (1, 2, 4, 8) equal parts along the last dimension of (NW, 32, PARTS·E) →
        (NW, 32, E) in L (register moves only): the parts' index bits become trailing dimensions of 2, split off
        lowest first."""
        NW: gl.constexpr = v.shape[0]
        E: gl.constexpr = v.shape[2] // PARTS
        if PARTS > 1:
            if PARTS == 2:
                v = gl.permute(gl.reshape(v, [NW, 32, 2, E]), [0, 1, 3, 2])
            elif PARTS == 4:
                v = gl.permute(gl.reshape(v, [NW, 32, 2, 2, E]), [0, 1, 4, 2, 3])
            else:
                v = gl.permute(gl.reshape(v, [NW, 32, 2, 2, 2, E]), [0, 1, 5, 2, 3, 4])
            lo, hi = gl.split(v)
            if c % 2:
                v = hi
            else:
                v = lo
            if PARTS >= 4:
                lo, hi = gl.split(v)
                if (c // 2) % 2:
                    v = hi
                else:
                    v = lo
            if PARTS == 8:
                lo, hi = gl.split(v)
                if (c // 4) % 2:
                    v = hi
                else:
                    v = lo
        return gl.convert_layout(v, L, assert_trivial=True)

    @gluon.jit
    def _step_loads(w_ptr, grid_ptr, rb0, step, ok, warp, lane_w, entry_w, warp_g, lane_g, entry_g, nchunk, nrb,
                    GROUPS, NW: gl.constexpr, CPS: gl.constexpr, RB: gl.constexpr, GROUPED: gl.constexpr,
                    EVEN: gl.constexpr):
        """Step `step`'s CPS chunks of each warp, (step·CPS + j)·NW + warp, of row blocks rb0 … rb0 + RB - 1:
        their words (NW, 32, 8·RB·CPS; chunk j's row block r at 8·(j·RB + r)) and scales (NW, 32, 4·RB·CPS; the
        row's, without groups). Chunks past the last, or all where ok is false, read nothing — EVEN (every step
        whole, the row blocks too): a step past the last re-reads the last, which is never used."""
        if EVEN:
            step = gl.minimum(step, nchunk // (CPS * NW) - 1)
        chunk_w = (step * CPS + entry_w // (8 * RB)) * NW + warp
        rb_w = rb0 + (entry_w // 8) % RB
        at_w = w_ptr + (rb_w * nchunk + chunk_w).to(gl.int64) * 256 + lane_w * 8 + entry_w % 8
        chunk_g = (step * CPS + entry_g // (4 * RB)) * NW + warp_g
        rb_g = rb0 + (entry_g // 4) % RB
        if GROUPED:
            group = chunk_g
        else:
            group = 0 * chunk_g
        at_g = grid_ptr + (rb_g * GROUPS + group).to(gl.int64) * 32 + (lane_g // 4) * 4 + entry_g % 4
        if EVEN:
            return gl.load(at_w), gl.load(at_g)
        return (gl.load(at_w, mask=ok & (chunk_w < nchunk) & (rb_w < nrb), other=0),
                gl.load(at_g, mask=ok & (chunk_g < nchunk) & (rb_g < nrb), other=0.0))

    @gluon.jit
    def _x_words(xa, chunk, ok, nchunk, EVEN: gl.constexpr):
        """A chunk's x words of the lanes whose B columns are x rows (ok); EVEN: the others' left as they are (their
        columns are never stored), else 0 (as past the last chunk, whose words are 0 too)."""
        if EVEN:
            return gl.load(xa + chunk * 64, mask=ok & (chunk < nchunk))
        return gl.load(xa + chunk * 64, mask=ok & (chunk < nchunk), other=0)

    @gluon.jit
    def _step_products(words, grids, x0, xa, xb, xe, xa_ok, xb_ok, step, kx, ke, nchunk, s0, s1, c0, c1,
                       a00, a01, a10, a11, b00, b01, b10, b11, L: gl.constexpr, L3: gl.constexpr, NW: gl.constexpr,
                       CPS: gl.constexpr, RB: gl.constexpr, GROUPED: gl.constexpr, FP16: gl.constexpr,
                       XGROUPS: gl.constexpr, ONE_ROW: gl.constexpr, EVEN: gl.constexpr):
        """A step's CPS chunks a warp into the accumulators of x rows 0-7 (a) and 8-15 (b); x0: the step's first
        chunk of x rows 0-7, loaded; returns the next step's. Σ x of a chunk is made once for all RB row blocks."""
        for j in gl.static_range(CPS):
            first = (step * CPS + j) * NW
            chunk = first + kx
            x1 = _x_words(xa, chunk + NW, xa_ok, nchunk, EVEN)
            if GROUPED:
                s0, s1, c0, c1 = _grid_values(_take(grids, j, CPS, _lanes(NW, 4 * RB)), L3, FP16)
            w = _take(words, j, CPS, _lanes(NW, 8 * RB))
            planes = _eighths(gl.reshape(w, [NW, 32, RB, 8]), L3)
            fa, fb = _x_fragments(x0, L)
            if ONE_ROW:
                if EVEN:
                    row = gl.load(xe + first * 64)
                else:                                          # past the last chunk: Σ 0, as its words are 0
                    row = gl.load(xe + first * 64, mask=first + ke < nchunk, other=0)
                e0 = _row_sum(row, L, FP16)
                e1 = e0
            else:
                e0, e1 = _x_sums(fa, fb, L, FP16)
            a00, a01, a10, a11 = _chunk(planes, fa, fb, e0, e1, s0, s1, c0, c1, a00, a01, a10, a11, L3, FP16,
                                        ONE_ROW)
            if XGROUPS > 1:
                fa, fb = _x_fragments(_x_words(xb, chunk, xb_ok, nchunk, EVEN), L)
                e0, e1 = _x_sums(fa, fb, L, FP16)
                b00, b01, b10, b11 = _chunk(planes, fa, fb, e0, e1, s0, s1, c0, c1, b00, b01, b10, b11, L3, FP16,
                                            False)
            x0 = x1
        return x0, a00, a01, a10, a11, b00, b01, b10, b11

    @gluon.jit
    def _int4_mma_gemv_kernel(x_ptr, w_ptr, grid_ptr, out_ptr, res_ptr, norm_w_ptr, sums_out_ptr, sums_in_ptr, M, N,
                              K, GROUPS, SUMS_IN, eps, GROUPED: gl.constexpr, FP16: gl.constexpr,
                              XGROUPS: gl.constexpr, NW: gl.constexpr, CPS: gl.constexpr, RB: gl.constexpr,
                              AHEAD: gl.constexpr, ONE_ROW: gl.constexpr, EVEN: gl.constexpr, SILU: gl.constexpr,
                              ADD_RESIDUAL: gl.constexpr, RMS_IN: gl.constexpr, SUMS_PAD: gl.constexpr,
                              PDL: gl.constexpr):
        """out (M ≤ 8·XGROUPS, N) = x @ dequant(w)^T, RB 16-row blocks per program, their chunks dealt to the NW warps
        (chunk c to warp c mod NW) in steps of CPS chunks a warp (CPS = 1, 2, 4, 8; CPS·RB ≤ 8): the next step's
        words and scales are in flight during a step's products (AHEAD: there is more than one step), and the first
        step's are issued before the PDL wait — where one step covers the layer, a warp's whole share is read while
        the kernel before finishes. x comes chunk by chunk, one ahead, loaded only by the lanes whose B column is one
        of x's rows, and is shared by the RB row blocks (one B fragment, one Σ x per chunk); each group of 8 x rows
        is one more mma per plane on the same A fragment; the warps' sums are added at the end. ONE_ROW (M = 1): Σ x
        of a chunk in one mma (_ROW_SUM) instead of eight, no products for x row 1. EVEN: whole steps and row blocks
        (weights, scales and Σ x loaded without masks). SILU: row blocks in gate/up pairs, SiLU(gate)·up stored.
        One x row only: ADD_RESIDUAL (the layer before an RMSNorm) adds the product to res (in place), stores it
        times the norm's weight and each program's Σ of its squares (sums_out); RMS_IN (the layer after that norm,
        x = the stored product) scales its sums by 1/rms from the SUMS_IN partial sums at sums_in."""
        L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])
        L3: gl.constexpr = _lanes(NW, RB)
        rb0 = gl.program_id(0) * RB
        nrb = N // 16
        nchunk = K // 128
        steps = gl.cdiv(nchunk, CPS * NW)
        # per lane: its 8 plane words of each of its chunks, the 16 bytes of pack_grid's for rows g, g + 8 of each
        # chunk's group, and x's columns 32t … 32t + 31 (x rows g and g + 8 for xa and xb, as int32 pairs)
        warp, lane_w, entry_w = _index3(NW, 8 * RB * CPS, _lanes(NW, 8 * RB * CPS))
        warp_g, lane_g, entry_g = _index3(NW, 4 * RB * CPS, _lanes(NW, 4 * RB * CPS))
        words, grids = _step_loads(w_ptr, grid_ptr, rb0, 0, True, warp, lane_w, entry_w, warp_g, lane_g, entry_g,
                                   nchunk, nrb, GROUPS, NW, CPS, RB, GROUPED, EVEN)
        x_int = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        kx, lane_x, xword = _index3(NW, 16, _lanes(NW, 16))
        x_words = x_int + (lane_x % 4) * 16 + xword
        xa = x_words + gl.minimum(lane_x // 4, M - 1) * (K // 2)
        xb = x_words + gl.minimum(lane_x // 4 + 8, M - 1) * (K // 2)
        xa_ok = (lane_x // 4 < M) & (xword >= 0)              # B columns past x's rows: never stored
        xb_ok = (lane_x // 4 + 8 < M) & (xword >= 0)
        ke, lane_e, half_e = _index3(NW, 2, _lanes(NW, 2))     # _ROW_SUM's A: words 8g + t, 8g + t + 4 of x row 0
        xe = x_int + ke * 64 + 8 * (lane_e // 4) + lane_e % 4 + 4 * half_e
        a00 = gl.zeros([NW, 32, RB], gl.float32, L3)
        a01, a10, a11, b00, b01, b10, b11 = a00, a00, a00, a00, a00, a00, a00
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        s0, s1, c0, c1 = _grid_values(_take(grids, 0, CPS, _lanes(NW, 4 * RB)), L3, FP16)
        x0 = _x_words(xa, kx, xa_ok, nchunk, EVEN)
        if RMS_IN:                                       # loaded now, summed after the products
            part = gl.arange(0, SUMS_PAD, layout=gl.BlockedLayout([1], [32], [NW], [0]))
            partial_sums = gl.load(sums_in_ptr + part, mask=part < SUMS_IN, other=0.0)
        if AHEAD:
            for step in range(steps):
                following, following_grids = _step_loads(
                    w_ptr, grid_ptr, rb0, step + 1, step + 1 < steps, warp, lane_w, entry_w, warp_g, lane_g, entry_g,
                    nchunk, nrb, GROUPS, NW, CPS, RB, GROUPED, EVEN)
                x0, a00, a01, a10, a11, b00, b01, b10, b11 = _step_products(
                    words, grids, x0, xa, xb, xe, xa_ok, xb_ok, step, kx, ke, nchunk, s0, s1, c0, c1,
                    a00, a01, a10, a11, b00, b01, b10, b11, L, L3, NW, CPS, RB, GROUPED, FP16, XGROUPS, ONE_ROW, EVEN)
                words = following
                grids = following_grids
        else:
            x0, a00, a01, a10, a11, b00, b01, b10, b11 = _step_products(
                words, grids, x0, xa, xb, xe, xa_ok, xb_ok, 0, kx, ke, nchunk, s0, s1, c0, c1,
                a00, a01, a10, a11, b00, b01, b10, b11, L, L3, NW, CPS, RB, GROUPED, FP16, XGROUPS, ONE_ROW, EVEN)
        if ADD_RESIDUAL:
            squares = _store_residual_sum(out_ptr, res_ptr, norm_w_ptr, a00, rb0, 0, N, L3)
            squares += _store_residual_sum(out_ptr, res_ptr, norm_w_ptr, a10, rb0, 1, N, L3)
            gl.store(sums_out_ptr + gl.program_id(0), squares)
        else:
            inv = 1.0
            if RMS_IN:
                inv = gl.rsqrt(gl.sum(partial_sums, axis=0) / K + eps)
            _store_columns(out_ptr, a00, rb0, 0, 0, M, N, inv, L3, SILU)
            _store_columns(out_ptr, a10, rb0, 1, 0, M, N, inv, L3, SILU)
            if not ONE_ROW:
                _store_columns(out_ptr, a01, rb0, 0, 1, M, N, inv, L3, SILU)
                _store_columns(out_ptr, a11, rb0, 1, 1, M, N, inv, L3, SILU)
            if XGROUPS > 1:
                _store_columns(out_ptr, b00, rb0, 0, 8, M, N, inv, L3, SILU)
                _store_columns(out_ptr, b10, rb0, 1, 8, M, N, inv, L3, SILU)
                _store_columns(out_ptr, b01, rb0, 0, 9, M, N, inv, L3, SILU)
                _store_columns(out_ptr, b11, rb0, 1, 9, M, N, inv, L3, SILU)


def few_row_blocks(n: int, device: torch.device) -> bool:
    """Whether N rows make at most two row blocks per SM: there 8 warps share a block (num_warps), and int4_mma beats
    the CUDA-core GEMV (quant_linear's choice for shapes outside tuning.INT4_MMA_SHAPES)."""
    from .weight_only import sm_count

    return n // ROW_BLOCK <= 2 * sm_count(torch.device(device))


def num_warps(n: int, device: torch.device) -> int:
    """Warps sharing a row block's chunks: 8 for few row blocks (o and down of Llama-3.1-8B: 5.7 -> 5.2 and 15.4 ->
    12.2 µs at one row), else 4 (qkv 9.7 -> 8.1, gate_up 32.1 -> 22.9; H200)."""
    return 8 if few_row_blocks(n, device) else 4


def config(n: int, k: int, rows: int, device: torch.device) -> tuple[int, int, int]:
    """(warps, chunks a warp per step, row blocks a program) of the product of `rows` rows with an (N, K) layer:
    tuning.INT4_MMA_LAYOUTS at up to 8 rows of a measured shape, else num_warps's warps, 2 chunks a step, one row
    block."""
    if rows <= 8 and (n, k) in tuning.INT4_MMA_LAYOUTS:
        return tuning.INT4_MMA_LAYOUTS[n, k]
    return num_warps(n, device), 2, 1


def gemv(x: torch.Tensor, words: torch.Tensor, grid: torch.Tensor, launch: dict | None = None,
         layout: tuple[int, int, int] | None = None, silu: bool = False, residual: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None, rms_of: tuple[torch.Tensor, float] | None = None):
    """x (≤ MAX_ROWS rows, bf16/fp16) @ dequant(w)^T for fragment-layout words (int4_fragments.pack) and their
    scales and zero points (int4_fragments.pack_grid): (rows, N) in x's dtype. layout: (warps, chunks a warp per
    step, row blocks a program; steps and row blocks 1, 2, 4 or 8, their product at most 8), config's by default (the
    int4_mma phase of gpu_suite measured them: tuning.py). silu: the row blocks alternate gate, up
    (int4_fragments.pair_blocks) and the result is SiLU(gate)·up, (rows, N/2); a program then takes at least two row
    blocks (a pair).

    An RMSNorm between two products of one row, folded into them: residual (1, N) and norm_weight (N,) — the
    product is added to residual in place and (norm_weight · sum, each program's float32 Σ sum² (1, programs)) come
    back; rms_of = (those sums, eps) — x is such a weighted sum, and the products are scaled by its 1/rms."""
    m, k = x.shape
    n = words.shape[0]
    groups = grid.shape[1]
    warps, step, blocks = layout or config(n, k, m, x.device)
    if silu and blocks == 1 and layout is None:
        step, blocks = min(step, 4), 2
    if step * blocks > 8 or step not in (1, 2, 4, 8) or blocks not in (1, 2, 4, 8):
        raise ValueError(f"int4_mma layout {(warps, step, blocks)}: chunks a step and row blocks must be 1, 2, 4 or 8, "
                         "their product at most 8")
    if silu and (blocks == 1 or n % (2 * ROW_BLOCK)):
        raise ValueError(f"int4_mma SiLU(gate)·up of {n} paired rows needs whole pairs of row blocks and at least two "
                         f"a program, not {blocks}")
    add = residual is not None
    if add != (norm_weight is not None) or ((add or rms_of is not None) and m != 1) or (add and (silu or rms_of)):
        raise ValueError("int4_mma folds an RMSNorm for one x row only: residual with norm_weight before it (no SiLU), "
                         "rms_of after it")
    if add and (residual.shape != (1, n) or residual.dtype != x.dtype or not residual.is_contiguous()):
        raise ValueError(f"int4_mma residual must be a contiguous (1, {n}) {x.dtype} tensor, not {tuple(residual.shape)}")
    nrb, nchunk = n // ROW_BLOCK, k // CHUNK
    programs = triton.cdiv(nrb, blocks)
    out = torch.empty((m, n // 2 if silu else n), dtype=x.dtype, device=x.device)
    sums_out = torch.empty((1, programs), dtype=torch.float32, device=x.device) if add else out
    sums_in, eps = rms_of if rms_of is not None else (out, 0.0)
    _int4_mma_gemv_kernel[(programs,)](
        x.contiguous(), words, grid, out, residual if add else out, norm_weight if add else out, sums_out, sums_in,
        m, n, k, groups, sums_in.shape[-1], eps, GROUPED=groups > 1, FP16=x.dtype == torch.float16,
        XGROUPS=triton.cdiv(m, 8), NW=warps, CPS=step, RB=blocks, AHEAD=nchunk > warps * step, ONE_ROW=m == 1,
        EVEN=nchunk % (warps * step) == 0 and nrb % blocks == 0, SILU=silu, ADD_RESIDUAL=add,
        RMS_IN=rms_of is not None, SUMS_PAD=triton.next_power_of_2(sums_in.shape[-1]) if rms_of else 1,
        num_warps=warps, **(launch or {"PDL": False}))
    return (out, sums_out) if add else out


