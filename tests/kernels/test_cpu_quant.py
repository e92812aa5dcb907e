"""The CPU's quantized products (kiln.kernels.cpu.CpuOps): every mode and group size against the float64 product
of the dequantized weight, the fallbacks against the reference, a tiny model's greedy tokens against
ReferenceOps; and CpuOps' decode-step attention and rotary embedding against the reference's."""
from __future__ import annotations

import pytest
import torch

import kiln.runtime.model_runner
from kiln import LLM, BuildConfig, SamplingConfig
from kiln.config import QuantConfig
from kiln.kernels import AttentionMetadata, ReferenceOps, cpu, quant, reference, select_ops
from kiln.models import LlamaForCausalLM
from kiln.models.llama import QuantLinear
from kiln.quantization import quantize_model

ROWS = (1, 3, 17)
# (algo, group size, zero points): per channel, and per group with a short last group (576 = 4·128 + 64)
KERNEL_MODES = [("W8A16", None, False), ("W4A16", None, False)] + [
    ("W4A16_GPTQ" if not zero else "W4A16_AWQ", group, zero) for group in (32, 64, 128) for zero in (False, True)]
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])
BF16_PRODUCT_ERROR = 1e-2       # the kernels round x, the scales and the output to bfloat16 (~3e-3 measured)


def quantized(algo: str, w: torch.Tensor, group: int | None = None, zero: bool = False) -> dict:
    if algo == "W8A16" or algo.startswith("W8A8"):
        return dict(zip(("weight", "weight_scale"), quant.quantize_int8(w)))
    if algo.startswith("FP8"):
        return dict(zip(("weight", "weight_scale"), quant.quantize_fp8(w)))
    packed, scale, zero_point = quant.quantize_int4(w, group, zero)
    return {"weight": packed, "weight_scale": scale, **({"weight_zero": zero_point} if zero else {})}


def loaded(algo: str, params: dict, ops: cpu.CpuOps = cpu.CpuOps()) -> dict:
    """The parameters as QuantLinear hands them over after use_kernel_layout (None: a dropped buffer)."""
    layout, tensors = ops.pack_quant(algo, params)
    return {k: v for k, v in {**params, **tensors, "layout": layout}.items() if v is not None}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_select_ops_picks_the_cpu_kernels():
    assert isinstance(select_ops("cpu"), cpu.CpuOps) and isinstance(select_ops("cpu"), ReferenceOps)


@pytest.mark.parametrize("algo, group, zero", KERNEL_MODES)
def test_kernel_products_match_the_float64_product(algo, group, zero):
    if TORCH_VERSION < (2, 6):
        pytest.skip("the CPU int4 kernel came with torch 2.6 (the dense fallback is tested below)")
    g = torch.Generator().manual_seed(KERNEL_MODES.index((algo, group, zero)))
    w, bias = torch.randn(96, 576, generator=g) * 0.05, torch.randn(96, generator=g)
    params = quantized(algo, w, group, zero)
    weights = loaded(algo, params)
    assert weights["layout"] == (cpu.INT8_LAYOUT if algo == "W8A16" else cpu.INT4_LAYOUT)
    dequantized = quant.dequantize_weight(algo, params).double()
    for rows in ROWS:
        x = torch.randn(rows, 576, generator=g) * 2
        out = cpu.CpuOps().quant_linear(x, algo, weights, bias)
        assert out.dtype == x.dtype and out.shape == (rows, 96)
        assert rel_err(out, x.double() @ dequantized.t() + bias.double()) < BF16_PRODUCT_ERROR, rows
        assert rel_err(cpu.CpuOps().quant_linear(x.bfloat16(), algo, weights), x.double() @ dequantized.t()) < 2e-2


@pytest.mark.parametrize("out_features, in_features, group", [(40, 576, 128), (96, 80, None), (96, 48, 16)])
def test_shapes_the_int4_kernel_refuses_use_the_dequantized_weight(out_features, in_features, group):
    """Rows not a multiple of 16; no kernel group size (32..256) dividing both the input size and ours."""
    g = torch.Generator().manual_seed(in_features)
    params = quantized("W4A16_AWQ", torch.randn(out_features, in_features, generator=g), group, True)
    weights = loaded("W4A16_AWQ", params)
    assert weights["layout"] == cpu.DENSE_LAYOUT and set(weights) == {"weight", "layout"}
    x = torch.randn(3, in_features, generator=g)
    ref = x.double() @ quant.dequantize_weight("W4A16_AWQ", params).double().t()
    assert rel_err(cpu.CpuOps().quant_linear(x, "W4A16_AWQ", weights), ref) < 1e-6


@pytest.mark.parametrize("algo", ["FP8", "FP8_PER_CHANNEL_PER_TOKEN", "W8A8_SQ_PER_CHANNEL",
                                  "W8A8_SQ_PER_CHANNEL_PER_TOKEN"])
