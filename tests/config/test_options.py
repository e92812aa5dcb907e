"""No option is accepted and silently ignored: every field of every config dataclass, set to a value other than
its default, is either refused with a ValueError or read, while the config is used, by code outside kiln.config.

Each instance is of a subclass that records the reads of its fields together with the module that made them
(sys._getframe); reads made inside the config package (validation, to_dict, hashing) or by the standard library
(dataclasses.replace, asdict) do not count. The consumer of each class is the real path it takes: kiln convert and
a build file for ConvertConfig, build + save + one generated token for BuildConfig and its parts, an HTTP request
for ServerConfig. A new field without a row in VALUES fails test_every_field_has_a_row."""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import kiln.config
from conftest import save_tiny_model
from kiln import LLM, build
from kiln.config import (AutoParallelConfig, BuildConfig, BuildFile, ConvertConfig, KvCacheConfig, LoraCacheConfig,
                         LoraConfig, Mapping, ModelConfig, ModelSection, ParallelConfig, PluginConfig, PretrainedConfig,
                         QuantConfig, SpeculativeConfig, field_docs)
from kiln.convert import quantize
from kiln.models import model_class
from kiln.runtime.sampling import SamplingConfig
from kiln.server.config import ServerConfig

TINY = dict(architecture="LlamaForCausalLM", dtype="float32", vocab_size=64, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
SMALL = dict(max_batch_size=2, max_input_len=16, max_seq_len=32)
# The tiny HF llama of conftest, described by ConvertConfig's shape fields.
HF_SHAPE = dict(vocab_size=320, n_positions=512, n_layer=2, n_head=4, n_embd=64, inter_size=128, n_kv_head=2)
MIXTRAL = dict(architecture="MixtralForCausalLM", moe_num_experts=4, moe_top_k=2)
TP2 = Mapping(2, 0, 2, 1)
WEIGHT_ONLY = dict(use_weight_only=True)
GPTQ = dict(use_weight_only=True, weight_only_precision="int4_gptq", per_group=True, group_size=32)
SMOOTH = dict(smoothquant=0.5, per_channel=True)

# class → field → (a value other than the default, other fields that make the value meaningful[, consumer]).
VALUES = {
    "PluginConfig": {
        "gemm_plugin": ("float32", {}), "gpt_attention_plugin": ("float32", {}), "context_fmha": (False, {}),
        "remove_input_padding": (False, {}), "paged_kv_cache": (False, {}), "tokens_per_block": (16, {}),
        "use_paged_context_fmha": (False, {}), "multi_block_mode": (False, {}), "use_custom_all_reduce": (True, {}),
        "use_fp8_all_reduce": (True, {}), "use_fp8_cast_plugin": (True, {}), "use_async_malloc": (True, {}),
        "use_fp8_context_fmha": (True, {}), "fp8_fast_accumulation": (False, {}), "lora_plugin": ("float16", {}),
        "programmatic_dependent_launch": (False, {}), "cpu_kernels": ("reference", {}),
    },
    "LoraConfig": {
        "lora_dir": (["adapter"], {}), "lora_target_modules": (["q_proj"], {}), "lora_ckpt_source": ("nemo", {}),
        "max_lora_rank": (8, {}),
    },
    "AutoParallelConfig": {
        "enabled": (True, {}), "tp_size": (2, {"enabled": True}), "pp_size": (2, {"enabled": True}),
        "max_memory_MB": (1000, {"enabled": True, "tp_size": 2}), "max_dram_memory_MB": (1000, {}),
        "compile_max_memory_MB": (1000, {}), "compile_max_dram_memory_MB": (1000, {}),
        "debug_mode": (True, {"enabled": True, "tp_size": 2}),
    },
    "BuildConfig": {
        "max_input_len": (8, {}), "max_output_len": (8, {"max_seq_len": None}), "max_seq_len": (24, {}),
        "max_batch_size": (3, {}), "max_beam_width": (2, {}), "max_num_tokens": (24, {}), "opt_num_tokens": (16, {}),
        "max_prompt_embedding_table_size": (4, {}), "gather_context_logits": (True, {}),
        "gather_generation_logits": (True, {}), "strongly_typed": (False, {}), "builder_opt": (3, {}),
        "profiling_verbosity": ("detailed", {"visualize_network": True}), "enable_debug_output": (True, {}),
        "max_draft_len": (2, {}), "use_refit": (True, {}, "refit"), "input_timing_cache": ("kernels.tar", {}),
        "output_timing_cache": ("kernels.tar", {}), "lora_config": (lambda: LoraConfig(max_lora_rank=8), {}),
        "auto_parallel_config": (lambda: AutoParallelConfig(enabled=True), {}), "weight_sparsity": (True, {}),
        "plugin_config": (lambda: PluginConfig(tokens_per_block=16), {}), "max_encoder_input_len": (512, {}),
        "use_fused_mlp": (False, {}), "dry_run": (True, {}), "visualize_network": (True, {}),
    },
    "ConvertConfig": {
        "tp_size": (2, {}), "pp_size": (2, {}), **{k: (v, {}) for k, v in HF_SHAPE.items()},
        "rms_norm_eps": (1e-5, {}), "hidden_act": ("silu", {}), "rotary_base": (10000.0, {}),
        "moe_num_experts": (0, {}), "moe_top_k": (0, {}), "moe_renorm_mode": (1, {}), "moe_tp_mode": (1, {}),
        "meta_ckpt_dir": ("consolidated", {}), "use_weight_only": (True, {}),
        "weight_only_precision": ("int4", WEIGHT_ONLY), "smoothquant": (0.5, {"per_channel": True}),
        "per_channel": (True, {"smoothquant": 0.5}), "per_token": (True, SMOOTH), "int8_kv_cache": (True, {}),
        "use_fp8": (True, {}), "fp8_per_token": (True, {"use_fp8": True}), "fp8_kv_cache": (True, {}),
        "quantize_lm_head": (True, WEIGHT_ONLY), "calib_size": (2, WEIGHT_ONLY),
        "learned_rounding_steps": (1, GPTQ), "round_to_nearest": (True, WEIGHT_ONLY),
        "ammo_quant_ckpt_path": ("quant.npz", {}),
        "per_group": (True, {}), "group_size": (32, {**GPTQ, "group_size": 128}),
        "dataset_cache_dir": ("cache", {}), "disable_weight_only_quant_plugin": (True, {}),
        "load_by_shard": (True, {"tp_size": 2}), "load_model_on_cpu": (False, {}), "merge_lora": ("<tmp>/adapter", {}),
        "prune_2_4": (True, {}),
        "use_parallel_embedding": (True, {"tp_size": 2}),
        "embedding_sharding_dim": (1, {"tp_size": 2, "use_parallel_embedding": True}),
        "use_embedding_sharing": (True, {}), "workers": (2, {"tp_size": 2}), "save_config_only": (True, {}),
    },
    "Mapping": {
        "world_size": (2, {"tp_size": 2}), "rank": (1, {"world_size": 2, "tp_size": 2}),
        "tp_size": (2, {"world_size": 2}), "pp_size": (2, {"world_size": 2}),
    },
    "ParallelConfig": {
        "tp_size": (2, {}), "pp_size": (2, {}), "auto_parallel": (True, {}), "world_size": (2, {"auto_parallel": True}),
        "max_memory_mb": (1000, {"auto_parallel": True, "world_size": 2}),
        "timeout_s": (30.0, {"tp_size": 2}, "serve"), "devices": ([0], {}, "serve"),
    },
    "PretrainedConfig": {
        "architecture": ("MistralForCausalLM", {}), "dtype": ("bfloat16", {}), "vocab_size": (96, {}),
        "hidden_size": (32, {}), "num_hidden_layers": (3, {}), "num_attention_heads": (8, {}),
        "intermediate_size": (96, {}), "num_key_value_heads": (4, {}), "head_dim": (32, {}), "hidden_act": ("gelu", {}),
        "norm_epsilon": (1e-6, {}), "rotary_base": (5e5, {}), "rope_scaling": ({"type": "linear", "factor": 2.0}, {}),
        "max_position_embeddings": (48, {}), "tie_word_embeddings": (True, {}), "attention_bias": (True, {}),
        "dense_bias": (True, {}), "mlp_bias": (True, {}), "sliding_window": (8, {}),
        "moe_num_experts": (4, {**MIXTRAL, "moe_num_experts": 0}),
        "moe_top_k": (1, MIXTRAL), "moe_renorm_mode": (0, MIXTRAL), "mapping": (TP2, {}),
        "use_parallel_embedding": (True, {"mapping": TP2}),
        "embedding_sharding_dim": (1, {"mapping": TP2, "use_parallel_embedding": True}),
        "moe_tp_mode": (1, {**MIXTRAL, "mapping": TP2}), "quantization": (lambda: QuantConfig("W8A16"), {}),
    },
    "QuantConfig": {
        "quant_algo": ("W8A16", {}), "kv_cache_quant_algo": ("INT8", {}),
        "group_size": (32, {"quant_algo": "W4A16_GPTQ", "group_size": 64}),
        "has_zero_point": (True, {"quant_algo": "W4A16_GPTQ", "group_size": 32}),
        "smoothquant_val": (0.8, {"quant_algo": "W8A8_SQ_PER_CHANNEL"}), "exclude_modules": ([], {"quant_algo": "W8A16"}),
        "learned_rounding_steps": (1, {"quant_algo": "W4A16_GPTQ", "group_size": 32}),
    },
    "LoraCacheConfig": {"max_loras": (2, {}), "max_cpu_loras": (8, {})},
    "ModelConfig": {
        "model_dir": ("<hf>", {}), "model": ("<hf>", {"model_dir": None}),
        "parallel_config": (lambda: ParallelConfig(tp_size=2), {}),
        "quant_config": (lambda: QuantConfig(quant_algo="W8A16"), {}), "multi_block_mode": (False, {}),
        "max_beam_width": (2, {}), "plugin_config": (lambda: PluginConfig(tokens_per_block=16), {}),
    },
    "SpeculativeConfig": {
        "method": ("draft_model", {"speculative_model": "<hf>"}), "max_draft_len": (2, {}),
        "max_matching_ngram_size": (2, {}), "min_matching_ngram_size": (2, {"max_matching_ngram_size": 3}),
        "speculative_model": ("<hf>", {"method": "draft_model"}),
    },
    "KvCacheConfig": {
        "max_tokens": (64, {}), "free_gpu_memory_fraction": (0.5, {}), "host_cache_bytes": (1 << 20, {}),
        "enable_block_reuse": (True, {}),
    },
    "SamplingConfig": {
        "max_new_tokens": (2, {}), "min_tokens": (1, {"max_new_tokens": 2}), "end_id": (5, {}), "pad_id": (3, {}),
        "stop_token_ids": ([5], {}), "stop": (["a"], {}), "temperature": (0.5, {}), "top_k": (5, {}),
        "top_p": (0.5, {}), "min_p": (0.1, {}), "repetition_penalty": (1.2, {}), "presence_penalty": (0.5, {}),
        "frequency_penalty": (0.5, {}), "random_seed": (3, {"temperature": 1.0}), "n": (2, {}), "num_beams": (2, {}),
        "length_penalty": (0.5, {"num_beams": 2}), "early_stopping": (True, {"num_beams": 2}), "logprobs": (2, {}),
        "return_dict": (True, {}), "output_sequence_lengths": (True, {"return_dict": True}),
    },
    "ServerConfig": {
        "model_name": ("tiny", {}), "api_key": ("secret", {}), "max_queue": (3, {}), "max_body_bytes": (4096, {}),
        "body_timeout": (5.0, {}), "log_prompts": (True, {}), "lora_modules": ({"a": "nowhere"}, {}),
    },
    "ModelSection": {"model_dir": ("<hf>", {}), "output_dir": ("<tmp>/engine", {}), "dtype": ("bfloat16", {})},
    "BuildFile": {"model": (lambda: ModelSection(dtype="float32"), {}),
                  "checkpoint": (lambda: ConvertConfig(**HF_SHAPE, rms_norm_eps=1e-5), {}),
                  "build": (lambda: BuildConfig(**SMALL, dry_run=True), {})},
}
# Fields whose both values build the same engine, kept so that trtllm-build's files and flags work: the docstring
# must say so (and the builder prints a note when the value is not the default).
SAME_ENGINE = {
    ("BuildConfig", "strongly_typed"): "Kiln engines always keep the checkpoint's dtypes",
    ("BuildConfig", "use_fused_mlp"): "Kiln always fuses the gate and up projections",
}
# The other fields of every instance of a class: a small, valid starting point. (In VALUES and BASES a callable
# is called for a fresh value, and <hf> and <tmp> name the tiny HF directory and the test's temporary directory.)
BASES = {"PretrainedConfig": TINY, "BuildConfig": SMALL, "SamplingConfig": {"max_new_tokens": 1},
         "ModelConfig": {"model_dir": "<hf>"},
         "ConvertConfig": {"calib_size": 1},           # one calibration sequence keeps quantizing fast
         "BuildFile": {name: VALUES["BuildFile"][name][0] for name in ("checkpoint", "build")}}


def config_classes() -> list[type]:
    """Every dataclass defined under kiln.config, plus SamplingConfig and ServerConfig."""
    found = [SamplingConfig, ServerConfig]
    for info in pkgutil.iter_modules(kiln.config.__path__):
        module = importlib.import_module(f"kiln.config.{info.name}")
        found += [obj for obj in vars(module).values()
                  if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__]
    return sorted(set(found), key=lambda c: c.__name__)


def _cases():
    for cls in config_classes():
        for f in dataclasses.fields(cls):
            yield pytest.param(cls, f.name, id=f"{cls.__name__}.{f.name}")


def test_every_field_has_a_row():
    fields = {(c.__name__, f.name) for c in config_classes() for f in dataclasses.fields(c)}
    assert not fields - {(c, f) for c, row in VALUES.items() for f in row}


@pytest.mark.parametrize("key, reason", SAME_ENGINE.items(), ids=lambda v: v if isinstance(v, str) else ".".join(v))
def test_compatibility_fields_say_so(key, reason):
    doc = field_docs(next(c for c in config_classes() if c.__name__ == key[0]))[key[1]]
    assert "both values build the same engine" in doc and reason in doc


# ------------------------------------------------------------------------------------------------ recording reads
def _counts(frame, own: tuple[str, ...]) -> bool:
    """Whether a read from `frame` is a use: made by kiln code outside the config's own modules, reached from
    there through public accessors only (a property, quant_config(), ...), not from validation or serialisation."""
    while frame is not None:
        module, name = frame.f_globals.get("__name__", ""), frame.f_code.co_name
        if name == "__getattribute__" and module == __name__:      # a property read through a recording instance
            frame = frame.f_back
            continue
        if not module.startswith(own):
            return module.startswith("kiln.")
        if name.startswith("_") or name in ("to_dict", "from_dict", "engine_fields"):
            return False
        frame = frame.f_back
    return False


def recording(cls: type, reads: set[str]) -> type:
    """A subclass of `cls` whose instances (and their dataclasses.replace copies) add each counted field read
    to `reads`."""
    names, own = {f.name for f in dataclasses.fields(cls)}, ("kiln.config", cls.__module__)

    def __getattribute__(self, name):
        if name in names and _counts(sys._getframe(1), own):
            reads.add(name)
        return object.__getattribute__(self, name)

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__})


