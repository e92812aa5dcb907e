"""The Kiln checkpoint layout: tensor names and shapes for a PretrainedConfig (one rank, unfused)."""
from __future__ import annotations

from kiln.config import PretrainedConfig


def checkpoint_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `config` holds, with its shape."""
    h, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_out, kv_out = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (config.vocab_size, h), "norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        shapes[p + "input_norm.weight"] = (h,)
        shapes[p + "post_attn_norm.weight"] = (h,)
        for name, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            shapes[f"{p}attn.{name}.weight"] = (out, h)
            if config.attention_bias:
                shapes[f"{p}attn.{name}.bias"] = (out,)
        shapes[p + "attn.o_proj.weight"] = (h, q_out)
        if config.dense_bias:
            shapes[p + "attn.o_proj.bias"] = (h,)
        if config.is_moe:
            e = config.moe_num_experts
            shapes[p + "moe.router.weight"] = (e, h)
            shapes[p + "moe.gate_proj"] = (e, inter, h)
            shapes[p + "moe.up_proj"] = (e, inter, h)
            shapes[p + "moe.down_proj"] = (e, h, inter)
        else:
            for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                shapes[f"{p}mlp.{name}.weight"] = shape
                if config.mlp_bias:
                    shapes[f"{p}mlp.{name}.bias"] = shape[:1]
    return shapes


def check_weights(weights: dict, config: PretrainedConfig, source: str) -> None:
    """Every expected tensor present with its shape, nothing unexpected; else a ValueError naming it."""
    expected = checkpoint_shapes(config)
    missing = [n for n in expected if n not in weights]
    if missing:
        raise ValueError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    extra = [n for n in weights if n not in expected]
    if extra:
        raise ValueError(f"{source}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all)")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")
