"""int4 on the tensor cores (kernels/triton/int4_fragments.py, int4_mma.py): the fragment layout checked on the CPU
against the PTX tables of mma.m16n8k16, the routing of products on it (stand-ins for the kernels), its dequantize
kernel under Triton's interpreter (marker `interpreter`; the interpreter runs neither Gluon nor inline PTX), and on the
GPU (`pytest -m gpu`, the sweep `-m gpu_slow`; skipped without one) the mma.sync products, their SiLU(gate)·up and
the folded RMSNorm against the float64 reference."""
from __future__ import annotations

import pytest
import torch

from conftest import gpu_cases, rel_err
from kiln.kernels import quant, reference
from test_quant_linear import gpu_layout, quantized, stood_for

CUDA = torch.device("cuda")


def _fragment_element(flat: torch.Tensor, nchunk: int, rb: int, kc: int, p: int, lane: int, i: int) -> int:
    """Element i of lane's A fragment of plane p (PTX ISA: register i // 2, half i % 2) from the packed words."""
    word = int(flat[((rb * nchunk + kc) * 32 + lane) * 8 + p])
    return (word >> (4 * (i // 2 + 4 * (i % 2)))) & 0xF


def _fragment_place(lane: int, i: int) -> tuple[int, int]:
    """(row in the 16-row block, fragment column) of element i of lane's A fragment: rows groupID (+8 for elements
    2, 3, 6, 7), columns 2·threadID_in_group + (i & 1) (+8 for i ≥ 4)."""
    group, thread = divmod(lane, 4)
    return group + (8 if i in (2, 3, 6, 7) else 0), 2 * thread + (i & 1) + (8 if i >= 4 else 0)


def test_int4_fragment_layout_is_mma_a_operand():
    """int4_fragments.pack puts into lane l's word p (words 8l … 8l + 7 of a 16-row × 128-column block) exactly plane p's
    A fragment of mma.m16n8k16, fragment column c standing for the chunk's column 32t + 4p + 2·(c // 8) + c % 2;
    unpack undoes pack."""
    from kiln.kernels.triton import int4_fragments

    g = torch.Generator().manual_seed(0)
    n, k = 32, 256
    levels = torch.randint(0, 16, (n, k), generator=g)
    words = int4_fragments.pack(quant.pack_int4(levels))
    assert words.dtype == torch.int32 and words.shape == (n, k // 8)
    assert torch.equal(int4_fragments.unpack(words), quant.pack_int4(levels))
    flat = words.reshape(-1).to(torch.int64) & 0xFFFFFFFF
    for rb in range(n // 16):
        for kc in range(k // 128):
            for p in range(8):
                for lane in range(32):
                    for i in range(8):
                        row, col = _fragment_place(lane, i)
                        column = 32 * (lane % 4) + 4 * p + 2 * (col // 8) + col % 2
                        assert _fragment_element(flat, k // 128, rb, kc, p, lane, i) == \
                            levels[16 * rb + row, 128 * kc + column], (rb, kc, p, lane, i)


def test_int4_fragment_products_emulated():
    """The kernel's product, emulated from the PTX fragment tables on the packed words and on the x words each lane
    loads (x's columns 32t … 32t + 31 of a chunk, words 2p and 2p + 1 being plane p's B fragment b0 b1, b2 b3 for
    B rows 2t, 2t + 1, 2t + 8, 2t + 9 of column groupID): D = levels · xᵀ."""
    from kiln.kernels.triton import int4_fragments

    g = torch.Generator().manual_seed(1)
    n, k, m = 16, 256, 8
    levels = torch.randint(0, 16, (n, k), generator=g)
    x = torch.randint(-4, 5, (m, k), generator=g).double()
    flat = int4_fragments.pack(quant.pack_int4(levels)).reshape(-1).to(torch.int64) & 0xFFFFFFFF
    d = torch.zeros(16, 8, dtype=torch.float64)
    for kc in range(k // 128):
        for p in range(8):
            a = torch.zeros(16, 16, dtype=torch.float64)
            b = torch.zeros(16, 8, dtype=torch.float64)
            for lane in range(32):
                group, thread = divmod(lane, 4)
                lane_x = x[group, 128 * kc + 32 * thread: 128 * kc + 32 * thread + 32]     # its 16 words
                b[2 * thread: 2 * thread + 2, group] = lane_x[4 * p: 4 * p + 2]            # word 2p
                b[2 * thread + 8: 2 * thread + 10, group] = lane_x[4 * p + 2: 4 * p + 4]   # word 2p + 1
                for i in range(8):
                    a[_fragment_place(lane, i)] = _fragment_element(flat, k // 128, 0, kc, p, lane, i)
            d += a @ b
    assert torch.equal(d, levels.double() @ x.t())


def test_int4_fragment_layout_takes():
    from kiln.kernels.triton import int4_fragments, int4_mma

    assert int4_fragments.takes((4096, 4096), 32) and int4_fragments.takes((6144, 4096), 1)
    assert not int4_fragments.takes((4096, 4096), 64)            # g64: two groups per chunk
    assert not int4_fragments.takes((4008, 4096), 32) and not int4_fragments.takes((576, 576), 5)
    assert not int4_mma.available("cpu")


def _stand_in_products(w: torch.Tensor | None = None, seen: list | None = None):
    """QuantProducts whose int4_mma kernels are float products (w) that record their calls in `seen`, and whose
    standalone RMSNorm is x · weight."""
    from kiln.kernels.triton.quant_linear import QuantProducts

    class StandIn(QuantProducts):
        def int4_gemv(self, x, words, grid, silu=False, **fold):
            seen.append((x.shape[0], silu, sorted(fold)))
            if w is not None:
                return x @ w.t()
            if "residual" in fold:
                return x[:, :8] * 2, torch.ones(1, 3)
            return x[:, :4] if silu else x[:, :8]

        def int4_dequantize(self, words, grid, dtype):
            return w.to(dtype)

        def rms_norm(self, x, weight, eps):
            return x * weight

    return StandIn()


@pytest.mark.parametrize("rows, slices", [(1, [1]), (16, [16]), (17, [16, 1]), (32, [16, 16]), (33, [])])
def test_fragment_products_in_row_slices(rows, slices):
    """Products on int4_mma's layout: up to tuning.FRAGMENT_SLICES slices of 16 rows go to its kernel one slice at a
    time and come back in order; more rows to the dequantized weight. (Both kernels stood in for by float
    products.)"""
    pytest.importorskip("triton")
    from kiln.kernels.triton.quant_linear import Interleaved

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(32, 64, generator=g).bfloat16()
    seen = []
    products = _stand_in_products(w, seen)
    x = torch.randn(rows, 64, generator=g).bfloat16()
    out = products.linear(x, "W4A16", {"weight": None, "weight_scale": None, "layout": Interleaved(fragments=True)},
                          None)
    assert [n for n, _, _ in seen] == slices and torch.equal(out, x @ w.t())


def test_folded_norms_route_to_int4_mma():
    """The folded RMSNorm's routing on int4_mma's layout (the kernel stood in for): one row before the norm goes to
    the residual-adding product and comes back a ResidualSum with the weighted sum; a DeferredNorm carrying it goes
    to the 1/rms-scaled product (SiLU too); more rows, or no weighted sum, apply the norm first. folds_norm: both
    layers on int4_mma's layout, unless the options turn the fold off."""
    pytest.importorskip("triton")
    from kiln.kernels import DeferredNorm, ResidualSum, TritonOptions
    from kiln.kernels.triton.quant_linear import Interleaved, QuantProducts

    calls = []
    products = _stand_in_products(seen=calls)
    params = {"weight": None, "weight_scale": None, "layout": Interleaved(fragments=True)}
    x, residual, norm_w = torch.randn(1, 16).bfloat16(), torch.randn(1, 8).bfloat16(), torch.ones(8).bfloat16()
    summed = products.linear_before_norm(x, "W4A16", params, None, residual, norm_w)
    assert isinstance(summed, ResidualSum) and summed.weighted is not None and calls[-1][2] == ["norm_weight",
                                                                                                 "residual"]
    assert not isinstance(products.linear_before_norm(x.expand(2, -1), "W4A16", params, None, residual, norm_w),
                          ResidualSum)
    assert calls[-1][2] == []
    deferred = DeferredNorm(summed.residual, summed.sum_squares, norm_w, 1e-5, summed.weighted)
    for product, silu in ((products.linear, False), (products.linear_silu, True)):
        product(deferred, "W4A16", {**params, "layout": Interleaved(paired_rows=silu, fragments=True)}, None)
        assert calls[-1] == (1, silu, ["rms_of"])
    products.linear(DeferredNorm(summed.residual, summed.sum_squares, norm_w, 1e-5), "W4A16", params, None)
    assert calls[-1] == (1, False, [])
    interleaved = {**params, "layout": Interleaved()}
    assert products.folds_norm(params, params) and not products.folds_norm(params, interleaved)
    assert not QuantProducts(TritonOptions(fold_norms=False)).folds_norm(params, params)


@pytest.mark.interpreter
@pytest.mark.parametrize("group", [128, None])
def test_interpreted_int4_fragment_dequantize(group):
    """The dequantize kernel of int4_mma's layout (products of more than 16 rows): the engine layout's float matrix
    exactly, with zero points per group of 128 or per row."""
    from kiln.kernels.triton import int4_fragments

    g = torch.Generator().manual_seed(10)
    packed, scale, zero = quant.quantize_int4(torch.randn(32, 256, generator=g), group, True)
    out = int4_fragments.dequantize(int4_fragments.pack(packed), int4_fragments.pack_grid(scale, zero), torch.float32)
    assert torch.equal(out, quant.dequantize_int4(packed, scale, zero))


FORMATS = [("W4A16_AWQ", 128), ("W4A16_GPTQ", 128), ("W4A16_AWQ", None), ("W4A16", None)]


def _int4_mma_product_cases() -> list:
    """The default GPU run: each format once, on the engine's layout of the kernel; the sweep: every format, shape
    and dtype with the other layouts of the kernel too."""
    sharp = [("W4A16_AWQ", 128, 6144, 4096, torch.bfloat16), ("W4A16_GPTQ", 128, 48, 640, torch.float16),
             ("W4A16_AWQ", None, 4096, 14336, torch.float16), ("W4A16", None, 32, 256, torch.bfloat16)]
    return [pytest.param(*case, False, marks=pytest.mark.gpu) for case in sharp] + [
        pytest.param(algo, group, n, k, dtype, True, marks=pytest.mark.gpu_slow) for algo, group in FORMATS
        for n, k in ((6144, 4096), (4096, 14336), (4096, 4096), (32, 256), (48, 640))
        for dtype in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("algo, group, n, k, dtype, other_layouts", _int4_mma_product_cases())
def test_int4_mma_products(algo, group, n, k, dtype, other_layouts):
    """int4 in the tensor cores' fragment layout (kernels/triton/int4_mma.py): the mma.sync product of 1-16 rows against
    the float64 product on the same levels (in the sweep also in the kernel's other layouts), and the dequantized
    matrix (products of more rows) equal to the engine layout's, rounded to x's dtype; quant_linear of 1, 16 and 17
    rows on the layout the engine loads."""
    from kiln.kernels import TritonOptions, quant
    from kiln.kernels.triton import int4_fragments, int4_mma, tuning
    from kiln.kernels.triton.quant_linear import QuantProducts

    products = QuantProducts(TritonOptions(int4_mma="all"))     # every shape in the fragment layout
    g = torch.Generator(device="cuda").manual_seed(n + k + (group or 0))
    params = quantized(algo, torch.randn((n, k), generator=g, device=CUDA) * 0.05, group)
    layout, packed = products.pack(algo, params)
    assert layout.fragments
    assert torch.equal(int4_fragments.unpack(packed["weight"]), params["weight"])
    dequant = quant.dequantize_weight(algo, params)
    assert packed["weight_zero"] is None and packed["weight_scale"].shape[2:] == (8, 4)
    assert torch.equal(int4_fragments.dequantize(packed["weight"], packed["weight_scale"], dtype), dequant.to(dtype))
    for rows in (1, 2, 3, 7, 8, 9, 16):
        x = (torch.rand((rows, k), generator=g, device=CUDA) * 4 - 1).to(dtype)
        ref = x.double() @ dequant.double().t()
        # the default layout, and others: one step for all chunks (8 a warp) or many, chunks that do not fill a step,
        # 2-8 row blocks a program (row blocks that do not fill a program)
        layouts = [None, (4, 2, 1), (4, 8, 1), (16, 1, 1), (2, 4, 1), (4, 2, 2), (4, 1, 4), (8, 1, 8), (2, 2, 4)]
        for mma_layout in layouts if other_layouts and rows in (1, 2, 9) else [None]:
            out = int4_mma.gemv(x, packed["weight"], packed["weight_scale"], layout=mma_layout)
            assert out.dtype == dtype and rel_err(out, ref) < 5e-3, (rows, mma_layout, rel_err(out, ref))
    for rows in (1, 16, 17, 32, 33):
        x = (torch.rand((rows, k), generator=g, device=CUDA) * 4 - 1).to(dtype)
        out = products.linear(x, algo, {**params, **packed, "layout": layout}, None)
        # above FRAGMENT_SLICES · MAX_ROWS cuBLAS multiplies the weight rounded to x's dtype: per channel with a float
        # zero point, each level's rounding repeats over the whole row and adds up with x's mean (1.8e-2 against the
        # exact weight in bf16, test run of 2026-12-02)
        weight = dequant if rows <= tuning.FRAGMENT_SLICES * int4_mma.MAX_ROWS else dequant.to(dtype)
        assert rel_err(out, x.double() @ weight.double().t()) < 5e-3, rows


@pytest.mark.parametrize("algo, group, n, k, dtype", gpu_cases(
    [(algo, group, n, k, dtype) for algo, group in (("W4A16_AWQ", 128), ("W4A16_GPTQ", 128), ("W4A16", None))
     for n, k in ((28672, 4096), (96, 256)) for dtype in (torch.bfloat16, torch.float16)],
    default=[("W4A16_AWQ", 128, 96, 256, torch.bfloat16)]))
def test_int4_mma_gate_up_writes_silu(algo, group, n, k, dtype):
    """A gate/up projection on int4_mma with its 16-row blocks paired at load: the product's SiLU(gate)·up equals
    the unpaired product + silu_and_mul bit for bit (1-16 rows, the engine's and other layouts), and the float64
    reference; more rows (cuBLAS, then silu_and_mul) too."""
    from kiln.kernels import ReferenceOps, TritonOptions
    from kiln.kernels.triton import int4_fragments, int4_mma
    from kiln.kernels.triton.norms import silu_and_mul
    from kiln.kernels.triton.quant_linear import QuantProducts

    products = QuantProducts(TritonOptions(int4_mma="all"))
    g = torch.Generator(device="cuda").manual_seed(n + k)
    params = quantized(algo, torch.randn((n, k), generator=g, device=CUDA) * 0.05, group)
    paired, plain = gpu_layout(products, algo, params, gated=True), gpu_layout(products, algo, params)
    assert paired["layout"].paired_rows and paired["layout"].fragments and not plain["layout"].paired_rows
    blocks = int4_fragments.pair_blocks
    assert torch.equal(blocks(blocks(params["weight"]), inverse=True), params["weight"])
    for rows in (1, 2, 8, 9, 16, 17, 40):
        x = (torch.rand((rows, k), generator=g, device=CUDA) * 4 - 1).to(dtype)
        unfused = silu_and_mul(products.linear(x, algo, plain, None))
        fused = products.linear_silu(x, algo, paired, None)
        assert fused.shape == (rows, n // 2) and torch.equal(fused, unfused), rows
        assert torch.equal(products.linear(x, algo, paired, None), products.linear(x, algo, plain, None)), rows
        ref = ReferenceOps.quant_linear_silu(x.double(), algo, stood_for(paired["layout"], params))
        assert rel_err(fused, ref) < 1e-2, rows
        if rows in (1, 9):          # other layouts: against the unpaired product in the same layout (the same sums)
            for layout in ((2, 2, 2), (4, 1, 4), (4, 1, 8), (8, 4, 2)):
                out = int4_mma.gemv(x, paired["weight"], paired["weight_scale"], layout=layout, silu=True)
                alike = int4_mma.gemv(x, plain["weight"], plain["weight_scale"], layout=layout)
                assert torch.equal(out, silu_and_mul(alike)), (rows, layout)
    with pytest.raises(ValueError, match="pairs of row blocks"):
        int4_mma.gemv(x[:1], paired["weight"], paired["weight_scale"], layout=(4, 2, 1), silu=True)


@pytest.mark.parametrize("algo, group, made_shape, read_shape, gated, dtype", gpu_cases(
    [(algo, group, *shapes, dtype) for algo, group in (("W4A16_AWQ", 128), ("W4A16", None))
     for shapes in (((4096, 4096), (28672, 4096), True), ((4096, 14336), (6144, 4096), False),
                    ((4096, 14336), (128256, 4096), False), ((384, 640), (96, 384), True))
     for dtype in (torch.bfloat16, torch.float16)],
    default=[("W4A16_AWQ", 128, (4096, 4096), (28672, 4096), True, torch.bfloat16)]))
def test_int4_mma_folds_the_residual_norm(algo, group, made_shape, read_shape, gated, dtype):
    """int4_mma at one row with the RMSNorm between two products folded in: o/down adding the residual
    (equal to the unfused product + add_rms_norm's sum, bit for bit), storing the sum times the norm's weight (equal
    to that product rounded) and per-program sums of squares; qkv / gate_up (SiLU, paired blocks) / LM head scaling
    their products by 1/rms against the unfused product of add_rms_norm's output and the float64 reference. The
    engine's layouts and others; a residual of a shape int4_mma cannot fold gets a clear error."""
    from kiln.kernels import DeferredNorm, ReferenceOps, ResidualSum, TritonOptions, quant
    from kiln.kernels.triton import int4_mma
    from kiln.kernels.triton.norms import add_rms_norm
    from kiln.kernels.triton.quant_linear import QuantProducts

    products = QuantProducts(TritonOptions(int4_mma="all"))
    hidden = made_shape[0]
    read_shape = (read_shape[0], hidden)
    g = torch.Generator(device="cuda").manual_seed(sum(made_shape + read_shape))
    made, read = (quantized(algo, torch.randn(shape, generator=g, device=CUDA) * 0.05, group)
                  for shape in (made_shape, read_shape))
    made_gpu, read_gpu = gpu_layout(products, algo, made), gpu_layout(products, algo, read, gated)
    assert made_gpu["layout"].fragments and read_gpu["layout"].fragments and products.folds_norm(made_gpu, read_gpu)
    norm_w = (torch.rand(hidden, generator=g, device=CUDA) + 0.5).to(dtype)
    product = products.linear_silu if gated else products.linear
    for trial in range(2):
        x = (torch.rand((1, made_shape[1]), generator=g, device=CUDA) * 2 - 0.5).to(dtype)
        residual = torch.randn((1, hidden), generator=g, device=CUDA).to(dtype)
        summed = products.linear_before_norm(x, algo, made_gpu, None, residual.clone(), norm_w)
        assert isinstance(summed, ResidualSum) and summed.weighted is not None
        normed, unfused_residual = add_rms_norm(products.linear(x, algo, made_gpu, None), residual.clone(), norm_w,
                                                1e-5)
        assert torch.equal(summed.residual, unfused_residual), trial
        assert torch.equal(summed.weighted, norm_w * unfused_residual), trial
        assert torch.allclose(summed.sum_squares.double().sum(1), summed.residual.double().pow(2).sum(1), rtol=1e-5)
        for layout in ((16, 1, 1), (8, 4, 1), (4, 2, 2)) if trial == 0 else ():   # against the same layout's product
            added = residual.clone()
            weighted, sums = int4_mma.gemv(x, made_gpu["weight"], made_gpu["weight_scale"], layout=layout,
                                           residual=added, norm_weight=norm_w)
            _, alike = add_rms_norm(int4_mma.gemv(x, made_gpu["weight"], made_gpu["weight_scale"], layout=layout),
                                    residual.clone(), norm_w, 1e-5)
            assert torch.equal(added, alike) and torch.equal(weighted, norm_w * alike), layout
            assert torch.allclose(sums.double().sum(), alike.double().pow(2).sum(), rtol=1e-5), layout
        deferred = DeferredNorm(summed.residual, summed.sum_squares, norm_w, 1e-5, summed.weighted)
        fused, unfused = product(deferred, algo, read_gpu, None), product(normed, algo, read_gpu, None)
        ref_x = reference.rms_norm(summed.residual.double(), norm_w.double(), 1e-5)
        ref = (ReferenceOps.quant_linear_silu if gated else quant.quant_linear)(
            ref_x, algo, stood_for(read_gpu["layout"], read), None)
        # x rounded once (weight · sum) instead of twice (sum · 1/rms, then · weight): apart by about as much as
        # either is from the float64 product (48 SiLU outputs of the small shape: 4.9e-3 against 3.6e-3 unfused)
        errors = rel_err(fused, ref), rel_err(unfused, ref), rel_err(fused, unfused)
        assert errors[0] < 1e-2 and errors[0] < 2 * errors[1] and errors[2] < 1e-2, (trial, errors)
        if trial == 0:
            for layout in ((2, 2, 2), (4, 1, 4), (8, 4, 2)) if gated else ((4, 8, 1), (2, 2, 2), (4, 1, 4)):
                out = int4_mma.gemv(summed.weighted, read_gpu["weight"], read_gpu["weight_scale"], layout=layout,
                                    silu=gated, rms_of=(summed.sum_squares, 1e-5))
                assert rel_err(out, ref) < 2 * errors[1] and rel_err(out, fused) < 1e-2, layout
    with pytest.raises(ValueError, match="one x row"):
        int4_mma.gemv(x.expand(2, -1).contiguous(), made_gpu["weight"], made_gpu["weight_scale"],
                      residual=residual.expand(2, -1).contiguous(), norm_weight=norm_w)
    with pytest.raises(ValueError, match="residual must be"):
        int4_mma.gemv(x, made_gpu["weight"], made_gpu["weight_scale"], residual=residual[:, :-16].contiguous(),
                      norm_weight=norm_w)

