"""The seed's high-level API as written (issue 32, item 1): LLM(ModelConfig(...)) — the docstring's own snippet —
gives the tokens of Kiln's own LLM(path, ...); ModelConfig's parallel, quantization and build fields reach the
engine (or are refused where a built engine cannot take them); LLaMAForCausalLM is LlamaForCausalLM."""
from __future__ import annotations

import pytest

from kiln import LLM, BuildConfig, ModelConfig, ParallelConfig, QuantConfig, SamplingConfig
from kiln.convert import quantize
from kiln.models import LLaMAForCausalLM, LlamaForCausalLM

GREEDY = SamplingConfig(max_new_tokens=8, end_id=-1)


@pytest.mark.slow
def test_the_seeds_snippet_runs_on_smollm2(smollm2_path):
    config = ModelConfig(str(smollm2_path))
    llm = LLM(config)
    seed_out = llm.generate(["What is your name?"])                 # the seed's LLM docstring, as written
    llm.shutdown()
    with LLM(str(smollm2_path), quiet=True) as own:
        assert [o.token_ids for o in seed_out] == [own.generate("What is your name?").token_ids]
    assert len(seed_out) == 1 and seed_out[0].finished


def test_model_config_fields_reach_the_engine(tiny_models, tmp_path):
    hf_dir = str(tiny_models["llama"][0])
    model = LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True)
    with LLM(quantize(model, QuantConfig(quant_algo="W8A16"), calib_size=16, quiet=True), quiet=True) as own:
        expected = own.generate([5, 6, 7], GREEDY).token_ids
    config = ModelConfig(model_dir=hf_dir, quant_config=QuantConfig(quant_algo="W8A16"), max_beam_width=2,
                         multi_block_mode=False, plugin_config={"tokens_per_block": 16})
    with LLM(config, quiet=True, async_engine_tmp_dir=tmp_path / "engine") as llm:
        assert llm.generate([5, 6, 7], GREEDY).token_ids == expected
        build = llm.engine.build_config
        assert build.max_beam_width == 2 and not build.plugin_config.multi_block_mode
        assert build.plugin_config.tokens_per_block == 16
        assert llm.engine.pretrained_config.quantization.quant_algo == "W8A16"
        assert len(llm.generate([5, 6], SamplingConfig(max_new_tokens=4, num_beams=2)).outputs) == 2
    with LLM(str(tmp_path / "engine"), quiet=True) as saved:                      # the engine kept there
        assert saved.generate([5, 6, 7], GREEDY).token_ids == expected


def test_model_config_misuse_is_refused(tiny_models, tmp_path):
    hf_dir = str(tiny_models["llama"][0])
    with pytest.raises(ValueError, match="give the model as model_dir or as model"):
        ModelConfig()
    with pytest.raises(ValueError, match="parallel_config is given twice"):
        LLM(ModelConfig(hf_dir), parallel_config=ParallelConfig())
    with LLM(hf_dir, build_config=BuildConfig(max_input_len=16, max_seq_len=32), quiet=True) as llm:
        llm.save(tmp_path / "engine")
    with pytest.raises(ValueError, match="asks for max_beam_width=4, but the engine was built with 1"):
        LLM(ModelConfig(str(tmp_path / "engine"), max_beam_width=4), quiet=True)
    with pytest.raises(ValueError, match="quant_config quantizes a model before it is built"):
        LLM(ModelConfig(str(tmp_path / "engine"), quant_config=QuantConfig(quant_algo="W8A16")), quiet=True)


def test_the_seeds_class_names():
    assert LLaMAForCausalLM is LlamaForCausalLM
    config = ModelConfig(model_dir="x", parallel_config=ParallelConfig(tp_size=2, pp_size=2))
    assert config.is_multi_gpu and config.world_size == 4


@pytest.mark.parametrize("algo, kv", [(None, None), ("W8A16", None), ("W4A16", "INT8"), ("W4A16_AWQ", "FP8"),
                                      ("W8A8_SQ_PER_CHANNEL", None), ("W8A8_SQ_PER_CHANNEL_PER_TOKEN", "INT8"),
                                      ("FP8", "FP8"), ("FP8_PER_CHANNEL_PER_TOKEN", None)])
def test_quant_mode_stands_for_quant_algo(algo, kv):
    from kiln.config.quant import QuantMode

    config = QuantConfig(quant_algo=algo, kv_cache_quant_algo=kv)
    assert QuantConfig(quant_mode=config.quant_mode) == config          # the seed's constructor, round trip
    assert config.has_int8_kv_cache() == (kv == "INT8") and config.has_fp8_kv_cache() == (kv == "FP8")
    assert config.has_fp8_qdq() == (algo or "").startswith("FP8")
    assert config.is_weight_only() == (algo in ("W8A16", "W4A16", "W4A16_AWQ"))
    assert isinstance(config.quant_mode, QuantMode)


