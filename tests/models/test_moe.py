"""Mixture-of-experts models: quantized experts end to end on the CPU (convert → checkpoint → build → generate,
against the float model their dequantized weights make, TP=2 against TP=1), and a tiny Mixtral's greedy tokens on the
GPU against the CPU path (`pytest -m gpu`, skipped without one). The MoE kernels: tests/kernels/test_fused_moe.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import gpu_cases, rel_err, tiny_mixtral
from kiln import LLM, BuildConfig, SamplingConfig, build
from kiln.config import Mapping, ParallelConfig, PluginConfig, PretrainedConfig, QuantConfig
from kiln.convert import convert
from kiln.kernels import quant, reference
from kiln.models import LlamaForCausalLM

EXPERT_MODES = ["W8A16", "W4A16", "W4A16_GPTQ", "W4A16_AWQ", "FP8", "FP8_PER_CHANNEL_PER_TOKEN"]
WEIGHT_ONLY = [m for m in EXPERT_MODES if not m.startswith("FP8")]


# --- quantized Mixtral end to end ------------------------------------------------------------------------------
def _dequantized(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The float model whose weights are the matrices `model`'s quantized tensors stand for (experts stacked)."""
    algo, weights = model.config.quantization.quant_algo, dict(model.weights)
    for name in [n for n in weights if n.endswith(".weight_scale")]:
        base = name.removesuffix(".weight_scale")
        params = {key: weights.pop(f"{base}.{key}") for key in ("weight", "weight_scale", "weight_zero", "input_scale")
                  if f"{base}.{key}" in weights}
        if ".moe." in base:
            experts = params["weight"].shape[0]
            weights[base] = torch.stack([quant.dequantize_weight(algo, reference.expert_params(params, e))
                                         for e in range(experts)])
        else:
            weights[base + ".weight"] = quant.dequantize_weight(algo, params)
    config = dataclasses.replace(model.config, quantization=QuantConfig())
    return LlamaForCausalLM(config, weights, model.tokenizer_files, source="dequantized")


BUILD = BuildConfig(max_batch_size=2, max_input_len=64, max_seq_len=128, gather_context_logits=True)
# the CPU on the exact reference products (CpuOps computes int8/int4 layers in bf16)
REFERENCE_BUILD = dataclasses.replace(BUILD, plugin_config=PluginConfig(cpu_kernels="reference"))
PROMPTS = [list(range(5, 45)), list(range(100, 109))]


def _generate(model, parallel: ParallelConfig | None = None, build_config: BuildConfig = REFERENCE_BUILD):
    with LLM(model, build_config=build_config, quiet=True, parallel_config=parallel) as llm:
        return llm.generate(PROMPTS, SamplingConfig(max_new_tokens=8, end_id=-1))


@pytest.mark.parametrize("algo", EXPERT_MODES)
def test_quantized_mixtral_round_trip(tiny_models, tmp_path, algo):
    """Every expert mode through convert → checkpoint → build → generate: the checkpoint's tensors come back
    exactly, logits stay within the mode's tolerance of transformers' float model, and weight-only modes give the
    greedy tokens (and logits) of the float model made of their dequantized weights."""
    hf_dir, hf_model = tiny_models["mixtral"]
    model = convert(hf_dir, quant_config=QuantConfig(algo, group_size=32), calib_size=2, quiet=True)
    assert model.weights["layers.0.moe.gate_proj.weight"].shape[:2] == (4, 128)
    model.save_checkpoint(tmp_path / "ckpt")
    reloaded = LlamaForCausalLM.from_checkpoint(tmp_path / "ckpt")
    for name, tensor in model.weights.items():
        assert torch.equal(reloaded.weights[name], tensor), name
    build(reloaded, REFERENCE_BUILD, quiet=True).save(tmp_path / "engine")
    with LLM(tmp_path / "engine", quiet=True) as llm:
        outputs = llm.generate(PROMPTS, SamplingConfig(max_new_tokens=8, end_id=-1))
    with torch.no_grad():
        ref = hf_model(torch.tensor([PROMPTS[0]])).logits[0]
    assert rel_err(outputs[0].context_logits, ref) < (0.35 if algo.startswith("W4A16") else 0.1)
    if algo in WEIGHT_ONLY:
        for out, deq in zip(outputs, _generate(_dequantized(model))):
            assert out.token_ids == deq.token_ids
            assert rel_err(out.context_logits, deq.context_logits) < 1e-5


def test_moe_quantization_refusals(tiny_models):
    hf_dir, _ = tiny_models["mixtral"]
    model = LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True)
    with pytest.raises(ValueError, match="MoE experts take W8A16, W4A16\\*, FP8\\* .* not W8A8_SQ_PER_CHANNEL"):
        dataclasses.replace(model.config, quantization=QuantConfig("W8A8_SQ_PER_CHANNEL"))
    with pytest.raises(ValueError, match="learned_rounding_steps is not supported for MoE models"):
        dataclasses.replace(model.config, quantization=QuantConfig("W4A16_AWQ", learned_rounding_steps=2))
    excluded = QuantConfig("W8A8_SQ_PER_CHANNEL_PER_TOKEN", exclude_modules=["lm_head", "gate_up_proj", "down_proj"])
    assert isinstance(dataclasses.replace(model.config, quantization=excluded), PretrainedConfig)



