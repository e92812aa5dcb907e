"""Bad LoRA adapters are refused with an error that says what is wrong, when generate() is called (the LLM goes on
serving); what the engine's build config allows (max_lora_rank, lora_target_modules) is enforced; the options that
are not implemented are refused."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import hf_greedy
from peft_adapters import make_adapter
from kiln import LLM, BuildConfig, LoraCacheConfig, LoraConfig, LoRARequest, SamplingConfig, build
from kiln.checkpoint.lora import AdapterNotFound
from kiln.config import PluginConfig
from kiln.runtime.executor import RequestFailed
from kiln.runtime.request import Request

BUILD = dict(max_batch_size=4, max_input_len=32, max_seq_len=48)
GREEDY = SamplingConfig(max_new_tokens=6, end_id=-1)
PROMPT = list(range(10, 30))


def edited(source, target, **changes):
    """A copy of the adapter at `source` whose adapter_config.json has `changes`."""
    shutil.copytree(source, target)
    config = json.loads((target / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return target


@pytest.fixture(scope="module")
def llama(tiny_models, tmp_path_factory):
    """(HF dir, a good adapter dir, an LLM over the tiny Llama that outlives the module's tests)."""
    hf_dir, _ = tiny_models["llama"]
    good = tmp_path_factory.mktemp("errors") / "good"
    make_adapter(hf_dir, good, ["q_proj", "v_proj"])
    with LLM(hf_dir, build_config=BuildConfig(**BUILD), quiet=True, device="cpu") as llm:
        yield hf_dir, good, llm


def refused(llm: LLM, path, match: str, error=ValueError, name: str | None = None):
    with pytest.raises(error, match=match):
        llm.generate(PROMPT, GREEDY, lora_request=LoRARequest(name or path.name, path))
    assert llm.generate(PROMPT, GREEDY).token_ids       # it goes on serving


def test_missing_files(llama, tmp_path):
    _, good, llm = llama
    refused(llm, tmp_path / "nowhere", "no such directory", AdapterNotFound)
    (tmp_path / "empty").mkdir()
    refused(llm, tmp_path / "empty", "adapter_config.json is missing", FileNotFoundError)
    shutil.copytree(good, tmp_path / "no_weights")
    (tmp_path / "no_weights" / "adapter_model.safetensors").unlink()
    refused(llm, tmp_path / "no_weights", r"no weights \(adapter_model.safetensors or adapter_model.bin\)")


def test_an_adapter_of_another_model_names_the_tensor_and_both_shapes(llama, tiny_models, tmp_path):
    """An adapter trained on the tiny Mistral (one KV head) on the tiny Llama (two)."""
    _, _, llm = llama
    make_adapter(tiny_models["mistral"][0], tmp_path / "mistral", ["q_proj", "k_proj"])
    refused(llm, tmp_path / "mistral", r"tensor layers.0.self_attn.k_proj.lora_B.weight has shape \(16, 8\), but the "
            r"base model's k_proj is \(32, 64\) \(out, in\), so it needs \(32, 8\)")


def test_targets_kiln_does_not_serve(llama, tmp_path):
    hf_dir, good, llm = llama
    make_adapter(hf_dir, tmp_path / "head", ["q_proj", "lm_head"])
    refused(llm, tmp_path / "head", r"target_modules \['lm_head'\] are not LoRA targets Kiln serves")
    regex = edited(tmp_path / "head", tmp_path / "head_regex", target_modules=".*(q_proj|lm_head)")
    refused(llm, regex, "tensor 'base_model.model.lm_head.base_layer.weight' is not a LoRA weight of a projection")


@pytest.mark.parametrize("options, match", [
    ({"use_dora": True}, r"use_dora=True \(DoRA"),
    ({"bias": "lora_only"}, "bias='lora_only' trains biases"),
    ({"modules_to_save": ["lm_head"]}, r"modules_to_save=\['lm_head'\] \(modules saved whole\)"),
], ids=["dora", "bias", "modules_to_save"])
def test_peft_features_are_refused_not_ignored(llama, tmp_path, options, match):
    hf_dir, _, llm = llama
    make_adapter(hf_dir, tmp_path / "a", ["q_proj", "v_proj"], **options)
    refused(llm, tmp_path / "a", match)


@pytest.mark.parametrize("changes, match", [
    ({"alpha_pattern": {"q_proj": 4}}, "per-module lora_alpha"),
    ({"init_lora_weights": "pissa"}, "also changes the base model's weights"),
    ({"peft_type": "IA3"}, "Kiln serves LoRA adapters only"),
    ({"a_future_option": 3}, "a_future_option=3 .a PEFT feature Kiln does not implement"),
    ({"lora_alpha": 0}, "needs a positive lora_alpha"),
], ids=["alpha_pattern", "pissa", "peft_type", "unknown_option", "zero_alpha"])
def test_config_options_that_change_the_product_are_refused(llama, tmp_path, changes, match):
    _, good, llm = llama
    refused(llm, edited(good, tmp_path / "a", **changes), match)


def test_mixtral_experts_are_refused(tiny_models, tmp_path):
    hf_dir, _ = tiny_models["mixtral"]
    make_adapter(hf_dir, tmp_path / "experts", ["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])
    with LLM(hf_dir, build_config=BuildConfig(**BUILD), quiet=True, device="cpu") as llm:
        refused(llm, tmp_path / "experts", r"target_parameters=.* \(LoRA on parameters \(MoE experts\)\)")
        config = json.loads((tmp_path / "experts" / "adapter_config.json").read_text())
        del config["target_parameters"]
        (tmp_path / "experts" / "adapter_config.json").write_text(json.dumps(config))
        refused(llm, tmp_path / "experts", "experts.lora_A.weight' is on a mixture-of-experts layer")


def test_the_engine_limits_rank_and_targets(tiny_models, tmp_path):
    """max_lora_rank=4 refuses a rank-8 adapter; lora_target_modules (TensorRT-LLM's names here) refuse v_proj and
    serve q_proj + o_proj exactly."""
    hf_dir, _ = tiny_models["llama"]
    make_adapter(hf_dir, tmp_path / "r8", ["q_proj"], r=8)
    make_adapter(hf_dir, tmp_path / "v", ["v_proj"], r=4)
    peft_model = make_adapter(hf_dir, tmp_path / "qo", ["q_proj", "o_proj"], r=4, seed=1)
    lora = LoraConfig(max_lora_rank=4, lora_target_modules=["attn_q", "attn_dense"])
    engine = build(_model(hf_dir), BuildConfig(**BUILD, lora_config=lora), quiet=True)
    engine.save(tmp_path / "engine")
    with LLM(tmp_path / "engine", quiet=True, device="cpu") as llm:
        assert llm.build_config.lora_config.max_lora_rank == 4
        refused(llm, tmp_path / "r8", "has rank 8, over the engine's max_lora_rank=4; rebuild")
        refused(llm, tmp_path / "v", r"targets v_proj, which the engine's lora_target_modules \(q_proj, o_proj\) "
                "leave out")
        expected = hf_greedy(peft_model, PROMPT, GREEDY.max_new_tokens)
        assert llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("qo", tmp_path / "qo")).token_ids == expected


def _model(hf_dir):
    from kiln.models import LlamaForCausalLM

    return LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True)


def test_one_name_one_adapter(llama, tmp_path):
    _, good, llm = llama
    shutil.copytree(good, tmp_path / "copy")
    assert llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("named", good, id=7)).token_ids
    refused(llm, tmp_path / "copy", "LoRA adapter name 'named' already stands for", name="named")
    with pytest.raises(ValueError, match="LoRA adapter id 7 already stands for 'named'"):
        llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("other", tmp_path / "copy", id=7))
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate([PROMPT], GREEDY, lora_request=[None, None])
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        llm.generate(PROMPT, GREEDY, lora_request="named")
    with pytest.raises(ValueError, match=r"LoRARequest 'x' has no path and the engine stores no adapter of that "
                                         r"name \(it has none \(LoraConfig.lora_dir\)\)"):
        llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("x"))