# ------------------------------------------------------------------------------------------------ consumers
def _model(config: PretrainedConfig | None = None):
    config = config or PretrainedConfig(**TINY)
    return model_class(config.architecture).random(config)


def _generate(engine, sampling: SamplingConfig | None = None, **llm_args) -> None:
    with LLM(engine, device="cpu", quiet=True, **llm_args) as llm:
        llm.generate([1, 2, 3], sampling or SamplingConfig(max_new_tokens=1))


def use_build_config(config: BuildConfig, env) -> None:
    """Build a tiny engine, save it, and (one rank) generate a token with it."""
    engine = build(_model(), config, quiet=True)
    engine.save(env.tmp / "engine")
    if engine.pretrained_config.mapping.world_size == 1:
        _generate(engine)


def use_convert_cli(config: ConvertConfig, env) -> None:
    """`kiln convert --model_dir <tiny HF llama>` with these settings."""
    from kiln.cli import main

    args = main.parser().parse_args(["convert", "--model_dir", str(env.hf_dir), "--output_dir", str(env.tmp / "c")])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(main, "ConvertConfig", lambda **_: config)
        args.handler(args)


def use_build_file(spec: BuildFile, env) -> None:
    """`kiln build --config <file>` with these sections."""
    from kiln.cli import main

    args = main.parser().parse_args(["build", "--config", str(env.tmp / "build.yaml")])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kiln.config, "load_build_file", lambda path: spec)
        args.handler(args)


