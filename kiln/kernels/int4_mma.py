"""int4 weights in the tensor cores' fragment layout: packing, the decode product (≤ 16 rows of x) on mma.sync, and
a dequantize kernel for the products of more rows.

Why: the CUDA-core decode GEMV (triton_kernels._weight_only_gemv_kernel) spends ~3.3 instructions per int4 value
(unpack, FMA, x's share) and reads 1.5–2.5 TB/s. Here one int32 word is exactly one lane's share of a 16×16 A
operand of `mma.sync.m16n8k16`: four `lop3`s (three shifts) OR the levels into the mantissa of a power of two M
(128 for bf16, 1024 for fp16), four packed FMAs subtract M + 8 (both exact: signed levels q - 8) and one mma
multiplies the four bf16/fp16 pairs by x — ~1.6 instructions per value.

Layout (made at load, never stored): a row block of 16 rows × a chunk of 128 columns is 256 words, plane p (0..7,
columns 16p..16p+15 of the chunk) of lane l at word 32p + l. Lane l = 4g + t holds, as mma's A fragment, rows g
and g + 8 at columns 2t, 2t + 1, 2t + 8, 2t + 9 of its plane: nibble h + 2·kh + 4·ki is row g + 8h, column
8kh + 2t + ki. Each group's scale and zero point are applied to a chunk's float32 sums (fresh mma accumulators per
chunk): Σ x·(q - z)·s = s·(Σ x·(q - 8) - (z - 8)·Σ x), Σ x coming from a second mma on a ones matrix. Chunks of
128 columns hold one group: g128 or one group per row.

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
    """(N, K) levels → (row blocks, chunks, planes p, lanes g, t, nibbles ki, kh, h) by their place in a word."""
    n, k = levels.shape
    v = levels.reshape(n // 16, 2, 8, k // CHUNK, 8, 2, 4, 2)       # rb, h, g, kc, p, kh, t, ki
    return v.permute(0, 3, 4, 2, 6, 7, 5, 1)                          # rb, kc, p, g, t, ki, kh, h


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
    nibbles = (words.reshape(-1, 1).to(torch.int64) >> shifts) & 0xF       # (words, 8): rb, kc, p, g, t | ki, kh, h
    levels = nibbles.reshape(n // 16, k // CHUNK, 8, 8, 4, 2, 2, 2).permute(0, 7, 3, 1, 2, 6, 4, 5)
    return pack_int4(levels.reshape(n, k).to(torch.uint8))


if gluon is not None:
    # One lane's word → four pairs of levels - 8 (OR-ed into the mantissa of M, then M + 8 subtracted: exact) →
    # D += A·B, E += ones·B (the sums of x's columns over the plane).
    def _plane_asm(fp16: bool) -> str:
        kind, magic, one, minus = (("f16", "0x64006400", "0x3C003C00", "0xE408E408") if fp16 else
                                   ("bf16", "0x43004300", "0x3F803F80", "0xC308C308"))
        mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
        level = " ".join(f"lop3.b32 a{i}, s{i}, 0x000F000F, {magic}, 0xEA; fma.rn.{kind}x2 a{i}, a{i}, one, minus;"
                         for i in range(4))
        return ("{ .reg .b32 a0, a1, a2, a3, s0, s1, s2, s3, one, minus; .reg .f32 e2, e3, z; "
                f"mov.b32 one, {one}; mov.b32 minus, {minus}; mov.f32 z, 0f00000000; "
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
    def _load_planes(w_tile, kc, nchunk):
        """The 8 planes of the warps' chunks kc (zeros past the last chunk)."""
        ok = kc < nchunk
        at = w_tile + kc * 256
        return (gl.load(at, mask=ok, other=0), gl.load(at + 32, mask=ok, other=0),
                gl.load(at + 64, mask=ok, other=0), gl.load(at + 96, mask=ok, other=0),
                gl.load(at + 128, mask=ok, other=0), gl.load(at + 160, mask=ok, other=0),
                gl.load(at + 192, mask=ok, other=0), gl.load(at + 224, mask=ok, other=0))

    @gluon.jit
    def _chunk(planes, x_at, ok, d0, d1, d2, d3, e0, e1, FP16: gl.constexpr):
        """One chunk's 8 planes multiplied into D (rows × x columns) and E (Σ x per x column); plane i takes x's
        columns 16i + 2t, 16i + 2t + 1 and 8 further on (x_at: lane (g, t)'s first, as int32 pairs)."""
        for i in gl.static_range(8):
            d0, d1, d2, d3, e0, e1 = _plane(planes[i], gl.load(x_at + 8 * i, mask=ok, other=0),
                                            gl.load(x_at + 8 * i + 4, mask=ok, other=0), d0, d1, d2, d3, e0, e1,
                                            FP16)
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
    def _group_scales(scale_ptr, zero_ptr, row0, at, ok, zero_f, GROUPS, HAS_ZERO: gl.constexpr):
        """Scales of rows g, g + 8 (lane (g, t)) at group offsets `at`, and their zero points - 8."""
        s0 = gl.load(scale_ptr + row0 * GROUPS + at, mask=ok, other=0.0)
        s1 = gl.load(scale_ptr + (row0 + 8) * GROUPS + at, mask=ok, other=0.0)
        if HAS_ZERO:
            c0 = gl.load(zero_ptr + row0 * GROUPS + at, mask=ok, other=0.0) - 8.0
            c1 = gl.load(zero_ptr + (row0 + 8) * GROUPS + at, mask=ok, other=0.0) - 8.0
        else:
            c0 = zero_f
            c1 = zero_f
        return s0, s1, c0, c1

    @gluon.jit
    def _chunk_sums(planes, x_at, kc, nchunk, row0, zero_f, scale_ptr, zero_ptr, GROUPS, s0, s1, c0, c1,
                    a00, a01, a10, a11, HAS_ZERO: gl.constexpr, GROUPED: gl.constexpr, FP16: gl.constexpr):
        """One chunk of 8 x rows: its float32 sums from fresh mma accumulators (a long chain of tensor-core adds
        would lose bits), scaled into the accumulators."""
        ok = kc < nchunk
        d0, d1, d2, d3, e0, e1 = _chunk(planes, x_at + kc * 64, ok, zero_f, zero_f, zero_f, zero_f, zero_f, zero_f,
                                        FP16)
        if GROUPED:
            s0, s1, c0, c1 = _group_scales(scale_ptr, zero_ptr, row0, kc, ok, zero_f, GROUPS, HAS_ZERO)
        return _scaled(a00, a01, a10, a11, d0, d1, d2, d3, e0, e1, s0, s1, c0, c1)

    @gluon.jit
    def _int4_mma_gemv_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, GROUPS,
                              HAS_ZERO: gl.constexpr, GROUPED: gl.constexpr, FP16: gl.constexpr,
                              XGROUPS: gl.constexpr, NW: gl.constexpr, PDL: gl.constexpr):
        """out (M ≤ 8·XGROUPS, N) = x @ dequant(w)^T, one 16-row block per program; warp w takes chunks w and
        w + NW of every 2·NW (both loaded before either is multiplied, the next two while they are) and the warps'
        sums are added at the end. Each group of 8 x rows is one more mma per plane on the same A fragment."""
        L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])
        rb = gl.program_id(0)
        warp = gl.expand_dims(gl.arange(0, NW, layout=gl.SliceLayout(1, L)), 1)      # (NW, 1)
        lane = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, L)), 0)      # (1, 32)
        g = lane // 4
        t = lane % 4
        nchunk = K // 128
        row0 = rb * 16 + g
        w_tile = w_ptr + (rb * nchunk).to(gl.int64) * 256 + lane
        x_words = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + t
        xa = x_words + gl.minimum(g, M - 1) * (K // 2)
        xb = x_words + gl.minimum(g + 8, M - 1) * (K // 2)
        zero_f = gl.zeros([NW, 32], gl.float32, L)
        a00, a01, a10, a11 = zero_f, zero_f, zero_f, zero_f
        b00, b01, b10, b11 = zero_f, zero_f, zero_f, zero_f
        kc = warp + 0 * lane
        s0, s1, c0, c1 = _group_scales(scale_ptr, zero_ptr, row0, 0 * kc, kc >= 0, zero_f, GROUPS, HAS_ZERO)
        planes0 = _load_planes(w_tile, kc, nchunk)          # in flight while the kernel before finishes
        planes1 = _load_planes(w_tile, kc + NW, nchunk)
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        for start in range(0, nchunk, 2 * NW):
            kc0 = start + warp + 0 * lane
            kc1 = kc0 + NW
            following0 = _load_planes(w_tile, kc0 + 2 * NW, nchunk)
            following1 = _load_planes(w_tile, kc1 + 2 * NW, nchunk)
            a00, a01, a10, a11 = _chunk_sums(planes0, xa, kc0, nchunk, row0, zero_f, scale_ptr, zero_ptr, GROUPS,
                                             s0, s1, c0, c1, a00, a01, a10, a11, HAS_ZERO, GROUPED, FP16)
            a00, a01, a10, a11 = _chunk_sums(planes1, xa, kc1, nchunk, row0, zero_f, scale_ptr, zero_ptr, GROUPS,
                                             s0, s1, c0, c1, a00, a01, a10, a11, HAS_ZERO, GROUPED, FP16)
            if XGROUPS > 1:
                b00, b01, b10, b11 = _chunk_sums(planes0, xb, kc0, nchunk, row0, zero_f, scale_ptr, zero_ptr,
                                                 GROUPS, s0, s1, c0, c1, b00, b01, b10, b11, HAS_ZERO, GROUPED, FP16)
                b00, b01, b10, b11 = _chunk_sums(planes1, xb, kc1, nchunk, row0, zero_f, scale_ptr, zero_ptr,
                                                 GROUPS, s0, s1, c0, c1, b00, b01, b10, b11, HAS_ZERO, GROUPED, FP16)
            planes0 = following0
            planes1 = following1
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
        lane = i % 32
        p = (i // 32) % 8
        kc = (i // 256) % nchunk
        rb = i // (256 * nchunk)
        g = lane // 4
        t = lane % 4
        for pair in tl.static_range(4):                       # pair = h + 2·kh; nibbles pair and pair + 4 (ki = 0, 1)
            row = rb * 16 + g + 8 * (pair % 2)
            col = kc * 128 + 16 * p + 8 * (pair // 2) + 2 * t
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
        XGROUPS=triton.cdiv(m, 8), NW=num_warps, num_warps=num_warps, **(launch or {"PDL": False}))
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