def test_an_adapter_gone_from_disk_fails_its_request_alone(tiny_models, tmp_path):
    """With one host slot, an adapter read at submission is dropped for the next one; if its directory is gone by
    the time it runs, that request fails with the reason and the other one is served."""
    hf_dir, _ = tiny_models["llama"]
    make_adapter(hf_dir, tmp_path / "a", ["q_proj"])
    make_adapter(hf_dir, tmp_path / "b", ["v_proj"], seed=1)
    with LLM(hf_dir, build_config=BuildConfig(**BUILD), quiet=True, device="cpu",
             lora_cache_config=LoraCacheConfig(max_loras=1, max_cpu_loras=1)) as llm:
        expected_b = llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("b", tmp_path / "b")).token_ids
        a = LoRARequest("a", tmp_path / "a")
        llm.core.runner.lora.register(a)
        llm.core.runner.lora.register(LoRARequest("b", tmp_path / "b"))         # a leaves the host cache
        shutil.rmtree(tmp_path / "a")
        doomed = llm._executor.submit(Request(1000, PROMPT, GREEDY, lora_request=a), PROMPT, streaming=False)
        with pytest.raises(RequestFailed, match="request 1000 failed: AdapterNotFound: .*no such directory"):
            doomed.result(timeout=30)
        assert llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("b", tmp_path / "b")).token_ids == expected_b