def use_checkpoint_in_build_file(config: ConvertConfig, env) -> None:
    spec = BuildFile(model=ModelSection(model_dir=str(env.hf_dir), dtype="float32"), checkpoint=config,
                     build=BuildConfig(**SMALL, dry_run=True))
    use_build_file(spec, env)


def use_model_section(section: ModelSection, env) -> None:
    use_build_file(BuildFile(model=section, checkpoint=ConvertConfig(**HF_SHAPE, rms_norm_eps=1e-5),
                             build=BuildConfig(**SMALL, dry_run=True)), env)


def use_pretrained_config(config: PretrainedConfig, env) -> None:
    """A random-weight model of this config (quantized as it says), built, and (one rank) run."""
    plain = dataclasses.replace(config, quantization=QuantConfig())
    model = quantize(_model(plain), object.__getattribute__(config, "quantization"), calib_size=2, quiet=True)
    engine = build(model, BuildConfig(**SMALL), quiet=True)
    if engine.pretrained_config.mapping.world_size == 1:
        _generate(engine)


def use_quant_config(config: QuantConfig, env) -> None:
    model = quantize(_model(), config, calib_size=2, quiet=True)
    _generate(build(model, BuildConfig(**SMALL), quiet=True))


def use_parallel_config(config: ParallelConfig, env) -> None:
    from kiln.llm import load_engine

    load_engine(_model(), build_config=BuildConfig(**SMALL), quiet=True, parallel_config=config)


