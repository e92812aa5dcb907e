"""One decoder for the Llama family: Llama 2/3/3.1, Mistral, Qwen2 (q/k/v bias) and Mixtral (MoE).

The network runs on packed tokens (no padding) over a paged KV cache; every op goes through kiln.kernels.
Its weights are the engine layout: q/k/v and gate/up fused (see fuse_weights).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import PretrainedConfig
from kiln.kernels import AttentionMetadata, ReferenceOps, reference, rope_cos_sin, select_ops

from .base import PretrainedModel


class RMSNorm(nn.Module):
    ops = ReferenceOps  # the kernels; DecoderForCausalLM.load sets the device's choice on every module

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x, residual=None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    ops = ReferenceOps

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=config.dense_bias)
        self.scale = self.head_dim ** -0.5
        self.sliding_window = config.sliding_window

    def forward(self, x, positions, meta: AttentionMetadata, kv_cache, cos_sin):
        t = x.shape[0]
        qkv = self.ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q = self.ops.rope_and_cache(qkv, meta, positions, cos_sin, kv_cache,
                                    self.heads, self.kv_heads, self.head_dim)          # (T, H, D); k, v cached
        out = self.ops.attention(q, kv_cache, meta, self.scale, self.sliding_window)  # (T, H, D)
        return self.ops.linear(out.reshape(t, self.heads * self.head_dim), self.o_proj.weight, self.o_proj.bias)


class GatedMLP(nn.Module):
    ops = ReferenceOps

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x):
        gate_up = self.ops.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        return self.ops.linear(self.ops.silu_and_mul(gate_up), self.down_proj.weight, self.down_proj.bias)


class MoE(nn.Module):
    ops = ReferenceOps

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        e, h, i = config.moe_num_experts, config.hidden_size, config.intermediate_size
        self.router = nn.Linear(h, e, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.top_k, self.renormalize = config.moe_top_k, config.moe_renorm_mode == 1

    def forward(self, x):
        return self.ops.moe(x, self.router.weight, self.gate_up_proj, self.down_proj, self.top_k, self.renormalize)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.norm_epsilon)
        self.attn = Attention(config)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.norm_epsilon)
        if config.is_moe:
            self.moe = MoE(config)
        else:
            self.mlp = GatedMLP(config)

    def forward(self, x, residual, positions, meta, kv_cache, cos_sin):
        x, residual = self.input_norm(x, residual)
        x = self.attn(x, positions, meta, kv_cache, cos_sin)
        x, residual = self.post_attn_norm(x, residual)
        return (self.moe(x) if hasattr(self, "moe") else self.mlp(x)), residual


class DecoderForCausalLM(nn.Module):
    """The runtime network: packed token ids → hidden states → logits."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_epsilon)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.cos_sin: torch.Tensor | None = None  # (max_seq_len, head_dim), set by load()

    @classmethod
    def load(cls, config: PretrainedConfig, weights: dict[str, torch.Tensor], max_seq_len: int,
             device: torch.device | str = "cpu", ops=None) -> "DecoderForCausalLM":
        """Build on the meta device, adopt `weights` (engine layout) without copying them, pick the kernels."""
        with torch.device("meta"):
            net = cls(config)
        try:
            net.load_state_dict({k: v.to(device) for k, v in weights.items()}, strict=True, assign=True)
        except RuntimeError as err:
            raise ValueError(f"engine weights do not match the engine's config: {err}") from None
        net.cos_sin = rope_cos_sin(max_seq_len, config.head_dim, config.rotary_base, config.rope_scaling).to(device)
        if torch.device(device).type == "cpu":
            reference.use_cpu_weight_layout(net)
        net.ops = ops or select_ops(device)
        for module in net.modules():
            if hasattr(type(module), "ops"):
                module.ops = net.ops
        return net.eval()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None                      # (T, hidden)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, meta, kv_cache, self.cos_sin)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) → (N, vocab) float32 logits."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()


def fuse_weights(config: PretrainedConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint layout → engine layout: q/k/v and gate/up concatenated along the output dimension."""
    out = {}
    for name, tensor in weights.items():
        if ".attn.k_proj." in name or ".attn.v_proj." in name or ".mlp.up_proj." in name or name.endswith("moe.up_proj"):
            continue
        if ".attn.q_proj." in name:
            kind = name.rsplit(".", 1)[1]
            base = name.split(".attn.")[0]
            out[f"{base}.attn.qkv_proj.{kind}"] = torch.cat(
                [weights[f"{base}.attn.{p}_proj.{kind}"] for p in "qkv"], dim=0)
        elif ".mlp.gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([tensor, weights[name.replace("gate", "up")]], 0)
        elif name.endswith("moe.gate_proj"):
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([tensor, weights[name.replace("gate", "up")]], 1)
        else:
            out[name] = tensor
    return out


class LlamaForCausalLM(PretrainedModel):
    """Llama 2/3/3.1, Mistral, Qwen2 and Mixtral: load from HF/GGUF or a checkpoint, save, build."""

    network_class = DecoderForCausalLM

    def engine_weights(self) -> dict[str, torch.Tensor]:
        return fuse_weights(self.config, self.weights)


# The family shares one definition; the names follow the Hugging Face classes.
MistralForCausalLM = Qwen2ForCausalLM = MixtralForCausalLM = LlamaForCausalLM