def test_adapters_on_fused_fp8_engines_are_refused(tiny_models, tmp_path):
    """FP8 per-token activations come out of the norms already quantized: no plain input for an adapter."""
    from kiln.config import QuantConfig
    from kiln.quantization import quantize_model

    hf_dir, _ = tiny_models["llama"]
    make_adapter(hf_dir, tmp_path / "a", ["q_proj"])
    model = quantize_model(_model(hf_dir), QuantConfig("FP8_PER_CHANNEL_PER_TOKEN"), calib_size=1, quiet=True)
    with LLM(model, build_config=BuildConfig(**BUILD), quiet=True, device="cpu") as llm:
        refused(llm, tmp_path / "a", "LoRA adapters are not supported on this engine yet: its kernels fuse")


def test_lora_options_are_checked():
    with pytest.raises(ValueError, match="lora_target_modules: 'w1' is not one of q_proj"):
        LoraConfig(lora_target_modules=["w1"])
    with pytest.raises(ValueError, match="lora_ckpt_source='nemo' is not supported by Kiln yet"):
        LoraConfig(lora_ckpt_source="nemo")
    with pytest.raises(ValueError, match="two adapter directories have the same name ..'a'.."):
        LoraConfig(lora_dir=["x/a", "y/a"])
    with pytest.raises(AdapterNotFound, match="LoRA adapter 'adapter' .*: no such directory"):
        build(_random(), BuildConfig(**BUILD, lora_config=LoraConfig(lora_dir=["adapter"])), quiet=True)
    with pytest.raises(ValueError, match="max_lora_rank must be a positive number"):
        LoraConfig(max_lora_rank=0)
    assert LoraConfig(lora_target_modules=["mlp_gate", "up_proj", "attn_q"]).target_modules == ("up_proj", "q_proj")
    with pytest.raises(ValueError, match="max_cpu_loras=1 must be at least max_loras=2"):
        LoraCacheConfig(max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="lora_plugin='int8' is not one of"):
        PluginConfig(lora_plugin="int8")
    with pytest.raises(ValueError, match="lora_plugin='float16' differs from the model dtype 'float32'"):
        build(_random(), BuildConfig(**BUILD, plugin_config=PluginConfig(lora_plugin="float16")), quiet=True)


def _random():
    from kiln.config import PretrainedConfig
    from kiln.models import LlamaForCausalLM

    return LlamaForCausalLM.random(PretrainedConfig(architecture="LlamaForCausalLM", dtype="float32", vocab_size=64,
                                                    hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                                    intermediate_size=128, max_position_embeddings=64))