def serve_parallel_config(config: ParallelConfig, env) -> None:
    """An LLM over worker ranks (which is where timeout_s applies)."""
    with LLM(_model(), build_config=BuildConfig(**SMALL), parallel_config=config, device="cpu", quiet=True) as llm:
        llm.generate([1, 2, 3], SamplingConfig(max_new_tokens=1))


def refit_build_config(config: BuildConfig, env) -> None:
    """A tiny engine built with these settings, its weights updated in place (from its own model's)."""
    model = _model()
    with LLM(build(model, config, quiet=True), device="cpu", quiet=True) as llm:
        llm.update_weights(model.weights)


def use_sampling_config(config: SamplingConfig, env) -> None:
    _generate(build(_model(), BuildConfig(**SMALL, max_beam_width=2), quiet=True), config)


def use_lora_cache_config(config: LoraCacheConfig, env) -> None:
    _generate(build(_model(), BuildConfig(**SMALL), quiet=True), lora_cache_config=config)


def use_model_config(config: ModelConfig, env) -> None:
    """LLM(config), the seed's form, generating a token."""
    with LLM(config, device="cpu", quiet=True) as llm:
        llm.generate([1, 2, 3], SamplingConfig(max_new_tokens=1))


def use_speculative_config(config: SpeculativeConfig, env) -> None:
    """Tokens generated with drafts (from a prompt that repeats itself, so n-gram lookup finds some)."""
    _generate(build(_model(), BuildConfig(**SMALL, max_draft_len=4), quiet=True),
              SamplingConfig(max_new_tokens=6), speculative_config=config)


