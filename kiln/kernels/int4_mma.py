"""int4 weights in the tensor cores' fragment layout: packing, the decode product (≤ 16 rows of x) on mma.sync, and
a dequantize kernel for the products of more rows.

Why: the CUDA-core decode GEMV (triton_kernels._weight_only_gemv_kernel) spends 3.2 instructions per int4 value
in sm_90 SASS (824 a loop iteration of 256 values, ~375 on the half-rate integer pipe), and that, not DRAM, bounds
it at 1.9–2.8 TB/s. Here one int32 word is exactly one lane's share of a 16×16 A operand of `mma.sync.m16n8k16`:
four `lop3`s (three shifts) OR the levels into the mantissa of a power of two M, giving M + q exactly, and one mma
multiplies the four pairs by x. bf16 (M = 128) multiplies M + q as it is and takes (M + z)·Σ x off per group;
fp16 (M = 1024, whose offset would cost too many of the accumulator's bits) first subtracts M + 8 with four packed
FMAs (signed levels). Third version, bf16 at one row: 260 instructions per 128 values (2.0 a value, 135 on the
integer pipe), weights and x in 16-byte loads.

Layout (made at load, never stored): a row block of 16 rows × a chunk of 128 columns is 256 words; lane l = 4g + t
holds words 8l … 8l + 7 (planes p = 0..7: 32 contiguous bytes, two 16-byte loads). As mma's A fragment, plane p of
lane (g, t) holds rows g and g + 8 at fragment columns 2t, 2t + 1, 2t + 8, 2t + 9: nibble h + 2·kh + 4·ki is row
g + 8h, fragment column c = 8kh + 2t + ki. Fragment columns are not the chunk's columns in order: a product is the
same for any order of its reduction as long as A and B agree, and the kernel's is column 32t + 4p + 2kh + ki of
the chunk, so that lane t's B fragments for all eight planes are x's 32 contiguous columns 32t … 32t + 31 (64
bytes, four 16-byte loads; words 2p, 2p + 1 are plane p's). Each group's scale and zero point are applied to a
chunk's float32 sums (fresh mma accumulators per chunk): Σ x·(q - z)·s = s·(Σ x·a - (z - a₀)·Σ x) for the A
operand's a = q - a₀ (a₀ = -M in bf16, 8 in fp16), Σ x coming from a second mma on a ones matrix. Chunks of 128
columns hold one group: g128 or one group per row.

B is x: lane (g, t) supplies column g (x row min(g, rows - 1)), so column n of the result is x row n; lane (g, t)
receives columns 2t and 2t + 1. The kernel is written in Gluon (Triton's explicit-layout language), so that which
lane holds which word is stated, not inferred.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                               # a CPU-only install: packing only
    triton = tl = None
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:                               # Triton < 3.4: no Gluon; the CUDA-core GEMV serves
    gluon = gl = None

ROW_BLOCK, CHUNK = 16, 128
MAX_ROWS = 16                                     # x rows: 8 per mma (one mma, or two per plane)
NUM_WARPS = 8


def available(device: torch.device | str) -> bool:
    """Gluon is importable and the GPU runs bf16 mma.sync (sm_80+)."""
    device = torch.device(device)
    return (gluon is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8)


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
    from .quant import unpack_int4

    levels = unpack_int4(weight).to(torch.int32)
    n, k = levels.shape
    nibbles = _fragment_view(levels).reshape(-1, 8)
    shifts = torch.arange(0, 32, 4, device=weight.device, dtype=torch.int32)
    # disjoint bit fields: their int32 sum (wrapping at the top nibble) is their bitwise OR
    return (nibbles << shifts).sum(dim=1, dtype=torch.int32).reshape(n, k // 8)


def unpack(words: torch.Tensor) -> torch.Tensor:
    """pack's inverse: int32 (N, K/8) → engine int4 uint8 (N, K/2)."""
    from .quant import pack_int4

    n, k = words.shape[0], words.shape[1] * 8
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int64)
    nibbles = (words.reshape(-1, 1).to(torch.int64) >> shifts) & 0xF       # (words, 8): rb, kc, g, t, p | ki, kh, h
    levels = nibbles.reshape(n // 16, k // CHUNK, 8, 4, 8, 2, 2, 2).permute(0, 7, 2, 1, 3, 4, 6, 5)
    return pack_int4(levels.reshape(n, k).to(torch.uint8))


if gluon is not None:
    # One lane's word → four pairs of levels OR-ed into the mantissa of M (M + q, exact; fp16 then subtracts M + 8:
    # signed levels) → D += A·B, E += ones·B (the sums of x's columns over the plane).
    def _plane_asm(fp16: bool) -> str:
        kind, magic, one = ("f16", "0x64006400", "0x3C003C00") if fp16 else ("bf16", "0x43004300", "0x3F803F80")
        mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
        signed = f"fma.rn.{kind}x2 a{{i}}, a{{i}}, one, minus;" if fp16 else ""
        level = " ".join(f"lop3.b32 a{i}, s{i}, 0x000F000F, {magic}, 0xEA; " + signed.format(i=i) for i in range(4))
        minus = "mov.b32 minus, 0xE408E408; " if fp16 else ""
        return ("{ .reg .b32 a0, a1, a2, a3, s0, s1, s2, s3, one, minus; .reg .f32 e2, e3, z; "
                f"mov.b32 one, {one}; {minus}mov.f32 z, 0f00000000; "
                "mov.b32 s0, $6; shr.u32 s1, $6, 4; shr.u32 s2, $6, 8; shr.u32 s3, $6, 12; "
                f"{level} "
                f"{mma} {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{$7, $8}}, {{$9, $10, $11, $12}}; "
                f"{mma} {{$4, $5, e2, e3}}, {{one, one, one, one}}, {{$7, $8}}, {{$13, $14, z, z}}; }}")

    _BF16_PLANE = gl.constexpr(_plane_asm(False))
    _FP16_PLANE = gl.constexpr(_plane_asm(True))

    @gluon.jit
    def _plane(word, xa, xb, d0, d1, d2, d3, e0, e1, FP16: gl.constexpr):
        if FP16:
            asm: gl.constexpr = _FP16_PLANE
        else:
            asm: gl.constexpr = _BF16_PLANE
        return gl.inline_asm_elementwise(asm, "=f,=f,=f,=f,=f,=f,r,r,r,f,f,f,f,f,f",
                                         [word, xa, xb, d0, d1, d2, d3, e0, e1],
                                         dtype=(gl.float32,) * 6, is_pure=True, pack=1)

    @gluon.jit
    def _eighths(w, L: gl.constexpr):
        """(NW, 32, 8) → its entries j = 0..7 along the last dimension, each (NW, 32) in L (register moves only)."""
        w = gl.reshape(w, [w.shape[0], 32, 2, 2, 2])                      # j = 4a + 2b + c
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

    @gluon.jit
    def _load_x(x_lanes, kx, nchunk, EVEN: gl.constexpr):
        """Each lane's 16 words of x (32 columns) of the warps' chunks kx (zeros past the last chunk)."""
        if EVEN:
            return gl.load(x_lanes + kx * 64)
        return gl.load(x_lanes + kx * 64, mask=kx < nchunk, other=0)

    @gluon.jit
    def _load_chunk(w_lanes, x_lanes, kw, kx, nchunk, EVEN: gl.constexpr):
        """The warps' chunks (kw, kx: their indices in the words' and x's layouts): each lane's 8 plane words and its
        16 words of x (zeros past the last chunk)."""
        if EVEN:
            return gl.load(w_lanes + kw * 256), _load_x(x_lanes, kx, nchunk, EVEN)
        return gl.load(w_lanes + kw * 256, mask=kw < nchunk, other=0), _load_x(x_lanes, kx, nchunk, EVEN)

    @gluon.jit
    def _chunk(words, xs, d0, d1, d2, d3, e0, e1, L: gl.constexpr, FP16: gl.constexpr):
        """One chunk's 8 planes multiplied into D (rows × x columns) and E (Σ x per x column): plane i takes the
        lane's x words 2i, 2i + 1."""
        planes = _eighths(words, L)
        pairs = gl.reshape(xs, [xs.shape[0], 32, 8, 2])
        xa, xb = gl.split(pairs)
        xa = _eighths(xa, L)
        xb = _eighths(xb, L)
        for i in gl.static_range(8):
            d0, d1, d2, d3, e0, e1 = _plane(planes[i], xa[i], xb[i], d0, d1, d2, d3, e0, e1, FP16)
        return d0, d1, d2, d3, e0, e1

    @gluon.jit
    def _scaled(acc00, acc01, acc10, acc11, d0, d1, d2, d3, e0, e1, s0, s1, c0, c1):
        """Accumulators += the chunk's (or the row's) sums with their scales and zero points applied."""
        return (acc00 + s0 * (d0 - c0 * e0), acc01 + s0 * (d1 - c0 * e1),
                acc10 + s1 * (d2 - c1 * e0), acc11 + s1 * (d3 - c1 * e1))

    @gluon.jit
    def _store_columns(out_ptr, acc00, acc01, acc10, acc11, rb, first, M, N, L: gl.constexpr):
        """The warps' sums of x rows first + 2t, first + 2t + 1 (lane (g, t)) for weight rows g, g + 8."""
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, L))
        row = rb * 16 + lane // 4
        col = first + 2 * (lane % 4)
        out_t = out_ptr.dtype.element_ty
        gl.store(out_ptr + col * N + row, gl.sum(acc00, axis=0).to(out_t), mask=col < M)
        gl.store(out_ptr + (col + 1) * N + row, gl.sum(acc01, axis=0).to(out_t), mask=col + 1 < M)
        gl.store(out_ptr + col * N + row + 8, gl.sum(acc10, axis=0).to(out_t), mask=col < M)
        gl.store(out_ptr + (col + 1) * N + row + 8, gl.sum(acc11, axis=0).to(out_t), mask=col + 1 < M)

    @gluon.jit
    def _group_scales(scale_ptr, zero_ptr, row0, at, ok, zero_f, GROUPS, HAS_ZERO: gl.constexpr,
                      FP16: gl.constexpr):
        """Scales of rows g, g + 8 (lane (g, t)) at group offsets `at`, and their zero points in the A operand's
        units: z - 8 for fp16's signed levels, z + 128 for bf16's M + q (zero points 8 without them)."""
        s0 = gl.load(scale_ptr + row0 * GROUPS + at, mask=ok, other=0.0)
        s1 = gl.load(scale_ptr + (row0 + 8) * GROUPS + at, mask=ok, other=0.0)
        if FP16:
            OFFSET: gl.constexpr = -8.0
        else:
            OFFSET: gl.constexpr = 128.0
        if HAS_ZERO:
            c0 = gl.load(zero_ptr + row0 * GROUPS + at, mask=ok, other=0.0) + OFFSET
            c1 = gl.load(zero_ptr + (row0 + 8) * GROUPS + at, mask=ok, other=0.0) + OFFSET
        else:
            c0 = zero_f + (8.0 + OFFSET)
            c1 = zero_f + (8.0 + OFFSET)
        return s0, s1, c0, c1

    @gluon.jit
    def _chunk_sums(words, xs, kc, nchunk, row0, zero_f, scale_ptr, zero_ptr, GROUPS, s0, s1, c0, c1,
                    a00, a01, a10, a11, L: gl.constexpr, HAS_ZERO: gl.constexpr, GROUPED: gl.constexpr,
                    FP16: gl.constexpr):
        """One chunk of 8 x rows: its float32 sums from fresh mma accumulators (a long chain of tensor-core adds
        would lose bits), scaled into the accumulators."""
        d0, d1, d2, d3, e0, e1 = _chunk(words, xs, zero_f, zero_f, zero_f, zero_f, zero_f, zero_f, L, FP16)
        if GROUPED:
            s0, s1, c0, c1 = _group_scales(scale_ptr, zero_ptr, row0, kc, kc < nchunk, zero_f, GROUPS, HAS_ZERO,
                                           FP16)
        return _scaled(a00, a01, a10, a11, d0, d1, d2, d3, e0, e1, s0, s1, c0, c1)

    @gluon.jit
    def _int4_mma_gemv_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, GROUPS,
                              HAS_ZERO: gl.constexpr, GROUPED: gl.constexpr, FP16: gl.constexpr,
                              XGROUPS: gl.constexpr, NW: gl.constexpr, EVEN: gl.constexpr, PDL: gl.constexpr):
        """out (M ≤ 8·XGROUPS, N) = x @ dequant(w)^T, one 16-row block per program; warp w takes chunks w and
        w + NW of every 2·NW (both loaded before either is multiplied, the next two while they are) and the warps'
        sums are added at the end. Each group of 8 x rows is one more mma per plane on the same A fragment.
        EVEN: the chunks divide evenly among the warps' pairs (no masks)."""
        L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])
        LW: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [NW, 1, 1], [2, 1, 0])
        LX: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32, 1], [NW, 1, 1], [2, 1, 0])
        rb = gl.program_id(0)
        warp = gl.expand_dims(gl.arange(0, NW, layout=gl.SliceLayout(1, L)), 1)      # (NW, 1)
        lane = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, L)), 0)      # (1, 32)
        g = lane // 4
        nchunk = K // 128
        row0 = rb * 16 + g
        # per lane: its 8 plane words of chunk 0 (w_lanes) and x's columns 32t … 32t + 31 (x rows g and g + 8 for
        # xa and xb, as int32 pairs)
        kw, lane_w, word = _index3(NW, 8, LW)
        w_lanes = w_ptr + (rb * nchunk).to(gl.int64) * 256 + lane_w * 8 + word
        kx, lane_x, xword = _index3(NW, 16, LX)
        x_words = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + (lane_x % 4) * 16 + xword
        xa = x_words + gl.minimum(lane_x // 4, M - 1) * (K // 2)
        xb = x_words + gl.minimum(lane_x // 4 + 8, M - 1) * (K // 2)
        zero_f = gl.zeros([NW, 32], gl.float32, L)
        a00, a01, a10, a11 = zero_f, zero_f, zero_f, zero_f
        b00, b01, b10, b11 = zero_f, zero_f, zero_f, zero_f
        kc = warp + 0 * lane
        s0, s1, c0, c1 = _group_scales(scale_ptr, zero_ptr, row0, 0 * kc, kc >= 0, zero_f, GROUPS, HAS_ZERO, FP16)
        w0, x0 = _load_chunk(w_lanes, xa, kw, kx, nchunk, EVEN)     # in flight while the kernel before finishes
        w1, x1 = _load_chunk(w_lanes, xa, kw + NW, kx + NW, nchunk, EVEN)
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        for start in range(0, nchunk, 2 * NW):
            kc0 = start + warp + 0 * lane
            kc1 = kc0 + NW
            next0 = _load_chunk(w_lanes, xa, start + 2 * NW + kw, start + 2 * NW + kx, nchunk, EVEN)
            next1 = _load_chunk(w_lanes, xa, start + 3 * NW + kw, start + 3 * NW + kx, nchunk, EVEN)
            a00, a01, a10, a11 = _chunk_sums(w0, x0, kc0, nchunk, row0, zero_f, scale_ptr, zero_ptr, GROUPS,
                                             s0, s1, c0, c1, a00, a01, a10, a11, L, HAS_ZERO, GROUPED, FP16)
            a00, a01, a10, a11 = _chunk_sums(w1, x1, kc1, nchunk, row0, zero_f, scale_ptr, zero_ptr, GROUPS,
                                             s0, s1, c0, c1, a00, a01, a10, a11, L, HAS_ZERO, GROUPED, FP16)
            if XGROUPS > 1:
                y0 = _load_x(xb, start + kx, nchunk, EVEN)
                y1 = _load_x(xb, start + NW + kx, nchunk, EVEN)
                b00, b01, b10, b11 = _chunk_sums(w0, y0, kc0, nchunk, row0, zero_f, scale_ptr, zero_ptr, GROUPS,
                                                 s0, s1, c0, c1, b00, b01, b10, b11, L, HAS_ZERO, GROUPED, FP16)
                b00, b01, b10, b11 = _chunk_sums(w1, y1, kc1, nchunk, row0, zero_f, scale_ptr, zero_ptr, GROUPS,
                                                 s0, s1, c0, c1, b00, b01, b10, b11, L, HAS_ZERO, GROUPED, FP16)
            w0, x0 = next0
            w1, x1 = next1
        _store_columns(out_ptr, a00, a01, a10, a11, rb, 0, M, N, L)
        if XGROUPS > 1:
            _store_columns(out_ptr, b00, b01, b10, b11, rb, 8, M, N, L)

    @triton.jit
    def _dequantize_kernel(w_ptr, scale_ptr, zero_ptr, out_ptr, K, GROUPS, HAS_ZERO: tl.constexpr,
                           GROUPED: tl.constexpr, BLOCK: tl.constexpr):
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
            group = row * GROUPS + (kc if GROUPED else 0)
            s = tl.load(scale_ptr + group)
            z = tl.load(zero_ptr + group) if HAS_ZERO else 8.0
            lo = ((word >> (4 * pair)) & 0xF).to(tl.float32)
            hi = ((word >> (4 * pair + 16)) & 0xF).to(tl.float32)
            both = tl.join((lo - z) * s, (hi - z) * s).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + (row * K + col)[:, None] + tl.arange(0, 2)[None, :], both)


def gemv(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
         launch: dict | None = None, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """x (≤ MAX_ROWS rows, bf16/fp16) @ dequant(w)^T for fragment-layout words (pack): (rows, N) in x's dtype.
    num_warps: warps sharing a row block's chunks (the GPU suite's int4_mma phase sweeps it)."""
    m, k = x.shape
    n = words.shape[0]
    scale2d = scale.reshape(n, -1)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _int4_mma_gemv_kernel[(n // ROW_BLOCK,)](
        x.contiguous(), words, scale2d, scale2d if zero is None else zero, out, m, n, k, scale2d.shape[1],
        HAS_ZERO=zero is not None, GROUPED=scale2d.shape[1] > 1, FP16=x.dtype == torch.float16,
        XGROUPS=triton.cdiv(m, 8), NW=num_warps, EVEN=(k // CHUNK) % (2 * num_warps) == 0, num_warps=num_warps,
        **(launch or {"PDL": False}))
    return out


def dequantize(words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The (N, K) float matrix of fragment-layout words, in `dtype` (products of more rows than gemv takes)."""
    n, k = words.shape[0], words.shape[1] * 8
    scale2d = scale.reshape(n, -1)
    out = torch.empty((n, k), dtype=dtype, device=words.device)
    block = 256                                           # one row block × chunk: always whole
    _dequantize_kernel[(words.numel() // block,)](words, scale2d, scale2d if zero is None else zero, out, k,
                                                  scale2d.shape[1], HAS_ZERO=zero is not None,
                                                  GROUPED=scale2d.shape[1] > 1, BLOCK=block, num_warps=4)
    return out
