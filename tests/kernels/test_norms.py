"""The norm, activation, rotary and per-token FP8 kernels (kernels/triton/norms.py, rope_cache.py) against the torch
reference: compiled on the GPU (`pytest -m gpu`, skipped without one) and, for the FP8 outputs, under Triton's
interpreter on the CPU (marker `interpreter`: in the process tests/kernels/test_interpreter.py starts)."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, gpu_cases, interpreted, on_gpu, rel_err
from kiln.kernels import ReferenceOps, quant, reference
from kiln.kernels.rotary import rope_cos_sin

CUDA = torch.device("cuda")


@pytest.mark.parametrize("rows, cols", gpu_cases([(1, 4096), (7, 576), (300, 8192), (33, 5120)],
                                                 default=[(1, 4096), (300, 8192)]))
def test_norm_activation_and_rope_kernels(rows, cols):
    from kiln.kernels.triton import norms
    from kiln.kernels.triton.rope_cache import rope_and_cache

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn((rows, cols), generator=g, device=CUDA).bfloat16()
    r = torch.randn((rows, cols), generator=g, device=CUDA).bfloat16()
    w = torch.randn(cols, generator=g, device=CUDA).bfloat16()
    out, res = norms.add_rms_norm(x, r.clone(), w, 1e-5)
    ref_out, ref_res = reference.add_rms_norm(x, r, w, 1e-5)
    assert rel_err(out, ref_out) < 1e-2 and rel_err(res, ref_res) < 1e-2
    assert rel_err(norms.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5)) < 1e-2
    gate_up = torch.randn((rows, 2 * cols), generator=g, device=CUDA).bfloat16()
    assert rel_err(norms.silu_and_mul(gate_up), reference.silu_and_mul(gate_up.float())) < 1e-2
    for heads, kv_heads, dim in ((32, 8, 128), (9, 3, 64)):
        qkv = torch.randn((rows, (heads + 2 * kv_heads) * dim), generator=g, device=CUDA).bfloat16()
        positions = torch.randint(0, 4000, (rows,), device=CUDA)
        table = rope_cos_sin(4096, dim, 500000.0, None).to(CUDA)
        cache = torch.zeros((2, rows + 3, 16, kv_heads, dim), device=CUDA, dtype=torch.bfloat16)
        ref_cache = cache.clone()
        slots = torch.randperm((rows + 3) * 16, device=CUDA)[:rows]
        q = rope_and_cache(qkv, positions, table, cache, slots, heads, kv_heads, dim)
        qq, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        q_ref, k_ref = reference.rotary(qq.view(rows, heads, dim), k.view(rows, kv_heads, dim), positions, table)
        reference.write_kv(k_ref, v.view(rows, kv_heads, dim), ref_cache, slots)
        assert rel_err(q, q_ref) < 1e-2 and rel_err(cache, ref_cache) < 1e-2



def _carry_dropped(q: torch.Tensor, ref_q: torch.Tensor) -> torch.Tensor:
    """Elements the interpreter's e4m3 cast rounded up to a power of two without the carry (the GPU's does not)."""
    return (torch.frexp(ref_q)[0].abs() == 0.5) & (q == ref_q / 2)


def _one_step(q: torch.Tensor, ref_q: torch.Tensor) -> torch.Tensor:
    """Elements within one e4m3 step of the reference."""
    return (q - ref_q).abs() <= ref_q.abs() / 8 + 2 ** -9


# backend: (rows × columns of x, x's dtype)
FP8_ROWS = {"interpreter": (((6, 300),), torch.float32),
            "cuda": (((1, 4096), (37, 14336), (512, 576)), torch.bfloat16)}


@pytest.mark.parametrize("backend, static", [interpreted(False), interpreted(True), on_gpu(False), on_gpu(True)])
def test_fp8_activation_quantization_kernel(backend, static):
    """Per-token e4m3 rows of x, divided by a smoother or not, scaled per token or by a static scale: the values
    and scales of quant.quantize_activations_fp8. The GPU's torch divides by 448 as a product with its reciprocal:
    scales may differ in the last bit, and an element on a rounding boundary by one e4m3 step; the interpreter's e4m3
    cast can drop the carry when it rounds up to a power of two."""
    from kiln.kernels.triton.norms import quantize_fp8_rows

    device = DEVICE[backend]
    shapes, dtype = FP8_ROWS[backend]
    g = torch.Generator(device=device).manual_seed(9)
    for rows, cols in shapes:
        x = (torch.randn((rows, cols), generator=g, device=device) * 3).to(dtype)
        smoother = torch.rand(cols, generator=g, device=device) + 0.5
        scale = (x.float() / smoother).abs().max().reshape(1) / quant.FP8_MAX if static else None
        for sm in (None, smoother):
            q, s = quantize_fp8_rows(x, sm, scale)
            ref_q, ref_s = quant.quantize_activations_fp8(x.float() if sm is None else x.float() / sm, scale)
            q, ref_q = q.float(), ref_q.float()
            differ = q != ref_q
            assert s.shape == (rows, 1)
            if backend == "interpreter":
                assert torch.allclose(s, ref_s.expand(rows, 1), rtol=1e-6)
                assert _carry_dropped(q, ref_q)[differ].all()
            else:
                assert torch.allclose(s, ref_s.expand(rows, 1), rtol=2e-7, atol=0)
                assert differ.float().mean() < 1e-3 and _one_step(q, ref_q)[differ].all()


# backend: (rows, hidden size, intermediate size, dtype, relative tolerance of the scales)
FP8_OUTPUT = {"interpreter": ((5,), 96, 80, torch.float32, 1e-5),
              "cuda": ((1, 37, 512), 4096, 14336, torch.bfloat16, 1e-2)}


@pytest.mark.parametrize("backend", [interpreted(), on_gpu()])
def test_norm_and_silu_kernels_with_fp8_output(backend):
    """The RMSNorm (with and without the residual) and SiLU kernels' per-token e4m3 output against the reference
    ops on the same inputs (quant.Fp8Rows.of the unfused output): the same values (95%; the others within one e4m3
    step: exp's last bits may differ, or the interpreter's cast drop a carry) and scales; the residual sum the
    unfused kernel's (bit for bit on the GPU). On the GPU an FP8 per-token layer fed by them against the same layer
    quantizing its own input."""
    from kiln.kernels.triton import norms
    from kiln.kernels.triton.quant_linear import QuantProducts

    device = DEVICE[backend]
    shapes, hidden, inter, dtype, scale_rtol = FP8_OUTPUT[backend]
    g = torch.Generator(device=device).manual_seed(11)
    for rows in shapes:
        x = (torch.randn((rows, hidden), generator=g, device=device) * 2).to(dtype)
        res = torch.randn((rows, hidden), generator=g, device=device).to(dtype)
        w = (torch.rand(hidden, generator=g, device=device) + 0.5).to(dtype)
        gate_up = (torch.randn((rows, 2 * inter), generator=g, device=device) * 3).to(dtype)
        fused, fused_res = norms.add_rms_norm_fp8(x, res.clone(), w, 1e-5)
        ref, ref_res = ReferenceOps.add_rms_norm_fp8(x, res, w, 1e-5)
        assert torch.equal(fused_res, ref_res) if backend == "cuda" else torch.allclose(fused_res, ref_res)
        for out, expected in ((fused, ref), (norms.rms_norm_fp8(x, w, 1e-5), ReferenceOps.rms_norm_fp8(x, w, 1e-5)),
                              (norms.silu_and_mul_fp8(gate_up), ReferenceOps.silu_and_mul_fp8(gate_up))):
            assert out.dtype == expected.dtype == dtype and out.shape == expected.shape
            assert torch.allclose(out.scale, expected.scale, rtol=scale_rtol)
            q, ref_q = out.values.float(), expected.values.float()
            near = _one_step(q, ref_q) | (_carry_dropped(q, ref_q) if backend == "interpreter" else False)
            assert (q == ref_q).float().mean() > 0.95 and near.all()
        if backend == "cuda":                    # FP8 products: torch._scaled_mm
            wq, ws = quant.quantize_fp8(torch.randn((1024, hidden), generator=g, device=device))
            params = {"weight": wq, "weight_scale": ws}
            linear = QuantProducts().linear
            plain = linear(reference.add_rms_norm(x, res, w, 1e-5)[0], "FP8_PER_CHANNEL_PER_TOKEN", params, None)
            assert rel_err(linear(fused, "FP8_PER_CHANNEL_PER_TOKEN", params, None), plain) < 2e-2