def test_activation_quantized_modes_compute_as_the_reference(algo):
    """FP8 and W8A8 layers keep the reference's arithmetic on a weight dequantized once (smoother, static scale
    and FP8 rows made by the op before included)."""
    g = torch.Generator().manual_seed(len(algo))
    w, x, bias = torch.randn(48, 128, generator=g), torch.randn(17, 128, generator=g) * 3, torch.randn(48, generator=g)
    params = {**quantized(algo, w), "smoother": torch.rand(128, generator=g) + 0.5}
    if not algo.endswith("PER_TOKEN"):
        params["input_scale"] = (x / params["smoother"]).abs().max().reshape(1) / (127 if "W8A8" in algo else 448)
    weights = loaded(algo, params)
    assert weights["layout"] == cpu.DENSE_LAYOUT
    for rows in ROWS:
        ref = quant.quant_linear(x[:rows], algo, params, bias)
        assert rel_err(cpu.CpuOps().quant_linear(x[:rows], algo, weights, bias), ref) < 1e-6
    del params["smoother"], weights["smoother"]
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        rows = quant.Fp8Rows.of(x)
        assert rel_err(cpu.CpuOps().quant_linear(rows, algo, weights), quant.quant_linear(rows, algo, params, None)) < 1e-6


def test_a_torch_without_the_kernels_falls_back_to_the_dequantized_weight():
    """CpuOps over an int4 product that this torch lacks (as torch < 2.6 lacks aten._weight_int4pack_mm_for_cpu):
    the check finds it missing, and the layer keeps the dequantized weight; the int8 product is unaffected."""
    def missing(*args):
        raise AttributeError("'_OpNamespace' 'aten' object has no attribute '_weight_int4pack_mm_for_cpu'")

    ops = cpu.CpuOps(cpu.CpuKernels(int4=missing))
    assert not cpu.kernel_works(missing, 4)
    params = quantized("W4A16_AWQ", torch.randn(96, 128), 32, True)
    assert loaded("W4A16_AWQ", params, ops)["layout"] == cpu.DENSE_LAYOUT
    assert rel_err(ops.quant_linear(torch.ones(2, 128), "W4A16_AWQ", loaded("W4A16_AWQ", params, ops)),
                   torch.ones(2, 128).double() @ quant.dequantize_weight("W4A16_AWQ", params).double().t()) < 1e-6
    if TORCH_VERSION >= (2, 6):
        assert loaded("W4A16_AWQ", params)["layout"] == cpu.INT4_LAYOUT
    assert loaded("W8A16", quantized("W8A16", torch.randn(96, 128)), ops)["layout"] == cpu.INT8_LAYOUT


@pytest.mark.parametrize("algo, layout", [("W8A16", cpu.INT8_LAYOUT), ("W4A16", cpu.INT4_LAYOUT),
                                          ("W4A16_AWQ", cpu.INT4_LAYOUT), ("FP8_PER_CHANNEL_PER_TOKEN", cpu.DENSE_LAYOUT)])
def test_tiny_model_decodes_as_on_the_reference_ops(tiny_models, monkeypatch, algo, layout):
    """Greedy tokens with CpuOps equal ReferenceOps' (float32). The kernels round activations to bfloat16: where
    the two part, CpuOps' choice must be among the reference's best tokens, a near-tie with its first (a random model's
    logits are close to uniform); after that the sequences differ legitimately."""
    hf_dir, _ = tiny_models["llama"]
    model = quantize_model(LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True), QuantConfig(algo, group_size=32),
                           calib_size=2, quiet=True, round_to_nearest=True)      # AWQ's search: seconds for nothing
    build = BuildConfig(max_batch_size=4, max_input_len=64, max_seq_len=128)
    prompts = [list(range(3, 3 + n)) for n in (1, 9, 40)]
    sampling = SamplingConfig(max_new_tokens=16, end_id=-1, logprobs=5)
    outputs, layouts = {}, {}
    for ops in (ReferenceOps, cpu.CpuOps):
        monkeypatch.setattr(kiln.runtime.model_runner, "select_ops", lambda *args, ops=ops: ops())
        with LLM(model, build_config=build, device="cpu", quiet=True) as llm:
            outputs[ops.name] = [out.outputs[0] for out in llm.generate(prompts, sampling)]
            layouts[ops.name] = {m.layout for m in llm.core.runner.net.modules() if isinstance(m, QuantLinear)}
    assert layouts == {"reference": {None}, "cpu": {layout}}
    parted = 0
    for ref, fast in zip(outputs["reference"], outputs["cpu"]):
        parted += _same_greedy_tokens_up_to_ties(ref, fast)
    assert parted <= 1, parted


