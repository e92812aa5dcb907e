"""The torch reference kernels against float64 references written independently here (and transformers' rope)."""
from __future__ import annotations

import math

import pytest
import torch

from kiln.kernels import AttentionMetadata, rope_cos_sin, rope_inv_freq
from kiln.kernels import reference as ops


def _naive_attention(q, k, v, q_pos, window):
    """float64 attention of one sequence: q (Q, H, D) at positions q_pos over k, v (K, KH, D)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(heads // kv_heads, 1)
    v = v.double().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    j = torch.arange(k.shape[0])
    allowed = j[None, :] <= q_pos[:, None]
    if window:
        allowed &= j[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads, kv_heads, head_dim, block, window",
                         [(4, 4, 16, 16, None), (8, 2, 32, 32, None), (8, 1, 64, 8, 20)])
def test_paged_attention_matches_naive(heads, kv_heads, head_dim, block, window):
    g = torch.Generator().manual_seed(heads * block)
    # (tokens already cached, new tokens) per sequence: decode, fresh prompt, chunk after a cached prefix.
    seqs = [(40, 1), (0, 37), (23, 9), (5, 1)]
    num_blocks = 64
    cache = torch.randn(2, num_blocks, block, kv_heads, head_dim, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()                  # scattered blocks
    tables, slots, starts, qs, positions = [], [], [0], [], []
    for cached, new in seqs:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // block))]
        tables.append(blocks)
        slots += [blocks[i // block] * block + i % block for i in range(cached, total)]
        starts.append(starts[-1] + new)
        positions.append(torch.arange(cached, total))
    q = torch.randn(starts[-1], heads, head_dim, generator=g)
    k_new = torch.randn(starts[-1], kv_heads, head_dim, generator=g)
    v_new = torch.randn(starts[-1], kv_heads, head_dim, generator=g)
    width = max(map(len, tables))
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor(starts), torch.tensor([c + n for c, n in seqs]),
                             torch.tensor([t + [0] * (width - len(t)) for t in tables]), max(n for _, n in seqs),
                             max(c + n for c, n in seqs), block)
    ops.write_kv(k_new, v_new, cache, meta.slot_mapping)
    out = ops.paged_attention(q, cache, meta, head_dim ** -0.5, window)
    for b, ((cached, new), table) in enumerate(zip(seqs, tables)):
        idx = torch.tensor([table[i // block] * block + i % block for i in range(cached + new)])
        k_all, v_all = cache[0].flatten(0, 1)[idx], cache[1].flatten(0, 1)[idx]
        ref = _naive_attention(q[starts[b]:starts[b + 1]], k_all, v_all, positions[b], window)
        assert torch.allclose(out[starts[b]:starts[b + 1]].double(), ref, atol=1e-5, rtol=1e-5)


def test_rms_norm_and_residual():
    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g), torch.randn(64, generator=g)
    s = x.double() + r.double()
    ref = w.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    out, residual = ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.allclose(out.double(), ref, atol=1e-5) and torch.allclose(residual.double(), s, atol=1e-6)


@pytest.mark.parametrize("scaling", [None, {"type": "linear", "factor": 4.0},
                                     {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}])
def test_rope_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default", "rope_theta": 500000.0}
    if scaling:
        params.update({k: v for k, v in scaling.items() if k != "type"}, rope_type=scaling["type"])
    config = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=params, max_position_embeddings=131072)
    if scaling:
        ref, _ = ROPE_INIT_FUNCTIONS[scaling["type"]](config, "cpu")
    else:
        ref = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    assert torch.allclose(rope_inv_freq(128, 500000.0, scaling), ref, rtol=1e-6)


def test_rotary_rotates_pairs_of_halves():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 2, 8, generator=g), torch.randn(3, 1, 8, generator=g)
    positions = torch.tensor([0, 5, 11])
    table = rope_cos_sin(16, 8, 10000.0, None)
    q_rot, k_rot = ops.rotary(q, k, positions, table)
    theta = positions[:, None].double() * (1.0 / 10000.0 ** (torch.arange(0, 8, 2).double() / 8))  # (T, 4)
    x1, x2 = q.double()[..., :4], q.double()[..., 4:]
    cos, sin = theta.cos()[:, None], theta.sin()[:, None]
    ref = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    assert torch.allclose(q_rot.double(), ref, atol=1e-6)
    assert torch.equal(q_rot[0], q[0])  # position 0 is the identity


def test_moe_matches_per_token_loop():
    g = torch.Generator().manual_seed(0)
    t, h, i, e, k = 7, 16, 24, 4, 2
    x, router = torch.randn(t, h, generator=g), torch.randn(e, h, generator=g)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1
    out = ops.moe(x, router, gate_up, down, k, renormalize=True)
    for n in range(t):
        probs = (router.double() @ x[n].double()).softmax(-1)
        top = probs.topk(k)
        expected = torch.zeros(h, dtype=torch.float64)
        for weight, expert in zip(top.values / top.values.sum(), top.indices):
            gu = gate_up[expert].double() @ x[n].double()
            act = torch.nn.functional.silu(gu[:i]) * gu[i:]
            expected += weight * (down[expert].double() @ act)
        assert torch.allclose(out[n].double(), expected, atol=1e-5)


@pytest.mark.parametrize("algo, fused", [("FP8_PER_CHANNEL_PER_TOKEN", True), ("FP8", False)])
def test_fp8_activations_quantized_by_the_kernel_that_makes_them(tiny_models, algo, fused):
    """With per-token FP8 activations the norms and SiLU hand their layers e4m3 rows (quant.Fp8Rows): the fusion pass
    puts Fp8Norm / Fp8Silu in place exactly where the layer takes such rows (not with static scales), and the logits
    equal those of the same network quantizing inside each layer."""
    from kiln.config import QuantConfig
    from kiln.kernels.fusion import Fp8Norm, Fp8Silu
    from kiln.models import LlamaForCausalLM
    from kiln.quantization import quantize_model

    model = LlamaForCausalLM.from_hugging_face(tiny_models["llama"][0], quiet=True)
    model = quantize_model(model, QuantConfig(algo), calib_size=2, quiet=True)
    logits = []
    for keep in (True, False):
        net = model.network_class.load(model.config, model.engine_weights(), 64)
        layers = list(net.layers.values())
        assert all((isinstance(layer.input_norm, Fp8Norm), isinstance(layer.post_attn_norm, Fp8Norm),
                    isinstance(layer.mlp.gate_up_proj, Fp8Silu)) == (fused,) * 3 for layer in layers)
        if fused and not keep:                          # back to the model's own modules
            for layer in layers:
                layer.input_norm, layer.post_attn_norm = layer.input_norm.norm, layer.post_attn_norm.norm
                layer.mlp.gate_up_proj = layer.mlp.gate_up_proj.linear
        n, c = 20, model.config
        t = torch.tensor
        meta = AttentionMetadata(t(list(range(n))), t([0, n]), t([n]), t([[0, 1]]), n, n, 16)
        caches = [torch.zeros((2, 2, 16, c.num_key_value_heads, c.head_dim)) for _ in layers]
        with torch.inference_mode():
            logits.append(net.compute_logits(net(t(list(range(3, 3 + n))), t(list(range(n))), meta, caches)))
    assert torch.equal(logits[0], logits[1])


def _folding_ops():
    """ReferenceOps folding the RMSNorm between every pair of quantized layers as int4_mma does, in torch: at one
    row the product added to the residual in place, returned with its sum of squares and its sum times the norm's
    weight; the layer after normalizes from those. `folded` counts the folds made."""
    from kiln.kernels import DeferredNorm, ReferenceOps, ResidualSum, quant, reference

    class FoldingOps(ReferenceOps):
        name = "folding"
        folded = 0

        def folds_norm(self, before, after):
            return True

        def quant_linear_before_norm(self, x, algo, params, bias, residual, norm_weight):
            if x.shape[0] > 1:
                return self.quant_linear(x, algo, params, bias)
            self.folded += 1
            residual += quant.quant_linear(x, algo, params, bias)
            return ResidualSum(residual, residual.float().pow(2).sum(-1, keepdim=True), norm_weight * residual)

        def quant_linear(self, x, algo, params, bias=None):
            if isinstance(x, DeferredNorm):
                x = reference.rms_norm(x.residual, x.weight, x.eps)
            return quant.quant_linear(x, algo, params, bias)

        def quant_linear_silu(self, x, algo, params, bias=None):
            return self.silu_and_mul(self.quant_linear(x, algo, params, bias))

    return FoldingOps()


def test_fusion_pass_folds_the_norms_where_the_ops_say_so(tiny_models):
    """With ops that fold (one rank): o_proj and down_proj hand their product to the norm after them (the next
    layer's input norm; none after the last layer, whose sum the final norm takes), which folds the residual add
    in at one row; the model's tokens are those of the reference ops, and the reference wires nothing."""
    from kiln import LLM, BuildConfig, SamplingConfig
    from kiln.config import QuantConfig
    from kiln.kernels import ReferenceOps
    from kiln.kernels.fusion import FoldedNorm, ProductBeforeNorm
    from kiln.models import LlamaForCausalLM
    from kiln.quantization import quantize_model
    from kiln.runtime import model_runner

    model = quantize_model(LlamaForCausalLM.from_hugging_face(tiny_models["llama"][0], quiet=True),
                           QuantConfig("W4A16", group_size=32), calib_size=2, quiet=True, round_to_nearest=True)
    build = BuildConfig(max_batch_size=2, max_input_len=16, max_seq_len=32)
    tokens = {}
    for ops in (ReferenceOps(), _folding_ops()):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(model_runner, "select_ops", lambda *args, ops=ops: ops)
            with LLM(model, build_config=build, device="cpu", quiet=True) as llm:
                layers = list(llm.core.runner.net.layers.values())
                folds = ops.name == "folding"
                assert all(isinstance(layer.post_attn_norm, FoldedNorm) == folds for layer in layers)
                assert [isinstance(layer.input_norm, FoldedNorm) for layer in layers] == [False] + [folds]
                assert [isinstance(layer.mlp.down_proj, ProductBeforeNorm) for layer in layers] == [folds, False]
                tokens[ops.name] = llm.generate([3, 4, 5, 6], SamplingConfig(max_new_tokens=6, end_id=-1)).token_ids
    assert tokens["folding"] == tokens["reference"] and ops.folded > 0


def test_every_pdl_kernel_waits_for_its_inputs():
    """A kernel launched with programmatic dependent launch may start before the kernel writing its inputs has
    finished: each one that takes PDL must wait for its inputs (wait_for_inputs(PDL), or griddepcontrol.wait in a
    Gluon kernel) — the paged attention kernel once did not."""
    import importlib
    import pkgutil

    triton = pytest.importorskip("triton")
    import kiln.kernels.triton as package

    kernels = [f for info in pkgutil.iter_modules(package.__path__)
               for f in vars(importlib.import_module(f"{package.__name__}.{info.name}")).values()
               if isinstance(f, triton.runtime.jit.JITFunction) and "PDL" in f.arg_names
               and f.__name__.endswith("_kernel")]
    assert len({k.__name__ for k in kernels}) >= 14
    for kernel in kernels:
        assert "wait_for_inputs(PDL)" in kernel.src or "griddepcontrol.wait" in kernel.src, kernel.__name__


def test_mma_decode_attention_ptx_operands_and_coverage():
    """The mma.sync decode kernel's inline PTX (built by functions, one per cache type) names exactly the operands
    its constraint strings declare, and the kernel takes exactly the decode steps it was written for (e4m3/int8
    caches, head dims 64/128, ≤ 8 query heads per KV head, blocks of whole 16-key chunks; never on a CPU)."""
    import re

    from kiln.kernels.triton import mma_decode_attention as mda

    for int8 in (False, True):
        for asm, operands in ((mda._score_asm(int8), 4 + 16), (mda._value_asm(int8), 8 + 14)):
            used = {int(n) for n in re.findall(r"\$(\d+)", asm)}
            assert used == set(range(operands)), (int8, sorted(set(range(operands)) ^ used))
            assert asm.count("mma.sync") == (4 if operands == 20 else 2)
        assert ("cvt.rn.f16x2.e4m3x2" in mda._score_asm(int8)) is not int8
    assert mda.takes(torch.float8_e4m3fn, 128, 4, 32) and mda.takes(torch.int8, 64, 8, 16)
    for args in ((torch.bfloat16, 128, 4, 32), (torch.float8_e4m3fn, 256, 4, 32), (torch.int8, 128, 16, 32),
                 (torch.float8_e4m3fn, 128, 4, 8), (torch.float8_e5m2, 128, 4, 32)):
        assert not mda.takes(*args), args
    assert not mda.available("cpu")
