"""Acceptance 3: HF → checkpoint → engine → Engine.from_dir keeps every tensor bit-exact, and the YAML path
builds the same engine (same hash) as the CLI flags path."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kiln import BuildConfig, Engine, build
from kiln.cli.main import main
from kiln.models import LlamaForCausalLM


def _hf_fused(hf_dir, config) -> dict[str, torch.Tensor]:
    """The HF tensors, fused the way the engine layout documents (independent of kiln's own code)."""
    hf = load_file(str(hf_dir / "model.safetensors"))
    get = lambda name: hf["model." + name]  # noqa: E731
    out = {"embed_tokens.weight": get("embed_tokens.weight"), "norm.weight": get("norm.weight")}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        p, k = f"layers.{i}.", f"layers.{i}."
        out[k + "input_norm.weight"] = get(p + "input_layernorm.weight")
        out[k + "post_attn_norm.weight"] = get(p + "post_attention_layernorm.weight")
        for kind in ["weight"] + (["bias"] if config.attention_bias else []):
            out[f"{k}attn.qkv_proj.{kind}"] = torch.cat([get(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"])
        for kind in ["weight"] + (["bias"] if config.dense_bias else []):
            out[f"{k}attn.o_proj.{kind}"] = get(f"{p}self_attn.o_proj.{kind}")
        if config.is_moe:
            experts = range(config.moe_num_experts)
            moe = lambda w: torch.stack([get(f"{p}block_sparse_moe.experts.{e}.{w}.weight") for e in experts])  # noqa: E731
            out[k + "moe.router.weight"] = get(p + "block_sparse_moe.gate.weight")
            out[k + "moe.gate_up_proj"] = torch.cat([moe("w1"), moe("w3")], dim=1)
            out[k + "moe.down_proj"] = moe("w2")
        else:
            for kind in ["weight"] + (["bias"] if config.mlp_bias else []):
                out[f"{k}mlp.gate_up_proj.{kind}"] = torch.cat([get(f"{p}mlp.gate_proj.{kind}"), get(f"{p}mlp.up_proj.{kind}")])
                out[f"{k}mlp.down_proj.{kind}"] = get(f"{p}mlp.down_proj.{kind}")
    return out


@pytest.mark.parametrize("name", ["llama31_bias_tied", "qwen2", "mixtral"])
def test_every_tensor_survives_bit_exact(name, tiny_models, tmp_path):
    hf_dir, _ = tiny_models[name]
    LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True).save_checkpoint(tmp_path / "ckpt")
    model = LlamaForCausalLM.from_checkpoint(tmp_path / "ckpt")
    build(model, BuildConfig(max_input_len=32, max_seq_len=64), quiet=True).save(tmp_path / "engine")
    engine = Engine.from_dir(tmp_path / "engine")
    expected = _hf_fused(hf_dir, engine.pretrained_config)
    weights = engine.weights[0]
    assert set(weights) == set(expected)
    for key, tensor in expected.items():
        assert weights[key].dtype == tensor.dtype and torch.equal(weights[key], tensor), key
    assert (tmp_path / "engine" / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()


def test_yaml_path_gives_the_cli_engine(tiny_models, tmp_path):
    hf_dir, _ = tiny_models["llama"]
    yaml_file = tmp_path / "build.yaml"
    yaml_file.write_text(f"""
model:
  model_dir: {hf_dir}
  output_dir: {tmp_path / 'engine_yaml'}
  dtype: float32
checkpoint:
  tp_size: 1
  pp_size: 1
  vocab_size: 320
  n_layer: 2
  n_head: 4
  n_embd: 64
  inter_size: 128
build:
  max_input_len: 64
  max_output_len: 64
  max_batch_size: 4
  max_beam_width: 1
  strongly_typed: false
  gather_context_logits: true
  lora_config:
  auto_parallel_config:
  plugin_config:
    tokens_per_block: 16
    use_paged_context_fmha: true
""")
    assert main(["build", "--config", str(yaml_file)]) == 0
    assert main(["convert", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "ckpt"), "--dtype", "float32"]) == 0
    assert main(["build", "--checkpoint_dir", str(tmp_path / "ckpt"), "--output_dir", str(tmp_path / "engine_cli"),
                 "--max_input_len", "64", "--max_output_len", "64", "--max_batch_size", "4",
                 "--gather_context_logits", "--tokens_per_block", "16", "--use_paged_context_fmha", "enable"]) == 0
    hashes = [json.loads((tmp_path / d / "config.json").read_text())["hash"] for d in ("engine_yaml", "engine_cli")]
    assert hashes[0] == hashes[1]
    other = main(["build", "--checkpoint_dir", str(tmp_path / "ckpt"), "--output_dir", str(tmp_path / "engine_other"),
                  "--max_input_len", "64", "--max_output_len", "64", "--max_batch_size", "8"])
    assert other == 0
    assert json.loads((tmp_path / "engine_other" / "config.json").read_text())["hash"] != hashes[0]
