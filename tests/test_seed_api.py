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
