"""ReferenceOps: every operation the model and the runtime call on their kernels (`self.ops.<op>`), in pure torch —
the CPU path and the oracle. CpuOps (cpu.py) and TritonOps (__init__.py) offer the same operations on the same
shapes; kiln.kernels.select_ops picks one."""
from __future__ import annotations

import torch

from . import quant, reference
from .metadata import AttentionMetadata
from .triton.tuning import LONG_CONTEXT


class ReferenceOps:
    name = "reference"
    rms_norm = staticmethod(reference.rms_norm)
    add_rms_norm = staticmethod(reference.add_rms_norm)
    silu_and_mul = staticmethod(reference.silu_and_mul)
    argmax_rows = staticmethod(reference.argmax_rows)
    moe = staticmethod(reference.moe)
    linear = staticmethod(torch.nn.functional.linear)
    quant_linear = staticmethod(quant.quant_linear)
    long_context = LONG_CONTEXT     # decode steps past this many keys may take other partitions (decode_partitions)

    def __init__(self, fp8_context_fmha: bool = False):
        self.fp8_context_fmha = fp8_context_fmha    # PluginConfig.use_fp8_context_fmha: e4m3 queries in prompt steps

    @staticmethod
    def pack_quant(algo: str, params: dict, gated: bool = False):
        """(layout, tensors) of the kernels' own layout for a quantized layer; None: the engine layout. gated: a
        gate/up projection (without bias) read through quant_linear_silu, whose rows the kernels may reorder."""
        return None

    @classmethod
    def quant_linear_silu(cls, x, algo: str, params: dict, bias=None):
        """SiLU(gate)·up of a quantized gate/up projection of x."""
        return cls.silu_and_mul(cls.quant_linear(x, algo, params, bias))

    @staticmethod
    def folds_norm(before: dict, after: dict) -> bool:
        """Whether the residual add and RMSNorm between two quantized layers (their parameters) fold into their
        products (kiln.kernels.fusion); the reference never folds."""
        return False

    @staticmethod
    def lora_begin(x, batch, stack):
        """Start a layer's LoRA products (its LoraStack `stack`, the step's LoraBatch `batch`) from the layer's
        input, before its base product; lora_finish adds them to the output. Here: nothing to start."""
        return x

    @staticmethod
    def lora_finish(out, begun, batch, stack):
        """Add the products lora_begin started (`begun`) to the layer output `out`, in place."""
        return reference.lora(out, begun, batch, stack)

    @staticmethod
    def lora_in_graphs(stack) -> bool:
        """Whether a layer's LoRA products (its LoraStack) can run in a CUDA graph: they read the step's grouping
        of tokens by adapter from device memory only."""
        return False

    @staticmethod
    def decode_partitions(batch: int, max_keys: int, heads: int, kv_cache: torch.Tensor) -> tuple[int, int | None]:
        """Split-K partitions (num_parts, part_tokens) of a decode step's attention; the reference needs none."""
        return 1, None

    # The same ops with per-token e4m3 output (quant.Fp8Rows) for a layer with FP8 activations.
    @staticmethod
    def rms_norm_fp8(x, weight, eps):
        return quant.Fp8Rows.of(reference.rms_norm(x, weight, eps))

    @staticmethod
    def add_rms_norm_fp8(x, residual, weight, eps):
        out, residual = reference.add_rms_norm(x, residual, weight, eps)
        return quant.Fp8Rows.of(out), residual

    @staticmethod
    def silu_and_mul_fp8(x):
        return quant.Fp8Rows.of(reference.silu_and_mul(x))

    @staticmethod
    def rope_and_cache(qkv, meta: AttentionMetadata, positions, cos_sin, kv_cache, heads, kv_heads, head_dim,
                       kv_scale=None):
        """Rotate q, k of the fused projection (T, (H + 2KH) D), write k, v to the cache; return q (T, H, D)."""
        t = qkv.shape[0]
        if "cos_sin" not in meta.scratch:                      # one gather per step, shared by all layers
            meta.scratch["cos_sin"] = cos_sin[positions].unsqueeze(1)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k = reference.rotary(q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim), positions,
                                meta.scratch["cos_sin"])
        reference.write_kv(k, v.view(t, kv_heads, head_dim), kv_cache, meta.slot_mapping, kv_scale)
        return q

    def fp8_queries(self, meta: AttentionMetadata) -> bool:
        """Whether this step's attention rounds its queries to e4m3: steps with prompt tokens, with the option."""
        return self.fp8_context_fmha and meta.max_query_len > 1

    def attention(self, q, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None,
                  kv_scale=None):
        return reference.paged_attention(q, kv_cache, meta, scale, sliding_window, kv_scale,
                                         fp8_queries=self.fp8_queries(meta))

    def rope_cache_attention(self, qkv, meta: AttentionMetadata, positions, cos_sin, kv_cache, heads, kv_heads,
                             head_dim, scale: float, sliding_window: int | None, kv_scale=None):
        """rope_and_cache then attention: the attention output (T, H, D) of the fused projection qkv."""
        q = self.rope_and_cache(qkv, meta, positions, cos_sin, kv_cache, heads, kv_heads, head_dim, kv_scale)
        return self.attention(q, kv_cache, meta, scale, sliding_window, kv_scale)