def _quantized_mixtral(tiny_models, algo: str, tp_mode: int) -> LlamaForCausalLM:
    """The tiny Mixtral's weights rounded to nearest in `algo` (groups of 32), its experts split by `tp_mode`."""
    from kiln.quantization import quantize_model

    hf_dir, _ = tiny_models["mixtral"]
    model = LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True)
    model = LlamaForCausalLM(dataclasses.replace(model.config, moe_tp_mode=tp_mode), model.weights,
                             model.tokenizer_files)
    return quantize_model(model, QuantConfig(algo, group_size=32), calib_size=2, quiet=True, round_to_nearest=True)


@pytest.mark.parametrize("tp_mode", [0, 1])
def test_quantized_experts_shard_by_expert_or_by_slice(tiny_models, tp_mode):
    """Two ranks' shards of W4A16_AWQ experts put back together are the whole: experts split between ranks (mode
    0), or gate/up rows and down's packed input columns with their groups' scales and zeros (mode 1)."""
    model = _quantized_mixtral(tiny_models, "W4A16_AWQ", tp_mode)
    shards = [model.shard(Mapping(2, r, 2, 1)).weights for r in range(2)]
    for name, tensor in model.weights.items():
        if ".moe." in name and "router" not in name:
            dim = 0 if tp_mode == 0 else 2 if "down_proj" in name else 1
            assert torch.equal(torch.cat([s[name] for s in shards], dim=dim), tensor), name


def test_kiln_convert_quantizes_and_shards_experts(tiny_models, tmp_path):
    """`kiln convert` with int4 AWQ flags, two ranks, experts split by slice: each rank's checkpoint holds half of
    every expert's gate/up rows and of down's packed inputs and group scales."""
    from kiln.cli.main import main

    hf_dir, _ = tiny_models["mixtral"]
    assert main(["convert", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "c"), "--use_weight_only",
                 "--weight_only_precision", "int4_awq", "--per_group", "--group_size", "32", "--calib_size", "2",
                 "--tp_size", "2", "--moe_tp_mode", "1"]) == 0
    rank1 = LlamaForCausalLM.from_checkpoint(tmp_path / "c", rank=1)
    assert rank1.config.quantization.quant_algo == "W4A16_AWQ" and rank1.config.moe_tp_mode == 1
    shapes = {name: tuple(t.shape) for name, t in rank1.weights.items() if name.startswith("layers.0.moe.")}
    assert shapes["layers.0.moe.gate_proj.weight"] == (4, 64, 32)          # 128 rows / 2 ranks, 64 inputs / 2
    assert shapes["layers.0.moe.down_proj.weight"] == (4, 64, 32)          # 128 inputs / 2 ranks, two to a byte
    assert shapes["layers.0.moe.down_proj.weight_scale"] == (4, 64, 2)     # 4 groups of 32 / 2 ranks


def test_quantized_experts_on_the_cpus_own_kernels(tiny_models):
    """CpuOps (the CPU's default: int4 attention layers in bf16) runs quantized experts through the reference loop;
    its logits stay near the exact reference products'."""
    model = _quantized_mixtral(tiny_models, "W4A16_AWQ", 0)
    fast = _generate(model, build_config=BUILD)
    for out, ref in zip(fast, _generate(model)):
        assert rel_err(out.context_logits, ref.context_logits) < 2e-2


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["W4A16_AWQ", "FP8"])
@pytest.mark.parametrize("tp_mode", [0, 1])
def test_quantized_experts_tp2_equal_tp1(tiny_models, algo, tp_mode):
    """Quantized experts on two ranks (gloo): expert parallel or tensor parallel gives TP=1's greedy tokens and
    logits (float32 reference products on both). FP8 activations now and then round the float32 difference that the
    ranks' summation order makes into another e4m3 level (a 40-token prompt: 8e-3 with qkv, o and the experts in
    FP8, 2e-7 with any two of them)."""
    model = _quantized_mixtral(tiny_models, algo, tp_mode)
    for out, ref in zip(_generate(model, ParallelConfig(tp_size=2)), _generate(model)):
        assert out.token_ids == ref.token_ids
        assert rel_err(out.context_logits, ref.context_logits) < (2e-2 if algo.startswith("FP8") else 1e-5)


@pytest.mark.parametrize("algo", gpu_cases([None, "W8A16", "W4A16_AWQ"], default=[None, "W4A16_AWQ"]))
def test_tiny_mixtral_greedy_tokens_equal_the_cpu_path_in_float32(algo):
    """Prefill and CUDA-graph decode steps through the fused MoE give the reference's greedy tokens (ReferenceOps on
    the CPU, cpu_kernels="reference": CpuOps computes int8/int4 layers in bf16)."""
    from kiln.quantization import quantize_model

    model = tiny_mixtral("float32")
    if algo is not None:
        model = quantize_model(model, QuantConfig(algo, group_size=32), calib_size=2, quiet=True)
    prompts = [list(range(3, 3 + n)) for n in (1, 40, 200)]
    build = BuildConfig(max_batch_size=4, max_input_len=256, max_seq_len=512,
                        plugin_config=PluginConfig(cpu_kernels="reference"))
    tokens = {}
    for device in ("cpu", "cuda"):
        with LLM(model, build_config=build, device=device, quiet=True) as llm:
            tokens[device] = [o.token_ids for o in llm.generate(prompts, SamplingConfig(max_new_tokens=16, end_id=-1))]
    assert tokens["cuda"] == tokens["cpu"]