def test_the_seeds_quant_config_methods():
    from kiln.config.quant import QuantMode

    config = QuantConfig()
    config.init_from_description(quantize_weights=True, use_int4_weights=True, per_group=True)
    assert config.quant_algo == "W4A16_AWQ" and config.has_per_group_scaling() and config.is_int4_weight_only()
    config.set_int8_kv_cache()
    assert (config.quant_algo, config.kv_cache_quant_algo) == ("W4A16_AWQ", "INT8")
    config.set_fp8_kv_cache()
    assert config.kv_cache_quant_algo == "FP8" and not config.has_int8_kv_cache()
    config.set_fp8_qdq()
    assert (config.quant_algo, config.kv_cache_quant_algo) == ("FP8", "FP8") and config.has_act_and_weight_quant()
    config.init_from_description(quantize_weights=True, quantize_activations=True, per_channel=True, per_token=True)
    assert config.quant_algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN"
    assert QuantConfig(quant_mode=QuantMode.FP8_QDQ, quantize_lm_head=True).exclude_modules == []
    with pytest.raises(ValueError, match="has no Kiln quant_algo"):
        config.init_from_description(quantize_weights=True, quantize_activations=True)      # per-tensor SmoothQuant
    with pytest.raises(ValueError, match="give quant_mode or quant_algo"):
        QuantConfig(quant_algo="W8A16", quant_mode=QuantMode.INT8_WEIGHTS)
    with pytest.raises(AttributeError, match="has_no_such_thing"):
        config.has_no_such_thing()


def test_llm_quantizes_with_a_seed_quant_config(tiny_models):
    from kiln.config.quant import QuantMode

    hf_dir = str(tiny_models["llama"][0])
    mode = QuantMode.from_description(quantize_weights=True)                       # int8 weight-only: W8A16
    with LLM(ModelConfig(hf_dir, quant_config=QuantConfig(quant_mode=mode)), quiet=True) as llm:
        assert llm.engine.pretrained_config.quantization.quant_algo == "W8A16"
        assert len(llm.generate([5, 6, 7], GREEDY).token_ids) == 8


def test_parallel_config_devices():
    assert ParallelConfig(tp_size=2, pp_size=2).get_devices() == [0, 1, 2, 3]        # the seed's default
    assert ParallelConfig(tp_size=2, devices=[3, 1]).get_devices() == [3, 1]
    assert ParallelConfig(auto_parallel=True, world_size=2, devices=[1, 0]).get_devices() == [1, 0]
    with pytest.raises(ValueError, match="names 1 GPUs for 2 ranks"):
        ParallelConfig(tp_size=2, devices=[0])
    with pytest.raises(ValueError, match="must be distinct CUDA device indices"):
        ParallelConfig(tp_size=2, devices=[1, 1])


def test_devices_pick_gpus_or_are_refused(tiny_models):
    import torch

    from kiln.llm import _rank0_device

    hf_dir = str(tiny_models["llama"][0])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"devices=\[0\] picks CUDA GPUs, but this machine has no CUDA GPU"):
            LLM(hf_dir, parallel_config=ParallelConfig(devices=[0]), quiet=True)
        return
    count = torch.cuda.device_count()
    assert _rank0_device(None, ParallelConfig(devices=[count - 1])) == torch.device("cuda", count - 1)
    with pytest.raises(ValueError, match="picks CUDA GPUs, but device='cpu' was asked"):
        _rank0_device("cpu", ParallelConfig(devices=[0]))
    with pytest.raises(ValueError, match="names GPUs .* this machine does not have"):
        _rank0_device(None, ParallelConfig(devices=[count]))


def test_sampling_config_return_dict(tiny_models):
    sampling = SamplingConfig(max_new_tokens=6, end_id=-1, pad_id=0, return_dict=True, output_sequence_lengths=True)
    with LLM(str(tiny_models["llama"][0]), quiet=True) as llm:
        plain = llm.generate([5, 6, 7], SamplingConfig(max_new_tokens=6, end_id=-1))
        out = llm.generate([5, 6, 7], sampling)
        short = llm.generate([5, 6, 7], SamplingConfig(max_new_tokens=6, end_id=plain.token_ids[1], pad_id=0,
                                                         return_dict=True))
    assert out.token_ids == plain.token_ids                              # still a GenerationOutput
    assert out["output_ids"] == [[5, 6, 7] + plain.token_ids] and out["sequence_lengths"] == [9]
    assert short["output_ids"] == [[5, 6, 7] + plain.token_ids[:2] + [0] * 4] and "sequence_lengths" not in short.keys()
    with pytest.raises(KeyError, match="only for SamplingConfig.return_dict=True."):
        plain["output_ids"]
    with pytest.raises(ValueError, match="set return_dict=True too"):
        SamplingConfig(output_sequence_lengths=True)