def use_kv_cache_config(config: KvCacheConfig, env) -> None:
    _generate(build(_model(), BuildConfig(**SMALL), quiet=True), kv_cache_config=config)


def use_mapping(mapping: Mapping, env) -> None:
    """One rank of a tiny model sharded so, built; and the whole model saved as a checkpoint of that layout."""
    model = _model()
    build(model.shard(mapping), BuildConfig(**SMALL), quiet=True)
    model.save_checkpoint(env.tmp / "checkpoint", mapping=mapping)


def use_server_config(config: ServerConfig, env) -> None:
    """One completion through the HTTP app (authenticated when the config asks for a key)."""
    from fastapi.testclient import TestClient

    from kiln.server import create_app

    name, key = object.__getattribute__(config, "model_name"), object.__getattribute__(config, "api_key")
    with LLM(build(_model(), BuildConfig(**SMALL), quiet=True), device="cpu", quiet=True) as llm:
        with TestClient(create_app(llm, config)) as client:
            response = client.post("/v1/completions", json={"model": name, "prompt": [1, 2, 3], "max_tokens": 1},
                                   headers={"Authorization": f"Bearer {key}"} if key else {})
    assert response.status_code == 200, response.text


def _inside(cls: type):
    """Consumers of configs that are used as a part of a BuildConfig."""
    attribute = {PluginConfig: "plugin_config", LoraConfig: "lora_config", AutoParallelConfig: "auto_parallel_config"}
    return lambda config, env: use_build_config(BuildConfig(**SMALL, **{attribute[cls]: config}), env)


