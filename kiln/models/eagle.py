"""EAGLE draft heads (Li et al., 2024): one Llama decoder layer that predicts the model's next hidden state from its
current one and the next token's embedding; the model's own LM head turns the prediction into draft logits.

A head directory holds the public EAGLE layout: config.json (a Llama config of one layer) and pytorch_model.bin or
model.safetensors with
    fc.weight (H, 2H) [fc.bias (H)]        on [embedding of token i+1 | model's hidden state at i]
    layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
    layers.0.post_attention_layernorm.weight   (the first layer has no input norm; its weight, if stored, is unused)
    [embed_tokens.weight]                  (absent: the model's embedding)
The head runs in torch (reference kernels), one sequence at a time, over a dense KV cache of its own.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.config import PretrainedConfig
from kiln.kernels import reference
from kiln.kernels.rotary import rope_cos_sin

LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj")


class EagleHead:
    """An EAGLE head's weights, checked against the model it drafts for (`config`: the model's)."""

    def __init__(self, path: str | Path, config: PretrainedConfig, device: torch.device):
        path = Path(path)
        head_config = _read_config(path)
        hidden, heads = config.hidden_size, config.num_attention_heads
        for key, mine in (("hidden_size", hidden), ("num_attention_heads", heads)):
            if head_config.get(key, mine) != mine:
                raise ValueError(f"EAGLE head {path}: {key}={head_config.get(key)} differs from the model's {mine}")
        self.heads = heads
        self.kv_heads = head_config.get("num_key_value_heads") or heads
        self.head_dim = hidden // heads
        self.eps = head_config.get("rms_norm_eps", config.norm_epsilon)
        dtype = getattr(torch, config.dtype)
        weights = {name: t.to(device=device, dtype=dtype) for name, t in _read_weights(path).items()}
        shapes = {"fc.weight": (hidden, 2 * hidden), "layers.0.post_attention_layernorm.weight": (hidden,),
                  "layers.0.self_attn.q_proj.weight": (heads * self.head_dim, hidden),
                  "layers.0.self_attn.k_proj.weight": (self.kv_heads * self.head_dim, hidden),
                  "layers.0.self_attn.v_proj.weight": (self.kv_heads * self.head_dim, hidden),
                  "layers.0.self_attn.o_proj.weight": (hidden, heads * self.head_dim)}
        for name, shape in shapes.items():
            if name not in weights:
                raise ValueError(f"EAGLE head {path}: tensor {name} is missing")
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"EAGLE head {path}: {name} has shape {tuple(weights[name].shape)}, the model "
                                 f"needs {shape}")
        for name in LAYER[4:]:
            if f"layers.0.{name}.weight" not in weights:
                raise ValueError(f"EAGLE head {path}: tensor layers.0.{name}.weight is missing")
        self.w = weights
        self.cos_sin = rope_cos_sin(config.max_position_embeddings, self.head_dim, config.rotary_base,
                                    config.rope_scaling).to(device)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor] | None):
        """The head's predicted hidden states (m, H) for m positions, given the next tokens' embeddings and the
        model's hidden states there (m, H each), attending to `cache` (keys, values of the positions before, or
        None); returns (predictions, cache extended by these positions)."""
        w = self.w
        x = F.linear(torch.cat([embeds, features], dim=-1), w["fc.weight"], w.get("fc.bias"))
        m = x.shape[0]
        q = F.linear(x, w["layers.0.self_attn.q_proj.weight"]).view(m, self.heads, self.head_dim)
        k = F.linear(x, w["layers.0.self_attn.k_proj.weight"]).view(m, self.kv_heads, self.head_dim)
        v = F.linear(x, w["layers.0.self_attn.v_proj.weight"]).view(m, self.kv_heads, self.head_dim)
        q, k = reference.rotary(q, k, positions, self.cos_sin)
        keys = k if cache is None else torch.cat([cache[0], k])
        values = v if cache is None else torch.cat([cache[1], v])
        group = self.heads // self.kv_heads
        before = keys.shape[0] - m
        mask = torch.ones(m, keys.shape[0], dtype=torch.bool, device=x.device).tril(before)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys.repeat_interleave(group, 1).transpose(0, 1),
                                              values.repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask)
        x = x + F.linear(attn.transpose(0, 1).reshape(m, -1), w["layers.0.self_attn.o_proj.weight"])
        h = reference.rms_norm(x, w["layers.0.post_attention_layernorm.weight"], self.eps)
        mlp = F.silu(F.linear(h, w["layers.0.mlp.gate_proj.weight"])) * F.linear(h, w["layers.0.mlp.up_proj.weight"])
        return x + F.linear(mlp, w["layers.0.mlp.down_proj.weight"]), (keys, values)


def _read_config(path: Path) -> dict:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"EAGLE head {path}: config.json is missing")
    try:
        return json.loads((path / "config.json").read_text())
    except ValueError as err:
        raise ValueError(f"EAGLE head {path}: config.json is corrupt ({err})") from None


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"EAGLE head {path}: neither model.safetensors nor pytorch_model.bin is there")
