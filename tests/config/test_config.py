"""Config dataclasses: documented fields, validation, YAML, and HF config mapping."""
from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import DATA
from kiln.checkpoint.hf import read_hf_config
from kiln.config import (AutoParallelConfig, BuildConfig, BuildFile, ConvertConfig, KvCacheConfig, LoraConfig, Mapping,
                         ModelSection, ParallelConfig, PluginConfig, PretrainedConfig, QuantConfig, field_docs,
                         load_build_file)
from kiln.runtime.sampling import SamplingConfig

ALL = [AutoParallelConfig, BuildConfig, BuildFile, ConvertConfig, KvCacheConfig, LoraConfig, Mapping, ModelSection,
       ParallelConfig, PluginConfig, PretrainedConfig, QuantConfig, SamplingConfig]


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(cls):
    docs = field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
    assert not missing


def test_seed_yaml_is_understood_whole():
    spec = load_build_file(DATA / "seed_build.yaml")
    assert spec.checkpoint.rms_norm_eps == 1e-6 and spec.checkpoint.n_layer == 32
    assert spec.build.max_seq_len == 512 and spec.build.plugin_config.tokens_per_block == 32
    assert spec.model.dtype == "float16"


def test_build_lengths_resolve_and_must_agree():
    assert BuildConfig(max_input_len=100, max_seq_len=300).max_output_len == 200
    assert BuildConfig(max_input_len=100, max_output_len=50).max_seq_len == 150
    with pytest.raises(ValueError, match="max_seq_len=300 exceeds max_input_len=100 \\+ max_output_len=50"):
        BuildConfig(max_input_len=100, max_output_len=50, max_seq_len=300)
    both = BuildConfig(max_input_len=100, max_output_len=100, max_seq_len=150)     # three limits per request
    assert (both.max_input_len, both.max_output_len, both.max_seq_len) == (100, 100, 150)
    with pytest.raises(ValueError, match="max_output_len=150 must be below max_seq_len=150"):
        BuildConfig(max_input_len=100, max_output_len=150, max_seq_len=150)
    assert BuildConfig(max_input_len=100, max_num_tokens=10).max_num_tokens == 10   # for chunked context
    with pytest.raises(ValueError, match="max_batch_size must be a positive number"):
        BuildConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="tokens_per_block=24 must be a power of two"):
        PluginConfig(tokens_per_block=24)


def test_wrong_types_are_named():
    with pytest.raises(ValueError, match="build.max_batch_size must be int, got 'eight'"):
        BuildConfig.from_dict({"max_batch_size": "eight"})
    with pytest.raises(ValueError, match="build.gather_context_logits must be bool"):
        BuildConfig.from_dict({"gather_context_logits": "yes please"})


def test_other_validations():
    with pytest.raises(ValueError, match="world_size=2 must equal tp_size \\* pp_size = 1"):
        Mapping(world_size=2)
    with pytest.raises(ValueError, match="quant_algo='INT3'"):
        QuantConfig(quant_algo="INT3")
    with pytest.raises(ValueError, match="W4A16_GPTQ needs group_size 32, 64 or 128, got None"):
        QuantConfig(quant_algo="W4A16_GPTQ", group_size=None)
    with pytest.raises(ValueError, match="int4_awq quantizes per group: add per_group"):
        ConvertConfig(use_weight_only=True, weight_only_precision="int4_awq")
    with pytest.raises(ValueError, match="smoothquant needs per_channel"):
        ConvertConfig(smoothquant=0.5)
    with pytest.raises(ValueError, match="choose one of use_weight_only, smoothquant, use_fp8"):
        ConvertConfig(use_weight_only=True, use_fp8=True)
    with pytest.raises(ValueError, match="int8_kv_cache and fp8_kv_cache exclude each other"):
        ConvertConfig(int8_kv_cache=True, fp8_kv_cache=True)
    assert ConvertConfig(use_fp8=True, fp8_kv_cache=True).quant_config().quant_algo == "FP8"
    with pytest.raises(ValueError, match="load_by_shard cannot quantize"):
        ConvertConfig(load_by_shard=True, use_weight_only=True)
    with pytest.raises(ValueError, match="free_gpu_memory_fraction=1.5"):
        KvCacheConfig(free_gpu_memory_fraction=1.5)
    base = dict(architecture="LlamaForCausalLM", dtype="float32", vocab_size=10, hidden_size=8, num_hidden_layers=1,
                num_attention_heads=2, intermediate_size=16)
    with pytest.raises(ValueError, match="num_attention_heads=2 is not a multiple of num_key_value_heads=3"):
        PretrainedConfig(**base, num_key_value_heads=3)
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        PretrainedConfig(**base, rope_scaling={"type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="dtype='int8'"):
        PretrainedConfig(**{**base, "dtype": "int8"})
    config = PretrainedConfig(**base, rope_scaling={"type": "linear", "factor": 2.0})
    assert PretrainedConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_transformers4_style_config(tmp_path):
    """Older HF configs keep rope_theta and rope_scaling ("type" or "rope_type") at the top level."""
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 96, "torch_dtype": "bfloat16",
           "rope_theta": 500000.0, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 1024}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = read_hf_config(tmp_path)
    assert config.dtype == "bfloat16" and config.rotary_base == 500000.0 and config.num_key_value_heads == 1
    assert config.rope_scaling == {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 1024}
    assert read_hf_config(tmp_path, dtype="float32").dtype == "float32"
