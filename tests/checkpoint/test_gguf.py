"""GGUF import: a tiny model written in llama.cpp's layout (q/k rows permuted, GGML names) imports back to
the transformers model it came from."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import hf_logits
from kiln import LLM, BuildConfig, SamplingConfig
from kiln.models import LlamaForCausalLM


def _llamacpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows (written here independently of Kiln's inverse)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_model, path, quantize_q8: bool = False):
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    sd = {k: v.float() for k, v in hf_model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf_name, tensor in sd.items():
        gg = names[hf_name]
        if gg.endswith("attn_q.weight"):
            tensor = _llamacpp_permute(tensor, cfg.num_attention_heads)
        elif gg.endswith("attn_k.weight"):
            tensor = _llamacpp_permute(tensor, cfg.num_key_value_heads)
        array = tensor.numpy()
        if quantize_q8 and array.ndim == 2:
            q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gg, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gg, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("quantized", [False, True])
def test_gguf_import_matches_the_source_model(tiny_models, tmp_path, quantized):
    import gguf

    hf_dir, hf_model = tiny_models["llama"]
    write_gguf(hf_model, tmp_path / "tiny.gguf", quantize_q8=quantized)
    model = LlamaForCausalLM.from_hugging_face(tmp_path / "tiny.gguf", quiet=True)
    assert model.config.num_key_value_heads == 2 and not model.config.tie_word_embeddings
    hf_q = hf_model.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    if quantized:  # Q8_0 round trip of the reference tensor, done by gguf itself
        ref = gguf.quants.dequantize(gguf.quants.quantize(hf_q.numpy(), gguf.GGMLQuantizationType.Q8_0),
                                     gguf.GGMLQuantizationType.Q8_0)
        assert torch.equal(model.weights["layers.1.attn.q_proj.weight"], torch.from_numpy(ref))
        return
    assert torch.equal(model.weights["layers.1.attn.q_proj.weight"], hf_q)
    llm = LLM(model, build_config=BuildConfig(max_input_len=32, max_seq_len=64, gather_context_logits=True), quiet=True)
    prompt = list(range(3, 30))
    out = llm.generate(prompt, SamplingConfig(max_new_tokens=4, end_id=-1))
    ref = hf_logits(hf_model, prompt)
    assert (out.context_logits - ref).abs().max() <= 1e-4 * ref.abs().max()