CONSUMERS = {
    "PluginConfig": [_inside(PluginConfig)], "LoraConfig": [_inside(LoraConfig)],
    "AutoParallelConfig": [_inside(AutoParallelConfig)], "BuildConfig": [use_build_config],
    "ConvertConfig": [use_convert_cli, use_checkpoint_in_build_file], "Mapping": [use_mapping],
    "ParallelConfig": [use_parallel_config], "PretrainedConfig": [use_pretrained_config],
    "QuantConfig": [use_quant_config], "KvCacheConfig": [use_kv_cache_config],
    "LoraCacheConfig": [use_lora_cache_config], "SpeculativeConfig": [use_speculative_config],
    "ModelConfig": [use_model_config],
    "SamplingConfig": [use_sampling_config],
    "ServerConfig": [use_server_config], "ModelSection": [use_model_section], "BuildFile": [use_build_file],
}
NAMED_CONSUMERS = {"serve": serve_parallel_config, "refit": refit_build_config}


@dataclasses.dataclass
class Env:
    hf_dir: Path
    tmp: Path


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    """conftest's tiny llama (with its tokenizer) as an HF directory."""
    path = tmp_path_factory.mktemp("options") / "tiny-llama"
    save_tiny_model("llama", path)
    return path


def _resolve(value, env: Env):
    if callable(value):
        return value()
    if isinstance(value, str):
        return value.replace("<hf>", str(env.hf_dir)).replace("<tmp>", str(env.tmp))
    return value


@pytest.mark.parametrize("cls, name", list(_cases()))
def test_no_field_is_silently_ignored(cls, name, tiny_path, tmp_path):
    row = VALUES[cls.__name__][name]
    value, context = row[0], row[1]
    env = Env(tiny_path, tmp_path)
    base = {k: _resolve(v, env) for k, v in {**BASES.get(cls.__name__, {}), **context}.items()}
    reads: set[str] = set()
    recorded = recording(cls, reads)
    try:
        config = recorded(**{**base, name: _resolve(value, env)})
    except ValueError:
        recorded(**base)                                  # the context alone is valid: the refusal is this field's
        return                                            # refused at a non-default value
    assert getattr(config, name) != _default(cls, name)
    if (cls.__name__, name) in SAME_ENGINE:
        return                                            # test_compatibility_fields_say_so
    consumers = [NAMED_CONSUMERS[row[2]]] if len(row) > 2 else CONSUMERS[cls.__name__]
    for consume in consumers:
        reads.clear()
        refusal = None
        try:
            consume(config, env)
        except ValueError as err:                         # refused by its consumer: it must have read the field
            refusal = err
        assert name in reads, (f"{cls.__name__}.{name}={value!r} was neither refused nor read by "
                               f"{consume.__name__} (which raised {refusal!r})")


def _default(cls: type, name: str):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


# ------------------------------------------------------------------------------------------------ the defects one by one
RANDOM_SHAPE = ["--vocab_size", "64", "--n_layer", "2", "--n_head", "4", "--n_embd", "64", "--inter_size", "128"]


def test_random_weights_are_quantized_by_the_convert_flags(tmp_path):
    """Without model_dir, kiln convert and a build file quantize the random model as they would an HF one."""
    import json

    import torch
    from safetensors.torch import load_file

    from kiln.cli.main import main
    from kiln.models import LlamaForCausalLM
    from kiln.quantization import quantize_model

    flags = ["--use_weight_only", "--weight_only_precision", "int8", "--calib_size", "1"]
    assert main(["convert", "--output_dir", str(tmp_path / "ckpt"), *RANDOM_SHAPE, *flags]) == 0
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization"]["quant_algo"] == "W8A16"
    written = load_file(tmp_path / "ckpt" / "rank0.safetensors")
    assert written["layers.0.attn.q_proj.weight"].dtype == torch.int8
    plain = LlamaForCausalLM.random(ConvertConfig(vocab_size=64, n_layer=2, n_head=4, n_embd=64,
                                                  inter_size=128).random_model_config("auto"))
    expected = quantize_model(plain, QuantConfig("W8A16"), calib_size=1, quiet=True).weights
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)

    (tmp_path / "build.yaml").write_text(f"""
model: {{output_dir: {tmp_path / 'engine'}}}
checkpoint: {{vocab_size: 64, n_layer: 2, n_head: 4, n_embd: 64, inter_size: 128, use_weight_only: true,
              weight_only_precision: int8, calib_size: 1}}
build: {{max_input_len: 16, max_seq_len: 32, max_batch_size: 2}}
""")
    assert main(["build", "--config", str(tmp_path / "build.yaml")]) == 0
    engine = json.loads((tmp_path / "engine" / "config.json").read_text())
    assert engine["pretrained_config"]["quantization"]["quant_algo"] == "W8A16"
    assert torch.int8 in {t.dtype for t in load_file(tmp_path / "engine" / "rank0.safetensors").values()}


