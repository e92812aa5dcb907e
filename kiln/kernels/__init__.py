"""Kernels, chosen once when a network is loaded: `ReferenceOps` (reference_ops.py, pure torch: the CPU path and
the oracle), `CpuOps` (cpu.py, the CPU's quantized products) or `TritonOps` (NVIDIA GPUs: the kernels of
kiln/kernels/triton/). All offer the same operations on the same shapes; `select_ops` picks one."""
from __future__ import annotations

import functools
import sys

import torch

from . import reference
from .fusion import DeferredNorm, NormSite, ResidualSum, SiluSite, fuse
from .lora import LoraImage, LoraSlab, LoraStack
from .metadata import AttentionMetadata, LoraBatch, sort_by_slot
from .reference_ops import ReferenceOps
from .rotary import rope_cos_sin, rope_inv_freq
from .triton.tuning import TritonOptions

CPU_KERNELS = ("fast", "reference")


class TritonOps(ReferenceOps):
    """The GPU's kernels (kiln/kernels/triton/), with the choices of `options`."""

    name = "triton"

    def __init__(self, options: TritonOptions = TritonOptions()):
        super().__init__(options.fp8_context_fmha)
        from .triton import (argmax, decode_attention, fused_moe, launch, lora, norms, paged_attention, quant_linear,
                             rope_cache)

        self.options = options
        self.launch = launch.launch_options(options.pdl)
        self._decode, self._attention, self._rope, self._moe = decode_attention, paged_attention, rope_cache, fused_moe
        self._lora, self._side_streams = lora, {}
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
        fp8_queries = self.fp8_queries(meta)
        if meta.max_query_len > 1 and not self.options.context_fmha:
            return reference.paged_attention(q, kv_cache, meta, scale, sliding_window, kv_scale, fp8_queries)
        attend = functools.partial(self._attention.paged_attention, kv_cache=kv_cache, scale=scale,
                                   sliding_window=sliding_window, kv_scale=kv_scale, launch=self.launch)
        d = meta.decode_seqs
        if d == 0:
            return attend(q, block_tables=meta.block_tables, seq_lens=meta.seq_lens,
                          query_start_loc=meta.query_start_loc, max_query_len=meta.max_query_len,
                          num_parts=meta.num_parts, part_tokens=meta.part_tokens, fp8_queries=fp8_queries)
        # A step's decode tokens go to the decode kernels, its prompt tokens to the prompt kernel: one prompt-kernel
        # launch would give each decode token a program of query rows it fills one of, over all its keys.
        out = torch.empty_like(q)
        attend(q[:d], block_tables=meta.block_tables[:d], seq_lens=meta.seq_lens[:d],
               query_start_loc=meta.query_start_loc[:d + 1], max_query_len=1, out=out[:d])
        starts = meta.scratch.get("prompt_starts")
        if starts is None:
            starts = meta.scratch["prompt_starts"] = meta.query_start_loc[d:] - d
        attend(q[d:], block_tables=meta.block_tables[d:], seq_lens=meta.seq_lens[d:], query_start_loc=starts,
               max_query_len=meta.max_query_len, fp8_queries=fp8_queries, out=out[d:])
        return out

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

    def lora_in_graphs(self, stack) -> bool:
        return self._lora.takes(stack)

    def lora_begin(self, x, batch: LoraBatch, stack):
        """The shrink, on a side stream that joins in lora_finish: it needs only x, so it runs beside the base
        product (in CUDA graphs too)."""
        if not self._lora.takes(stack):
            return x
        main = torch.cuda.current_stream(x.device)
        side = self._side_streams.get(x.device)
        if side is None:
            side = self._side_streams[x.device] = torch.cuda.Stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            return self._lora.shrink(x, batch, stack, self.launch)

    def lora_finish(self, out, begun, batch: LoraBatch, stack):
        if not isinstance(begun, self._lora.Shrunk):
            return reference.lora(out, begun, batch, stack)
        torch.cuda.current_stream(out.device).wait_stream(self._side_streams[out.device])
        return self._lora.expand(out, begun, batch, stack, self.launch)

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
            return ReferenceOps(options.fp8_context_fmha)
        from .cpu import CpuOps
        return CpuOps(fp8_context_fmha=options.fp8_context_fmha)
    if torch.device(device).type != "cuda":
        return ReferenceOps(options.fp8_context_fmha)
    capability = torch.cuda.get_device_capability(device) if options.fp8_context_fmha else None
    if capability is not None and capability < (8, 9):
        raise ValueError("use_fp8_context_fmha multiplies on FP8 tensor cores (compute capability 8.9+: Ada, "
                         f"Hopper, Blackwell); {torch.cuda.get_device_name(device)} is "
                         f"{'.'.join(map(str, capability))}: build without it")
    try:
        return TritonOps(options)
    except ImportError as err:
        print(f"kiln: Triton is not available ({err}); using the reference kernels on the GPU", file=sys.stderr)
        return ReferenceOps(options.fp8_context_fmha)


__all__ = ["AttentionMetadata", "DeferredNorm", "LoraBatch", "LoraImage", "LoraSlab", "LoraStack",
           "NormSite", "ReferenceOps", "ResidualSum", "SiluSite", "sort_by_slot", "TritonOps",
           "TritonOptions", "fuse", "reference", "rope_cos_sin", "rope_inv_freq", "select_ops"]