def _same_greedy_tokens_up_to_ties(ref, fast, tie: float = 2e-2) -> bool:
    """Whether the two parted (only ever where the reference's logprob of CpuOps' choice is within `tie` of its
    best one)."""
    parted = next((i for i, (a, b) in enumerate(zip(ref.token_ids, fast.token_ids)) if a != b), None)
    if parted is None:
        return False
    top = ref.logprobs[parted].top
    assert fast.token_ids[parted] in top, (parted, top, fast.token_ids[parted])
    assert abs(top[fast.token_ids[parted]] - top[ref.token_ids[parted]]) < tie, (parted, top)
    return True


@pytest.mark.parametrize("algo", ["W8A16", "W4A16_AWQ"])
def test_tensors_off_alignment_are_copied_first(algo):
    """A weight memory-mapped from an engine file, or an input that is a view into a larger tensor, may start off
    torch's 64-byte alignment: the kernels crash on those (a SIGSEGV here)."""
    g = torch.Generator().manual_seed(7)
    params = quantized(algo, torch.randn(128, 64, generator=g), 32, True)
    params["weight"] = torch.cat([torch.zeros(8, dtype=params["weight"].dtype), params["weight"].flatten()])[8:].view(
        params["weight"].shape)
    x = torch.randn(55 * 64 + 4, generator=g).bfloat16()[4:].view(55, 64)
    assert params["weight"].data_ptr() % 64 and x.data_ptr() % 64
    ref = x.double() @ quant.dequantize_weight(algo, params).double().t()
    assert rel_err(cpu.CpuOps().quant_linear(x, algo, loaded(algo, params)), ref) < BF16_PRODUCT_ERROR


def test_cpu_kernels_chosen_by_plugin_config():
    from kiln.config import PluginConfig
    from kiln.kernels import ReferenceOps, select_ops
    from kiln.kernels.cpu import CpuOps

    assert type(select_ops("cpu")) is CpuOps
    assert type(select_ops("cpu", cpu_kernels="reference")) is ReferenceOps
    with pytest.raises(ValueError, match="cpu_kernels"):
        select_ops("cpu", cpu_kernels="quick")
    with pytest.raises(ValueError, match="cpu_kernels"):
        PluginConfig(cpu_kernels="quick")


@pytest.mark.parametrize("lens, tables", [([1, 19, 40], [[5], [2, 7], [0, 3, 6]]),   # gathered blocks
                                          ([40], [[3, 4, 5]]),                         # one sequence: a view
                                          ([40], [[3, 5, 4]])])                        # one, out of order
@pytest.mark.parametrize("kv_heads, window, kv_dtype", [(3, None, torch.float32), (1, 7, torch.float32),
                                                        (3, None, torch.int8)])
def test_decode_steps_attend_and_rotate_as_the_reference(kv_heads, window, kv_dtype, lens, tables):
    """A decode step of three sequences (1, 19 and 40 keys, blocks of 16, a padded block table) or of one (its blocks
    in order: read as a view of the cache, or not): CpuOps' rotary embedding and cache write equal ReferenceOps' bit
    for bit, its attention the reference's (GQA or one KV head, a sliding window, an int8 cache with scales)."""
    g = torch.Generator().manual_seed(kv_heads)
    heads, dim, block = 9, 64, 16
    meta = AttentionMetadata(torch.tensor([t[(n - 1) // block] * block + (n - 1) % block for t, n in zip(tables, lens)]),
                             torch.arange(len(lens) + 1), torch.tensor(lens),
                             torch.tensor([t + [1] * (3 - len(t)) for t in tables]), 1, max(lens), block)
    filled = torch.randn(2, 8, block, kv_heads, dim, generator=g)
    kv_scale = torch.tensor([0.05, 0.04]) if kv_dtype == torch.int8 else None
    caches = []
    for _ in range(2):
        cache = reference.quantize_kv(filled, kv_scale[0] if kv_scale is not None else None, kv_dtype)
        caches.append(cache.clone())
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, generator=g)
    positions = torch.tensor(lens) - 1
    cos_sin = torch.randn(64, dim, generator=g)
    q_ref = ReferenceOps.rope_and_cache(qkv, meta, positions, cos_sin, caches[0], heads, kv_heads, dim, kv_scale)
    meta.scratch.clear()
    q_cpu = cpu.CpuOps.rope_and_cache(qkv, meta, positions, cos_sin, caches[1], heads, kv_heads, dim, kv_scale)
    assert torch.equal(q_cpu, q_ref) and torch.equal(caches[1], caches[0])
    ref = reference.paged_attention(q_ref, caches[0], meta, dim ** -0.5, window, kv_scale)
    out = cpu.CpuOps().attention(q_cpu, caches[1], meta, dim ** -0.5, window, kv_scale)
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert isinstance(meta.scratch["cpu_decode"][0], int) == (tables == [[3, 4, 5]])      # the view, where it applies