def test_convert_options_kiln_cannot_honour_are_refused(tiny_path, tmp_path):
    from kiln.cli.main import main

    with pytest.raises(ValueError, match="meta_ckpt_dir='consolidated' is not supported"):
        ConvertConfig(meta_ckpt_dir="consolidated", **HF_SHAPE)
    with pytest.raises(ValueError, match="load_model_on_cpu=False is not supported"):
        ConvertConfig(load_model_on_cpu=False)
    with pytest.raises(ValueError, match="a random-weight model .* has none"):
        ConvertConfig(load_by_shard=True, tp_size=2, **HF_SHAPE).random_model_config("auto")
    (tmp_path / "build.yaml").write_text(f"""
model: {{model_dir: {tiny_path}}}
checkpoint: {{save_config_only: true}}
build: {{dry_run: true}}
""")
    assert main(["build", "--config", str(tmp_path / "build.yaml")]) == 2


def test_a_build_file_reads_by_shard_when_asked(tiny_path, tmp_path, monkeypatch):
    from kiln.checkpoint import hf
    from kiln.cli.main import main

    ranks = []
    original = hf.read_hf_rank_weights
    monkeypatch.setattr(hf, "read_hf_rank_weights", lambda d, c, mapping: (
        ranks.append(mapping.rank) or original(d, c, mapping)))
    (tmp_path / "build.yaml").write_text(f"""
model: {{model_dir: {tiny_path}, output_dir: {tmp_path / 'engine'}}}
checkpoint: {{tp_size: 2, load_by_shard: true}}
build: {{max_input_len: 16, max_seq_len: 32, max_batch_size: 2}}
""")
    assert main(["build", "--config", str(tmp_path / "build.yaml")]) == 0
    assert sorted(ranks) == [0, 1] and (tmp_path / "engine" / "rank1.safetensors").is_file()


def test_parallel_config_is_used_or_refused(tmp_path):
    with pytest.raises(ValueError, match="world_size=2 counts the ranks of auto_parallel"):
        ParallelConfig(world_size=2)
    assert ParallelConfig(tp_size=2, world_size=2).world_size == 2
    with pytest.raises(ValueError, match="max_memory_mb limits the search of auto_parallel"):
        ParallelConfig(max_memory_mb=1000)
    engine = build(_model(), BuildConfig(**SMALL), quiet=True)
    engine.save(tmp_path / "engine")
    for model in (engine, str(tmp_path / "engine")):
        for parallel in (ParallelConfig(tp_size=2), ParallelConfig(auto_parallel=True, world_size=2)):
            with pytest.raises(ValueError, match="disagrees with .* built for tp_size=1, pp_size=1"):
                LLM(model, parallel_config=parallel, device="cpu", quiet=True)
        with LLM(model, parallel_config=ParallelConfig(timeout_s=5), device="cpu", quiet=True) as llm:
            assert llm.generate([1, 2], SamplingConfig(max_new_tokens=1)).token_ids


def test_plugin_and_lora_options_kiln_cannot_honour_are_refused():
    assert PluginConfig().use_paged_context_fmha and PluginConfig(use_paged_context_fmha=True)
    for kwargs, words in (({"use_paged_context_fmha": False}, "always reads earlier tokens from the paged cache"),
                          ({"gemm_plugin": "disable"}, "gemm_plugin='disable' is not supported")):
        with pytest.raises(ValueError, match=words):
            PluginConfig(**kwargs)
    with pytest.raises(ValueError, match="lora_ckpt_source='nemo' is not supported by Kiln yet"):
        LoraConfig(lora_ckpt_source="nemo")
    assert LoraConfig(max_lora_rank=8).max_lora_rank == 8
    with pytest.raises(ValueError, match="apply to the search of enabled: true"):
        AutoParallelConfig(debug_mode=True)


