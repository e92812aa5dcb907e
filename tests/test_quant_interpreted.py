"""The GPU's kernels for quantized layers run by Triton's interpreter on the CPU, against the reference formats and
products of kiln.kernels.quant (tests/test_gpu.py runs them compiled). test_quantization.py runs this file in its
own process with TRITON_INTERPRET=1, which must be set before Triton is imported; collected otherwise, it skips."""
from __future__ import annotations

import os

import pytest
import torch

from kiln.kernels import quant

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs in its own process with TRITON_INTERPRET=1 (test_quantization.py)", allow_module_level=True)


def _params(algo: str, w: torch.Tensor, group: int = 32) -> dict:
    if algo == "W8A16":
        q, s = quant.quantize_int8(w)
        return {"weight": q, "weight_scale": s}
    packed, s, z = quant.quantize_int4(w, group if algo != "W4A16" else None, algo == "W4A16_AWQ")
    return {"weight": packed, "weight_scale": s, **({"weight_zero": z} if z is not None else {})}


@pytest.fixture(scope="module")
def interpreted():
    from kiln.kernels import triton_kernels

    return triton_kernels


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("algo", ["W8A16", "W4A16", "W4A16_GPTQ", "W4A16_AWQ"])
def test_interleaved_layout_is_a_permutation_within_blocks(interpreted, algo):
    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(1))
    params = _params(algo, w)
    bits = 8 if algo == "W8A16" else 4
    layout, packed = interpreted.pack_quant(algo, params)
    assert layout == interpreted.INTERLEAVED and packed["weight"].shape == params["weight"].shape
    assert torch.equal(interpreted.interleave_weight(packed["weight"], bits, inverse=True), params["weight"])
    values = quant.unpack_int4(packed["weight"]) if bits == 4 else packed["weight"]
    word = values.reshape(6, -1, 4, 32 // bits)[0, 0]                     # block 0 of row 0: [word i][value j]
    original = quant.unpack_int4(params["weight"]) if bits == 4 else params["weight"]
    assert torch.equal(word, original[0, :word.numel()].reshape(32 // bits, 4).t())   # word i, value j = column 4j + i
    assert interpreted.pack_quant(algo, _params(algo, torch.randn(6, 40))) is None   # 40 columns: no whole blocks


@pytest.mark.parametrize("algo", ["W8A16", "W4A16", "W4A16_GPTQ", "W4A16_AWQ"])
@pytest.mark.parametrize("n, k, config", [(16, 256, (8, 32, True)), (20, 576, (8, 32, False)), (8, 2048, (4, 64, True))])
def test_interpreted_gemv_matches_the_reference(interpreted, algo, n, k, config):
    """float32 x, so the comparison sees the kernel's arithmetic (exact products, float32 sums), not bf16 rounding;
    576 columns: a short last group of 64 and an uneven count of blocks; 20 rows: a partial program."""
    g = torch.Generator().manual_seed(n + k)
    params = _params(algo, torch.randn(n, k, generator=g), group=128 if algo == "W4A16_AWQ" else 64)
    bits = 8 if algo == "W8A16" else 4
    weight = interpreted.pack_quant(algo, params)[1]["weight"]
    for rows in (1, 2, 3, 4):
        x = torch.rand(rows, k, generator=g) * 2 - 0.5                     # a mean away from 0, as activations have
        ref = quant.quant_linear(x.double(), algo, {key: v.double() if v.is_floating_point() else v
                                                    for key, v in params.items()}, None)
        out = interpreted.weight_only_gemv(x, weight, params["weight_scale"], params.get("weight_zero"), bits, config)
        assert _rel(out, ref) < 1e-5, (rows, _rel(out, ref))


@pytest.mark.parametrize("algo", ["W8A16", "W4A16_AWQ"])
def test_interpreted_tiled_matmul_reads_both_layouts(interpreted, algo):
    g = torch.Generator().manual_seed(3)
    params = _params(algo, torch.randn(24, 128, generator=g))
    x = torch.randn(5, 128, generator=g)
    ref = quant.quant_linear(x, algo, params, None)
    layout, packed = interpreted.pack_quant(algo, params)
    for interleaved, p in ((False, params), (True, {**params, **packed, "layout": layout})):
        assert _rel(interpreted.quant_linear(x, algo, p, None), ref) < 1e-5, interleaved


def test_interpreted_fp8_activation_quantization(interpreted):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 300, generator=g) * 3
    smoother = torch.rand(300, generator=g) + 0.5
    for static in (None, (x / smoother).abs().max().reshape(1) / quant.FP8_MAX):
        q, scale = interpreted.quantize_fp8_rows(x, smoother, static)
        ref_q, ref_scale = quant.quantize_activations_fp8(x / smoother, static)
        assert scale.shape == (6, 1) and torch.allclose(scale, ref_scale.expand(6, 1), rtol=1e-6)
        # the interpreter's e4m3 cast can drop the carry when it rounds up to a power of two (the GPU's does not)
        q, ref_q = q.float(), ref_q.float()
        assert torch.all((q == ref_q) | ((torch.frexp(ref_q)[0].abs() == 0.5) & (q == ref_q / 2)))


def test_interpreted_norm_and_silu_with_fp8_output(interpreted):
    """The RMSNorm (with and without the residual) and SiLU kernels' per-token e4m3 output: the same values and scales
    as the reference ops (quant.Fp8Rows.of the unfused output); the residual sum as the unfused kernel's."""
    from kiln.kernels import ReferenceOps

    g = torch.Generator().manual_seed(5)
    x, res, w = torch.randn(5, 96, generator=g) * 2, torch.randn(5, 96, generator=g), torch.rand(96, generator=g) + .5
    gate_up = torch.randn(5, 2 * 80, generator=g) * 3
    cases = [(interpreted.rms_norm_fp8(x, w, 1e-5), ReferenceOps.rms_norm_fp8(x, w, 1e-5)),
             (interpreted.silu_and_mul_fp8(gate_up), ReferenceOps.silu_and_mul_fp8(gate_up))]
    fused, fused_res = interpreted.add_rms_norm_fp8(x, res.clone(), w, 1e-5)
    ref, ref_res = ReferenceOps.add_rms_norm_fp8(x, res, w, 1e-5)
    assert torch.allclose(fused_res, ref_res)
    for out, expected in cases + [(fused, ref)]:
        assert out.dtype == expected.dtype == torch.float32 and out.shape == expected.shape
        assert torch.allclose(out.scale, expected.scale, rtol=1e-5)
        q, ref_q = out.values.float(), expected.values.float()
        carry_dropped = (torch.frexp(ref_q)[0].abs() == 0.5) & (q == ref_q / 2)     # the interpreter's e4m3 cast
        one_step = (q - ref_q).abs() <= ref_q.abs() / 8 + 2 ** -9                  # exp's last bits may differ
        assert (q == ref_q).float().mean() > 0.95 and (one_step | carry_dropped).all()


def _reference_params(params: dict) -> dict:
    return {key: v.double() if v.is_floating_point() else v for key, v in params.items()}


@pytest.mark.parametrize("algo", ["W8A16", "W4A16_AWQ"])
def test_gate_up_rows_are_paired_at_load(interpreted, algo, monkeypatch):
    """A gate/up projection's rows alternate gate, up in the GPU layout (scales and zero points with them); the
    switch off, or an ungated layer, keeps the engine's row order."""
    params = _params(algo, torch.randn(12, 64, generator=torch.Generator().manual_seed(2)))
    plain = interpreted.pack_quant(algo, params)[1]
    layout, paired = interpreted.pack_quant(algo, params, gated=True)
    assert layout.paired_rows and not interpreted.pack_quant(algo, params)[0].paired_rows
    for name, t in paired.items():
        assert torch.equal(interpreted.pair_gate_up_rows(t, inverse=True), plain[name]), name
    assert torch.equal(paired["weight"][1], plain["weight"][6]) and torch.equal(paired["weight"][2], plain["weight"][1])
    monkeypatch.setattr(interpreted, "GEMV_SILU", False)
    assert not interpreted.pack_quant(algo, params, gated=True)[0].paired_rows


@pytest.mark.parametrize("algo", ["W8A16", "W4A16_GPTQ", "W4A16_AWQ"])
@pytest.mark.parametrize("inter, k, config", [(10, 576, (8, 32, False)), (24, 256, (4, 64, True)), (12, 1536, None)])
def test_interpreted_gemv_writes_silu_of_paired_gate_up(interpreted, algo, inter, k, config):
    """SiLU(gate)·up from the GEMV on paired rows against the float64 reference (quant_linear, then silu_and_mul) at
    1-4 rows; 2·10 rows: a partial program; 576 columns: a short last group; then the >4-row path (tiled kernel +
    silu_and_mul on the pairs) and a plain call on the paired layout, which must still give [gate | up]."""
    from kiln.kernels import ReferenceOps

    g = torch.Generator().manual_seed(inter + k)
    params = _params(algo, torch.randn(2 * inter, k, generator=g), group=128 if algo == "W4A16_AWQ" else 64)
    layout, packed = interpreted.pack_quant(algo, params, gated=True)
    gpu = {**params, **packed, "layout": layout}
    bits = 8 if algo == "W8A16" else 4
    for rows in (1, 2, 3, 4, 5):
        x = torch.rand(rows, k, generator=g) * 2 - 0.5
        ref = ReferenceOps.quant_linear_silu(x.double(), algo, _reference_params(params))
        if rows <= 4:
            out = interpreted.weight_only_gemv(x, packed["weight"], packed["weight_scale"], packed.get("weight_zero"),
                                               bits, config, silu=True)
            products = interpreted.weight_only_gemv(x, packed["weight"], packed["weight_scale"],
                                                    packed.get("weight_zero"), bits, config)
            assert torch.equal(out, interpreted.silu_and_mul(products, paired=True))   # rounded the same
        else:
            out = interpreted.quant_linear_silu(x, algo, gpu, None)
            plain = interpreted.quant_linear(x, algo, gpu, None)
            assert _rel(plain, quant.quant_linear(x.double(), algo, _reference_params(params), None)) < 1e-5
        assert out.shape == (rows, inter) and _rel(out, ref) < 1e-5, (rows, _rel(out, ref))
