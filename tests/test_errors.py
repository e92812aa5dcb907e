"""Acceptance 4: bad input gets a clear error naming the problem, and no partial output is left behind."""
from __future__ import annotations

import json
import shutil

import pytest

from kiln import LLM, BuildConfig, Engine, SamplingConfig, build
from kiln.cli.main import main
from kiln.config import load_build_file
from kiln.models import LlamaForCausalLM

SMALL = BuildConfig(max_batch_size=2, max_input_len=16, max_seq_len=32)


@pytest.fixture(scope="module")
def engine_dir(tiny_models, tmp_path_factory):
    path = tmp_path_factory.mktemp("errors") / "engine"
    build(LlamaForCausalLM.from_hugging_face(tiny_models["llama"][0], quiet=True), SMALL, quiet=True).save(path)
    return path


def _leftovers(parent):
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_missing_directory(tmp_path, capsys):
    missing = tmp_path / "nope"
    for load in (LLM, LlamaForCausalLM.from_hugging_face, LlamaForCausalLM.from_checkpoint, Engine.from_dir):
        with pytest.raises(FileNotFoundError, match="nope"):
            load(missing)
    assert main(["convert", "--model_dir", str(missing), "--output_dir", str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_directory_without_weights(tiny_models, tmp_path):
    shutil.copy(tiny_models["llama"][0] / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no model weights"):
        LlamaForCausalLM.from_hugging_face(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a model: no config.json and no .gguf"):
        LLM(tmp_path / "empty")


def test_unknown_architecture(tiny_models, tmp_path):
    config = json.loads((tiny_models["llama"][0] / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM.*MixtralForCausalLM"):
        LLM(tmp_path)


def test_unsupported_rope_scaling_is_named(tiny_models, tmp_path):
    shutil.copytree(tiny_models["llama"][0], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        LlamaForCausalLM.from_hugging_face(tmp_path / "m")


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_truncated_hf_safetensors(tiny_models, tmp_path):
    shutil.copytree(tiny_models["llama"][0], tmp_path / "m")
    _truncate(tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors: corrupt or truncated"):
        LlamaForCausalLM.from_hugging_face(tmp_path / "m")
    assert main(["convert", "--model_dir", str(tmp_path / "m"), "--output_dir", str(tmp_path / "ckpt")]) == 2
    assert not (tmp_path / "ckpt").exists() and not _leftovers(tmp_path)


def test_truncated_checkpoint_and_engine(tiny_models, engine_dir, tmp_path):
    LlamaForCausalLM.from_hugging_face(tiny_models["llama"][0], quiet=True).save_checkpoint(tmp_path / "ckpt")
    _truncate(tmp_path / "ckpt" / "rank0.safetensors")
    with pytest.raises(ValueError, match="rank0.safetensors: corrupt or truncated"):
        LlamaForCausalLM.from_checkpoint(tmp_path / "ckpt")
    shutil.copytree(engine_dir, tmp_path / "engine")
    _truncate(tmp_path / "engine" / "rank0.safetensors")
    with pytest.raises(ValueError, match="corrupt or truncated engine weights"):
        LLM(tmp_path / "engine")


def test_engine_from_another_version(engine_dir, tmp_path):
    shutil.copytree(engine_dir, tmp_path / "engine")
    config = json.loads((tmp_path / "engine" / "config.json").read_text())
    config["version"] = "0.0.1"
    (tmp_path / "engine" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"built by Kiln 0\.0\.1.*rebuild"):
        Engine.from_dir(tmp_path / "engine")


def test_engine_with_edited_config(engine_dir, tmp_path):
    shutil.copytree(engine_dir, tmp_path / "engine")
    config = json.loads((tmp_path / "engine" / "config.json").read_text())
    config["build_config"]["max_batch_size"] = 64
    (tmp_path / "engine" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hash mismatch"):
        LLM(tmp_path / "engine")
    (tmp_path / "engine" / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="corrupt"):
        LLM(tmp_path / "engine")


def test_weights_of_another_engine(tiny_models, engine_dir, tmp_path):
    other = tmp_path / "other"
    build(LlamaForCausalLM.from_hugging_face(tiny_models["llama"][0], quiet=True),
          BuildConfig(max_batch_size=3, max_input_len=16, max_seq_len=32), quiet=True).save(other)
    shutil.copy(engine_dir / "rank0.safetensors", other / "rank0.safetensors")
    with pytest.raises(ValueError, match="belongs to another engine"):
        Engine.from_dir(other)


def test_unknown_yaml_keys(tmp_path):
    cases = {"build:\n  max_batch_sise: 8\n": "unknown key 'max_batch_sise' in .*build",
             "checkpoint:\n  n_layers: 2\n": "unknown key 'n_layers' in .*checkpoint",
             "build:\n  plugin_config:\n    gemm: auto\n": "unknown key 'gemm' in .*plugin_config",
             "modle:\n  model_dir: x\n": "unknown section 'modle'"}
    for text, pattern in cases.items():
        (tmp_path / "b.yaml").write_text(text)
        with pytest.raises(ValueError, match=pattern):
            load_build_file(tmp_path / "b.yaml")


def test_yaml_shape_disagreeing_with_the_model(tiny_models, tmp_path, capsys):
    (tmp_path / "b.yaml").write_text(f"model:\n  model_dir: {tiny_models['llama'][0]}\n  output_dir: {tmp_path / 'e'}\n"
                                     "checkpoint:\n  vocab_size: 32000\n")
    assert main(["build", "--config", str(tmp_path / "b.yaml")]) == 2
    assert "checkpoint.vocab_size=32000 disagrees with the model's vocab_size=320" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_unsupported_build_fields(tiny_models, tmp_path, capsys):
    for kwargs, pattern in (({"max_draft_len": -1}, "max_draft_len must be a whole number >= 0"),
                            ({"enable_debug_output": True}, "enable_debug_output=True is not supported"),
                            ({"plugin_config": {"paged_kv_cache": False}}, "paged_kv_cache=False is not supported")):
        with pytest.raises(ValueError, match=pattern):
            BuildConfig(**kwargs)
    hf_dir = str(tiny_models["llama"][0])
    assert main(["build", "--model_dir", hf_dir, "--output_dir", str(tmp_path / "e"), "--weight_sparsity"]) == 2
    assert "is not 2:4 sparse" in capsys.readouterr().err                   # a dense model with the flag
    assert main(["build", "--model_dir", hf_dir, "--output_dir", str(tmp_path / "e"), "--auto_parallel", "3"]) == 2
    assert "not divisible by tp_size=3" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() and not _leftovers(tmp_path)


def test_prompt_limits(engine_dir):
    llm = LLM(engine_dir, quiet=True)
    with pytest.raises(ValueError, match=r"prompt has 17 tokens, more than the engine's max_input_len=16"):
        llm.generate([list(range(17))])
    with pytest.raises(ValueError, match=r"max_new_tokens=30 exceeds the engine's max_output_len=16"):
        llm.generate([list(range(10))], SamplingConfig(max_new_tokens=30))
    with pytest.raises(ValueError, match="token id 999 is not in the vocabulary"):
        llm.generate([[1, 999]])
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="num_beams=2 exceeds the engine's max_beam_width=1"):
        llm.generate([[1, 2]], SamplingConfig(num_beams=2, max_new_tokens=4))


@pytest.mark.parametrize("field, value", [("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
                                          ("max_new_tokens", 0), ("num_beams", 0)])
def test_bad_sampling_values(field, value):
    with pytest.raises(ValueError, match=f"SamplingConfig.{field}="):
        SamplingConfig(**{field: value})


def test_failed_write_leaves_nothing_and_keeps_the_old_engine(tiny_models, engine_dir, tmp_path, monkeypatch):
    from kiln.checkpoint.safetensors_file import TensorWriter

    shutil.copytree(engine_dir, tmp_path / "engine")
    before = sorted(p.name for p in (tmp_path / "engine").iterdir())
    engine = build(LlamaForCausalLM.from_hugging_face(tiny_models["qwen2"][0], quiet=True), SMALL, quiet=True)

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(TensorWriter, "write", broken_save)
    for target in (tmp_path / "engine", tmp_path / "new_engine"):
        with pytest.raises(OSError, match="disk full"):
            engine.save(target)
    assert sorted(p.name for p in (tmp_path / "engine").iterdir()) == before
    assert Engine.from_dir(tmp_path / "engine").pretrained_config.architecture == "LlamaForCausalLM"
    assert not (tmp_path / "new_engine").exists() and not _leftovers(tmp_path)


def test_truncated_gguf(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 5)
    with pytest.raises(ValueError, match="corrupt or truncated GGUF"):
        LlamaForCausalLM.from_hugging_face(tmp_path / "m.gguf")
