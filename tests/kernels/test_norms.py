"""The norm, activation, rotary and per-token FP8 kernels (kernels/triton/norms.py, rope_cache.py) and greedy
decoding's argmax (argmax.py) on the GPU (`pytest -m gpu`, skipped without one) against the torch reference."""
from __future__ import annotations

import pytest
import torch

from conftest import rel_err
from kiln.kernels import reference
from kiln.kernels.rotary import rope_cos_sin

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("rows, cols", [(1, 4096), (7, 576), (300, 8192), (33, 5120)])
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


@pytest.mark.parametrize("static", [False, True])
def test_fp8_activation_quantization_kernel(static):
    from kiln.kernels import quant
    from kiln.kernels.triton.norms import quantize_fp8_rows

    g = torch.Generator(device="cuda").manual_seed(9)
    for rows, cols in ((1, 4096), (37, 14336), (512, 576)):
        x = (torch.randn((rows, cols), generator=g, device=CUDA) * 3).bfloat16()
        smoother = torch.rand(cols, generator=g, device=CUDA) + 0.5
        scale = (x.float() / smoother).abs().max().reshape(1) / quant.FP8_MAX if static else None
        for sm in (None, smoother):
            q, s = quantize_fp8_rows(x, sm, scale)
            ref_q, ref_s = quant.quantize_activations_fp8(x.float() if sm is None else x.float() / sm, scale)
            # torch divides by 448 on the GPU as a product with its reciprocal: scales may differ in the last bit,
            # and an element on a rounding boundary by one e4m3 step
            assert torch.allclose(s, ref_s.expand(rows, 1), rtol=2e-7, atol=0)
            differ = q.float() != ref_q.float()
            assert differ.float().mean() < 1e-3
            assert ((q.float() - ref_q.float()).abs() <= ref_q.float().abs() / 8 + 2 ** -9)[differ].all()


def test_norm_and_silu_kernels_with_fp8_output():
    """The fused per-token e4m3 outputs of RMSNorm (± residual) and SiLU against the reference ops on the same bf16
    inputs, and an FP8 per-token layer fed by them against the same layer quantizing its own input."""
    from kiln.kernels import ReferenceOps, quant
    from kiln.kernels.triton import norms
    from kiln.kernels.triton.quant_linear import QuantProducts

    g = torch.Generator(device="cuda").manual_seed(11)
    for rows in (1, 37, 512):
        x = (torch.randn((rows, 4096), generator=g, device=CUDA) * 2).bfloat16()
        res = torch.randn((rows, 4096), generator=g, device=CUDA).bfloat16()
        w = (torch.rand(4096, generator=g, device=CUDA) + 0.5).bfloat16()
        gate_up = (torch.randn((rows, 2 * 14336), generator=g, device=CUDA) * 3).bfloat16()
        fused, fused_res = norms.add_rms_norm_fp8(x, res.clone(), w, 1e-5)
        ref, ref_res = ReferenceOps.add_rms_norm_fp8(x, res, w, 1e-5)
        assert torch.equal(fused_res, ref_res)
        for out, expected in ((fused, ref), (norms.rms_norm_fp8(x, w, 1e-5), ReferenceOps.rms_norm_fp8(x, w, 1e-5)),
                              (norms.silu_and_mul_fp8(gate_up), ReferenceOps.silu_and_mul_fp8(gate_up))):
            assert torch.allclose(out.scale, expected.scale, rtol=1e-2)
            q, ref_q = out.values.float(), expected.values.float()
            assert (q == ref_q).float().mean() > 0.95 and ((q - ref_q).abs() <= ref_q.abs() / 8 + 2 ** -9).all()
        weight = torch.randn((1024, 4096), generator=g, device=CUDA)
        wq, ws = quant.quantize_fp8(weight)
        params = {"weight": wq, "weight_scale": ws}
        linear = QuantProducts().linear
        plain = linear(reference.add_rms_norm(x, res, w, 1e-5)[0], "FP8_PER_CHANNEL_PER_TOKEN", params, None)
        assert rel_err(linear(fused, "FP8_PER_CHANNEL_PER_TOKEN", params, None), plain) < 2e-2


def test_argmax_rows_is_torchs():
    """Greedy decoding's argmax on the 8B vocabulary (not a whole number of chunks): equal to torch.argmax for 1-64
    bf16 rows, ties going to the first column."""
    from kiln.kernels.triton.argmax import argmax_rows

    g = torch.Generator(device="cuda").manual_seed(3)
    for rows in (1, 2, 7, 64):
        x = torch.randn((rows, 128256), generator=g, device=CUDA).bfloat16()
        x[0, [128255, 77, 90000]] = 100.0
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), rows