def test_fp8_context_fmha_needs_an_fp8_cache_and_rounds_prompt_queries():
    """use_fp8_context_fmha: refused without an FP8 KV cache; with one, prompt steps on the CPU round each query row
    to e4m3 (the first token's log-probabilities move, a little)."""
    fp8 = PretrainedConfig(**TINY, quantization=QuantConfig(kv_cache_quant_algo="FP8"))
    flag = BuildConfig(**SMALL, plugin_config=PluginConfig(use_fp8_context_fmha=True))
    with pytest.raises(ValueError, match="use_fp8_context_fmha .* needs kv_cache_quant_algo FP8"):
        build(_model(), flag, quiet=True)
    model = _model(fp8)
    firsts = []
    for config in (BuildConfig(**SMALL), flag):
        with LLM(build(model, config, quiet=True), device="cpu", quiet=True) as llm:
            out = llm.generate([list(range(1, 12))], SamplingConfig(max_new_tokens=1, logprobs=3))
            firsts.append(out[0].outputs[0].logprobs[0].top)
    gaps = [abs(firsts[0][t] - firsts[1][t]) for t in firsts[0] if t in firsts[1]]
    assert gaps and 0 < max(gaps) < 0.1, firsts


def test_fp8_context_fmha_needs_fp8_tensor_cores(monkeypatch):
    """A GPU without FP8 tensor cores (an A100, 8.0) refuses use_fp8_context_fmha when the engine loads."""
    import torch

    from kiln.kernels import TritonOptions, select_ops

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="use_fp8_context_fmha .* NVIDIA A100 is 8.0"):
        select_ops("cuda", TritonOptions(fp8_context_fmha=True))


def test_auto_parallel_in_build_and_its_debug_mode(capsys):
    auto = AutoParallelConfig(enabled=True, pp_size=2, debug_mode=True)
    engine = build(_model(), BuildConfig(**SMALL, auto_parallel_config=auto), quiet=True)
    assert sorted(engine.weights) == [0, 1] and engine.pretrained_config.mapping.tp_size == 2
    err = capsys.readouterr().err
    assert "auto_parallel search over 2 ranks" in err
    assert "tp=2, pp=1: chosen" in err and "tp=1, pp=2: shards, but tp=2 is larger" in err


def test_max_output_len_is_enforced_per_request():
    engine = build(_model(), BuildConfig(max_batch_size=2, max_input_len=16, max_output_len=8, max_seq_len=20),
                   quiet=True)
    with LLM(engine, device="cpu", quiet=True) as llm:
        with pytest.raises(ValueError, match="max_new_tokens=9 exceeds the engine's max_output_len=8"):
            llm.generate([1, 2], SamplingConfig(max_new_tokens=9))
        with pytest.raises(ValueError, match=r"prompt \(16 tokens\) \+ max_new_tokens \(8\) = 24 exceeds .*max_seq_len=20"):
            llm.generate(list(range(16)), SamplingConfig(max_new_tokens=8))
        assert len(llm.generate([1, 2], SamplingConfig(max_new_tokens=8, end_id=-1)).token_ids) == 8


def test_callers_cap_their_default_length_at_max_output_len(tiny_path, tmp_path):
    """kiln run's default --max_new_tokens and the chat route's default max_tokens stay within max_output_len."""
    from fastapi.testclient import TestClient

    from kiln.cli.main import main
    from kiln.server import create_app

    with LLM(tiny_path, build_config=BuildConfig(max_batch_size=2, max_input_len=64, max_output_len=4,
                                                 max_seq_len=68), device="cpu", quiet=True) as llm:
        llm.save(tmp_path / "engine")
        with TestClient(create_app(llm)) as client:
            response = client.post("/v1/chat/completions",
                                   json={"model": "kiln", "messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 4
    assert main(["run", "--engine_dir", str(tmp_path / "engine"), "--device", "cpu", "Hello"]) == 0


def test_llm_refuses_what_it_cannot_apply():
    engine = build(_model(), BuildConfig(**SMALL), quiet=True)
    with pytest.raises(ValueError, match="free_gpu_memory_fraction sizes the cache on a GPU"):
        LLM(engine, kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.5), device="cpu", quiet=True)
    with pytest.raises(ValueError, match="is a built engine: build_config and dtype cannot change it"):
        LLM(engine, build_config=BuildConfig(**SMALL), device="cpu", quiet=True)
    with pytest.raises(ValueError, match="a loaded model keeps its own dtype"):
        LLM(_model(), dtype="float16", device="cpu", quiet=True)
    with pytest.raises(ValueError, match="parallelism is given twice"):
        LLM(_model(), build_config=BuildConfig(**SMALL, auto_parallel_config=AutoParallelConfig(enabled=True)),
            parallel_config=ParallelConfig(tp_size=2), device="cpu", quiet=True)
