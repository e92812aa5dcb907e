"""The command line: kiln convert / build / run, and kiln-build with trtllm-build's flag names."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import torch

from conftest import DATA, ROOT
from kiln import BuildConfig, Engine
from kiln.cli.main import build_main, main
from kiln.models import LlamaForCausalLM


@pytest.fixture(scope="module")
def ckpt(tiny_models, tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    assert main(["convert", "--model_dir", str(tiny_models["llama"][0]), "--output_dir", str(path)]) == 0
    return path


def test_kiln_build_takes_trtllm_build_flags(ckpt, tmp_path):
    rc = build_main(["--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "e"), "--gemm_plugin", "auto",
                     "--gpt_attention_plugin", "float32", "--context_fmha", "enable", "--remove_input_padding", "enable",
                     "--paged_kv_cache", "enable", "--tokens_per_block", "16", "--max_batch_size", "3",
                     "--max_input_len", "40", "--max_seq_len", "100", "--gather_all_token_logits"])
    assert rc == 0
    build = Engine.from_dir(tmp_path / "e").build_config
    assert (build.max_batch_size, build.max_input_len, build.max_output_len, build.max_seq_len) == (3, 40, 60, 100)
    assert build.plugin_config.tokens_per_block == 16 and build.gather_generation_logits
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "rank0.safetensors", "tokenizer.json",
        "tokenizer_config.json"]


def test_dry_run_writes_nothing_and_visualize_writes_the_graph(ckpt, tmp_path, capsys):
    assert main(["build", "--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "e"), "--dry_run"]) == 0
    assert not (tmp_path / "e").exists() and list(tmp_path.iterdir()) == []
    assert main(["build", "--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "e"), "--visualize_network",
                 "--profiling_verbosity", "detailed"]) == 0
    text = (tmp_path / "e" / "network.txt").read_text()
    assert "DecoderLayer" in text and "layers.1.attn.qkv_proj.weight\t(128, 64)\tfloat32" in text
    err = capsys.readouterr().err
    assert "Build [1/3]" in err and "Build [3/3] done in" in err


def test_run_applies_the_chat_template(ckpt, tmp_path, capsys):
    assert main(["build", "--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "e")]) == 0
    capsys.readouterr()
    assert main(["run", "--engine_dir", str(tmp_path / "e"), "--max_new_tokens", "5", "hello", "wörld"]) == 0
    out = capsys.readouterr().out
    assert "> hello\n" in out and "> wörld\n" in out
    assert main(["run", "--engine_dir", str(tmp_path / "e"), "--max_new_tokens", "5", "--no_chat_template", "hi"]) == 0


def test_convert_random_model_and_config_only(tmp_path):
    shape = ["--vocab_size", "100", "--n_layer", "2", "--n_head", "4", "--n_embd", "32", "--inter_size", "64"]
    assert main(["convert", "--output_dir", str(tmp_path / "rand"), *shape, "--n_kv_head", "2"]) == 0
    model = LlamaForCausalLM.from_checkpoint(tmp_path / "rand")
    assert (model.config.num_key_value_heads, model.config.vocab_size) == (2, 100)
    assert main(["convert", "--output_dir", str(tmp_path / "cfg"), *shape, "--save_config_only"]) == 0
    assert [p.name for p in (tmp_path / "cfg").iterdir()] == ["config.json"]
    assert json.loads((tmp_path / "cfg" / "config.json").read_text())["kiln_format"] == "kiln-checkpoint"
    assert main(["convert", "--output_dir", str(tmp_path / "bad"), "--vocab_size", "100"]) == 2


def test_flags_carry_their_field_docs(capsys):
    with pytest.raises(SystemExit):
        main(["build", "--help"])
    help_text = capsys.readouterr().out
    assert "--max_num_tokens" in help_text and "Most tokens (prompt chunks + generated)" in help_text
    assert "--use_paged_context_fmha" in help_text


@pytest.mark.skipif(shutil.which("kiln-build") is None, reason="package scripts not installed")
def test_installed_scripts():
    for cmd in (["kiln", "--help"], ["kiln-build", "--help"]):
        assert subprocess.run(cmd, capture_output=True, text=True, timeout=120).returncode == 0


def test_bench_throughput_with_few_new_tokens_on_the_device_it_picks(capsys):
    """kiln bench throughput on a random SmolLM2-shaped engine: the warm-up (a wave and a half of the workload's
    prompts) must fit the engine built for the workload, also when it asks for fewer new tokens than the warm-up's.
    Without --device and --dtype it runs on the GPU, or on the CPU in float32 and says so."""
    assert main(["bench", "throughput", "--model", "smollm2-135m", "--num_requests", "3", "--input_len", "8",
                 "--output_len", "2", "--max_batch_size", "2", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["num_requests"] == 3 and result["output_tokens"] == 6
    if not torch.cuda.is_available():
        assert "no CUDA GPU is visible: running on the CPU in float32" in captured.err
        assert result["dtype"] == "float32"


def test_bench_limits_count_the_routed_experts_only(monkeypatch):
    """An MoE token reads and multiplies top_k of num_experts experts: the decode limit's bytes and the throughput
    limit's FLOPs are the dense tensors' plus that share of the experts' (here top-2 of 8: a quarter)."""
    from kiln import benchmark as bench
    from kiln.config import QuantConfig

    monkeypatch.setitem(bench.SHAPES, "tiny-moe", dict(bench.SHAPES["mixtral-8x7b"], vocab_size=256, hidden_size=64,
                        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    engine = bench.random_engine("tiny-moe", "float32", BuildConfig(max_input_len=8, max_seq_len=16), "cpu",
                                 quant_config=QuantConfig("W8A16"))
    sizes = {name: (t.numel(), t.numel() * t.element_size()) for name, t in engine.weights[0].items()}
    expert = [n for n in sizes if ".moe." in n and "router" not in n]
    assert len(expert) == 8 and all(engine.weights[0][n].shape[0] == 8 for n in expert)
    dense_bytes = sum(b for n, (_, b) in sizes.items() if n not in expert)
    active_bytes = dense_bytes + sum(sizes[n][1] for n in expert) / 4
    active_params = sum(p for n, (p, _) in sizes.items() if n not in expert and "embed" not in n) + \
        sum(sizes[n][0] for n in expert) / 4
    hw = bench.Hardware("test", copy_bytes_per_s=1e9, gemm_flops=1e12)
    result = bench.BenchResult("latency", "tiny-moe", "float32", 1, 8, 4, 2.0, 4, 2.0, 0.5, {}, {"p50": 1.0}, 0.0)
    bench.decode_limit_pct(result, engine, hw)
    assert result.hardware_limit_pct == pytest.approx(100 * active_bytes / 1e9 / 1e-3)
    assert "active weights" in result.limit_note
    bench.throughput_limit_pct(result, engine, hw)
    assert result.hardware_limit_pct == pytest.approx(100 * 2 * active_params * 12 / 1e12 / 2.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU that is not there")
def test_bench_on_cuda_without_a_gpu_is_a_clear_error(capsys):
    assert main(["bench", "latency", "--model", "smollm2-135m", "--device", "cuda"]) == 2
    assert "kiln bench: error: --device cuda: torch sees no CUDA GPU here" in capsys.readouterr().err


def test_bench_dtype_belongs_to_model_builds(capsys):
    assert main(["bench", "latency", "--engine_dir", "E", "--dtype", "float16", "--device", "cpu"]) == 2
    assert "--dtype applies to --model" in capsys.readouterr().err


def test_bench_build_options_belong_to_model_builds(capsys):
    assert main(["bench", "throughput", "--engine_dir", "E", "--use_fp8_context_fmha", "--max_batch_size", "8",
                 "--device", "cpu"]) == 2
    assert "--max_batch_size, --use_fp8_context_fmha apply to --model builds" in capsys.readouterr().err


def test_bench_quantize_lm_head_needs_a_quant_algo(capsys):
    assert main(["bench", "throughput", "--model", "smollm2-135m", "--device", "cpu", "--quantize_lm_head"]) == 2
    assert "--quantize_lm_head needs --quant_algo" in capsys.readouterr().err


COMMANDS = ["convert", "build", "run", "demo", "bench", "eval", "serve"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_shows_defaults_and_examples(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = capsys.readouterr().out
    assert help_text.startswith(f"usage: kiln {command} ")
    assert "(default: " in help_text
    assert f"  kiln {command}" in help_text.split("\nexamples:\n")[1]


def test_help_shows_the_defaults_of_config_fields(capsys):
    with pytest.raises(SystemExit):
        main(["build", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Most requests in flight at once. (default: 8)" in help_text
    assert "Return the logits of every prompt position. (default: disable)" in help_text
    assert "--workers WORKERS ranks loaded and built at a time (default: 1)" in help_text


def test_kiln_build_help_names_itself(capsys):
    with pytest.raises(SystemExit):
        build_main(["--help"])
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage: kiln-build ") and "  kiln-build --checkpoint_dir CKPT" in help_text


@pytest.mark.parametrize("argv, usage, hint", [
    (["build", "--checkpoint_dir", "C", "--max_batch_sise", "8"], "usage: kiln build ", "did you mean --max_batch_size?"),
    (["run", "--engine_dir", "E", "--temprature=0.5", "hi"], "usage: kiln run ", "did you mean --temperature?"),
    (["bench", "latency", "--model", "m", "--input-len", "8"], "usage: kiln bench ", "did you mean --input_len?"),
])
def test_a_mistyped_flag_gets_the_commands_usage_and_a_suggestion(argv, usage, hint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(usage) and hint in err and "unrecognized arguments" in err


def test_kiln_build_suggests_too(capsys):
    with pytest.raises(SystemExit):
        build_main(["--checkpoint_dir", "C", "--tokens_per_blok", "16"])
    err = capsys.readouterr().err
    assert err.startswith("usage: kiln-build ") and "did you mean --tokens_per_block?" in err


def test_the_documented_build_file_builds_a_tiny_model(tiny_models, tmp_path):
    """docs/build.yaml as written, with its model and output paths pointed at a tiny model and a temporary
    directory: kiln build --config accepts it and the engine has its settings."""
    text = (ROOT / "docs" / "build.yaml").read_text()
    text, found = re.subn(r"(?m)^(  model_dir:) \S+", rf"\1 {tiny_models['llama'][0]}", text)
    text, found_out = re.subn(r"(?m)^(  output_dir:) \S+", rf"\1 {tmp_path / 'engine'}", text)
    assert found == found_out == 1
    (tmp_path / "build.yaml").write_text(text)
    assert main(["build", "--config", str(tmp_path / "build.yaml")]) == 0
    engine = Engine.from_dir(tmp_path / "engine")
    build = engine.build_config
    assert (build.max_batch_size, build.max_input_len, build.max_seq_len, build.max_num_tokens) == (8, 256, 512, 1024)
    assert engine.pretrained_config.dtype == "bfloat16"
    assert engine.pretrained_config.quantization.quant_algo == "W8A16"


def test_eval_ppl_shows_its_progress(ckpt, tmp_path, capsys):
    assert main(["build", "--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "e")]) == 0
    capsys.readouterr()
    text = DATA / "eval.txt"
    assert main(["eval", "ppl", "--engine_dir", str(tmp_path / "e"), "--text", str(text), "--window", "64"]) == 0
    from kiln.tokenizer import load_tokenizer

    tokens = load_tokenizer(Engine.from_dir(tmp_path / "e").tokenizer_files).encode(text.read_text())
    windows = -(-(len(tokens) - 1) // 64)
    assert f"Scoring windows:   0%|          | 0/{windows}" in capsys.readouterr().err
