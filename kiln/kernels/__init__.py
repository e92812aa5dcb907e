"""Kernels, chosen once when a network is loaded: `ReferenceOps` (pure torch: the CPU path and the oracle),
`CpuOps` (the CPU's quantized products) or `TritonOps` (NVIDIA GPUs: the kernels of kiln/kernels/triton/). All offer
the same operations on the same shapes; `select_ops` picks one."""
from __future__ import annotations

import functools
import sys

import torch

from . import quant, reference
from .fusion import DeferredNorm, NormSite, ResidualSum, SiluSite, fuse
from .metadata import AttentionMetadata
from .rotary import rope_cos_sin, rope_inv_freq
from .triton.tuning import LONG_CONTEXT, TritonOptions

CPU_KERNELS = ("fast", "reference")


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
    """The GPU's kernels (kiln/kernels/triton/), with the choices of `options`."""

    name = "triton"

    def __init__(self, options: TritonOptions = TritonOptions()):
        from .triton import (argmax, decode_attention, fused_moe, launch, norms, paged_attention, quant_linear,
                             rope_cache)

        self.options = options
        self.launch = launch.launch_options(options.pdl)
        self._decode, self._attention, self._rope, self._moe = decode_attention, paged_attention, rope_cache, fused_moe
        self.products = quant_linear.QuantProducts(options)
        with_launch = lambda fn: functools.partial(fn, launch=self.launch)  # noqa: E731
        self.rms_norm, self.add_rms_norm = with_launch(norms.rms_norm), with_launch(norms.add_rms_norm)
        self.rms_norm_fp8, self.add_rms_norm_fp8 = with_launch(norms.rms_norm_fp8), with_launch(norms.add_rms_norm_fp8)
        self.silu_and_mul, self.silu_and_mul_fp8 = with_launch(norms.silu_and_mul), with_launch(norms.silu_and_mul_fp8)
        self.argmax_rows = with_launch(argmax.argmax_rows)
        self.pack_quant, self.quant_linear = self.products.pack, self.products.linear
        self.quant_linear_silu = self.products.linear_silu
        self.quant_linear_before_norm, self.folds_norm = self.products.linear_before_norm, self.products.folds_norm

    def rope_and_cache(self, qkv, meta, positions, cos_sin, kv_cache, heads, kv_heads, head_dim, kv_scale=None):
        return self._rope.rope_and_cache(qkv, positions, cos_sin, kv_cache, meta.slot_mapping, heads, kv_heads,
                                         head_dim, kv_scale, self.launch)

    def attention(self, q, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None, kv_scale=None):
        if meta.max_query_len > 1 and not self.options.context_fmha:
            return reference.paged_attention(q, kv_cache, meta, scale, sliding_window, kv_scale)
        return self._attention.paged_attention(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                               meta.max_query_len, scale, sliding_window, num_parts=meta.num_parts,
                                               part_tokens=meta.part_tokens, kv_scale=kv_scale, launch=self.launch)

    def rope_cache_attention(self, qkv, meta, positions, cos_sin, kv_cache, heads, kv_heads, head_dim, scale,
                             sliding_window, kv_scale=None):
        if not self._decode.fused_decode_takes(qkv, kv_cache, meta.max_query_len, meta.num_parts, head_dim, kv_scale):
            q = self.rope_and_cache(qkv, meta, positions, cos_sin, kv_cache, heads, kv_heads, head_dim, kv_scale)
            return self.attention(q, kv_cache, meta, scale, sliding_window, kv_scale)
        return self._decode.decode_attention(qkv, positions, cos_sin, kv_cache, meta.slot_mapping, meta.block_tables,
                                             meta.seq_lens, heads, kv_heads, head_dim, scale, sliding_window,
                                             meta.num_parts, meta.part_tokens, launch=self.launch)

    def decode_partitions(self, batch: int, max_keys: int, heads: int, kv_cache: torch.Tensor):
        """Split-K partitions (num_parts, part_tokens) of a decode step of `batch` sequences over up to max_keys keys
        of kv_cache (one layer's: (2, blocks, tokens_per_block, KH, D)), for the kernel that will run it."""
        from .triton.partitions import decode_partitions

        kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
        one_warp = self._attention.decode_mma(kv_cache.dtype, head_dim, heads // kv_heads, kv_cache.shape[2],
                                              kv_cache.device)
        return decode_partitions(batch * kv_heads, max_keys, one_warp)

    def moe(self, x, router, gate_up, down, top_k, renormalize, first_expert=0, algo=None):
        return self._moe.fused_moe(x, router, gate_up, down, top_k, renormalize, first_expert, algo,
                                   self.options.fp8_fast_accumulation, launch=self.launch)


def select_ops(device: torch.device | str, options: TritonOptions = TritonOptions(), cpu_kernels: str = "fast"):
    """The fastest kernels available on `device`, with `options` on a GPU; a GPU without Triton falls back to the
    reference, announced. cpu_kernels (PluginConfig.cpu_kernels): "fast" runs int8/int4 layers on PyTorch's packed
    CPU kernels with bf16 activations (CpuOps), "reference" keeps the CPU on the exact reference products."""
    if cpu_kernels not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels={cpu_kernels!r}: expected one of {CPU_KERNELS}")
    if torch.device(device).type == "cpu":
        if cpu_kernels == "reference":
            return ReferenceOps()
        from .cpu import CpuOps
        return CpuOps()
    if torch.device(device).type != "cuda":
        return ReferenceOps()
    try:
        return TritonOps(options)
    except ImportError as err:
        print(f"kiln: Triton is not available ({err}); using the reference kernels on the GPU", file=sys.stderr)
        return ReferenceOps()


__all__ = ["AttentionMetadata", "DeferredNorm", "NormSite", "ReferenceOps", "ResidualSum", "SiluSite", "TritonOps",
           "TritonOptions", "fuse", "reference", "rope_cos_sin", "rope_inv_freq", "select_ops"]
