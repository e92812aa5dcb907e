"""Kernels, chosen once when a network is loaded: `ReferenceOps` (pure torch: the CPU path and the oracle)
or `TritonOps` (NVIDIA GPUs). Both offer the same operations on the same shapes."""
from __future__ import annotations

import os
import sys

import torch

from . import quant, reference
from .folded import DeferredNorm, ResidualSum
from .metadata import AttentionMetadata
from .rotary import rope_cos_sin, rope_inv_freq


class ReferenceOps:
    name = "reference"
    rms_norm = staticmethod(reference.rms_norm)
    add_rms_norm = staticmethod(reference.add_rms_norm)
    silu_and_mul = staticmethod(reference.silu_and_mul)
    argmax_rows = staticmethod(reference.argmax_rows)
    moe = staticmethod(reference.moe)
    linear = staticmethod(torch.nn.functional.linear)
    quant_linear = staticmethod(quant.quant_linear)

    @staticmethod
    def pack_quant(algo: str, params: dict, gated: bool = False):
        """(layout, tensors) of the kernels' own layout for a quantized layer; None: the engine layout. gated: a
        gate/up projection (without bias) read through quant_linear_silu, whose rows the kernels may reorder."""
        return None

    @classmethod
    def quant_linear_silu(cls, x, algo: str, params: dict, bias=None):
        """SiLU(gate)·up of a quantized gate/up projection of x."""
        return cls.silu_and_mul(cls.quant_linear(x, algo, params, bias))

    @classmethod
    def quant_linear_before_norm(cls, x, algo: str, params: dict, bias, residual, norm_weight=None):
        """A quantized layer whose output is added to `residual` and RMS-normalized next (with `norm_weight`, where
        that norm is deferred to the layer after): the product, or where a kernel folds the add in, a
        folded.ResidualSum (TritonOps' decode GEMV). The reference returns the product (the RMSNorm adds)."""
        return cls.quant_linear(x, algo, params, bias)

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

    @staticmethod
    def attention(q, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None, kv_scale=None):
        return reference.paged_attention(q, kv_cache, meta, scale, sliding_window, kv_scale)

    @classmethod
    def rope_cache_attention(cls, qkv, meta: AttentionMetadata, positions, cos_sin, kv_cache, heads, kv_heads,
                             head_dim, scale: float, sliding_window: int | None, kv_scale=None):
        """rope_and_cache then attention: the attention output (T, H, D) of the fused projection qkv."""
        q = cls.rope_and_cache(qkv, meta, positions, cos_sin, kv_cache, heads, kv_heads, head_dim, kv_scale)
        return cls.attention(q, kv_cache, meta, scale, sliding_window, kv_scale)


class TritonOps(ReferenceOps):
    name = "triton"

    def __init__(self, context_fmha: bool = True, fp8_fast_accumulation: bool = True):
        from . import fused_moe, triton_kernels

        self._k = triton_kernels
        self._moe = fused_moe
        self.context_fmha = context_fmha
        self.fp8_fast_accumulation = fp8_fast_accumulation
        self.rms_norm = triton_kernels.rms_norm
        self.add_rms_norm = triton_kernels.add_rms_norm
        self.silu_and_mul = triton_kernels.silu_and_mul
        self.rms_norm_fp8 = triton_kernels.rms_norm_fp8
        self.add_rms_norm_fp8 = triton_kernels.add_rms_norm_fp8
        self.silu_and_mul_fp8 = triton_kernels.silu_and_mul_fp8
        self.argmax_rows = triton_kernels.argmax_rows

    def rope_and_cache(self, qkv, meta, positions, cos_sin, kv_cache, heads, kv_heads, head_dim, kv_scale=None):
        return self._k.rope_and_cache(qkv, positions, cos_sin, kv_cache, meta.slot_mapping, heads, kv_heads, head_dim,
                                      kv_scale)

    def attention(self, q, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None, kv_scale=None):
        if meta.max_query_len > 1 and not self.context_fmha:
            return reference.paged_attention(q, kv_cache, meta, scale, sliding_window, kv_scale)
        return self._k.paged_attention(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                       meta.max_query_len, scale, sliding_window, num_parts=meta.num_parts,
                                       part_tokens=meta.part_tokens, kv_scale=kv_scale)

    def rope_cache_attention(self, qkv, meta, positions, cos_sin, kv_cache, heads, kv_heads, head_dim, scale,
                             sliding_window, kv_scale=None):
        if not self._k.fused_decode_takes(qkv, kv_cache, meta.max_query_len, meta.num_parts, head_dim, kv_scale):
            q = self.rope_and_cache(qkv, meta, positions, cos_sin, kv_cache, heads, kv_heads, head_dim, kv_scale)
            return self.attention(q, kv_cache, meta, scale, sliding_window, kv_scale)
        return self._k.decode_attention(qkv, positions, cos_sin, kv_cache, meta.slot_mapping, meta.block_tables,
                                        meta.seq_lens, heads, kv_heads, head_dim, scale, sliding_window,
                                        meta.num_parts, meta.part_tokens)

    def moe(self, x, router, gate_up, down, top_k, renormalize, first_expert=0, algo=None):
        return self._moe.fused_moe(x, router, gate_up, down, top_k, renormalize, first_expert, algo,
                                   self.fp8_fast_accumulation)

    def quant_linear(self, x, algo, params, bias=None):
        return self._k.quant_linear(x, algo, params, bias, self.fp8_fast_accumulation)

    def quant_linear_silu(self, x, algo, params, bias=None):
        return self._k.quant_linear_silu(x, algo, params, bias, self.fp8_fast_accumulation)

    def quant_linear_before_norm(self, x, algo, params, bias, residual, norm_weight=None):
        return self._k.quant_linear_before_norm(x, algo, params, bias, residual, norm_weight,
                                                self.fp8_fast_accumulation)

    def pack_quant(self, algo: str, params: dict, gated: bool = False):
        return self._k.pack_quant(algo, params, gated)


def select_ops(device: torch.device | str, context_fmha: bool = True, fp8_fast_accumulation: bool = True):
    """The fastest kernels available on `device`; a GPU without Triton falls back to the reference, announced.
    KILN_CPU_OPS=reference keeps the CPU on the exact reference products (CpuOps runs int8/int4 layers with bf16
    activations); the variable reaches spawned tensor-parallel workers too."""
    if torch.device(device).type == "cpu":
        choice = os.environ.get("KILN_CPU_OPS", "fast")
        if choice not in ("fast", "reference"):
            raise ValueError(f"KILN_CPU_OPS={choice!r}: expected 'fast' or 'reference'")
        if choice == "reference":
            return ReferenceOps()
        from .cpu import CpuOps
        return CpuOps()
    if torch.device(device).type != "cuda":
        return ReferenceOps()
    try:
        return TritonOps(context_fmha, fp8_fast_accumulation)
    except ImportError as err:
        print(f"kiln: Triton is not available ({err}); using the reference kernels on the GPU", file=sys.stderr)
        return ReferenceOps()


__all__ = ["AttentionMetadata", "DeferredNorm", "ReferenceOps", "ResidualSum", "TritonOps", "reference", "rope_cos_sin",
           "rope_inv_freq", "select_ops"]
