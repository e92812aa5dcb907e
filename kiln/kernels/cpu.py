"""The CPU's kernels for quantized linear layers: weights re-packed once at load into the layouts of PyTorch's own
CPU products (aten._weight_int8pack_mm for int8 per channel, aten._weight_int4pack_mm_for_cpu for int4 per channel
or per group), and for every other layer (FP8, W8A8, shapes those products refuse) the reference product on a float
weight dequantized once at load instead of on every call.

Precision: the int8/int4 products have vectorized code for bfloat16 activations only (float32 and float16 run
15-30x slower, scalar), so they take x and the scales in bfloat16 and return bfloat16, accumulating in float32:
about 3e-3 relative error on top of the weights' own rounding (int8: ~1e-2, int4: several %). The dense fallback
computes exactly as the reference does."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch
import torch.nn.functional as F

from . import quant, reference
from .metadata import AttentionMetadata
from .reference_ops import ReferenceOps

INT8_LAYOUT = "cpu_int8"     # weight int8 (out, in) as stored; weight_scale bfloat16 (out,)
INT4_LAYOUT = "cpu_int4"     # weight: _convert_weight_to_int4pack_for_cpu; weight_scale: scales_and_zeros
DENSE_LAYOUT = "cpu_dense"   # weight float32 (out, in), column-major; scales folded in
KERNEL_DTYPE = torch.bfloat16
INT4_KERNEL_GROUPS = (256, 128, 64, 32)     # group sizes _weight_int4pack_mm_for_cpu accepts, largest first
INT4_KERNEL_ROWS = 16                       # it needs out_features divisible by this


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t contiguous at an aligned address: both kernels crash (SIGSEGV, torch 2.13) on tensors that start off the
    64-byte alignment of torch's own allocations, such as weights memory-mapped from an engine file or a view
    past the start of a larger tensor."""
    if t.is_contiguous() and t.data_ptr() % 64 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def kernel_input(x: torch.Tensor) -> torch.Tensor:
    return aligned(x.to(KERNEL_DTYPE))


# --- the int8 product ----------------------------------------------------------------------------------------
def pack_int8(params: dict) -> dict:
    return {"weight": aligned(params["weight"]), "weight_scale": params["weight_scale"].to(KERNEL_DTYPE)}


def int8_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(kernel_input(x), weight, scale)


# --- the int4 product ----------------------------------------------------------------------------------------
def int4_kernel_group(in_features: int, groups: int) -> int | None:
    """The kernel's group size that spans our groups exactly (ours repeat over several of its groups, a short
    last one included), or None where none does."""
    group = quant.int4_group_size(in_features, groups)
    return next((g for g in INT4_KERNEL_GROUPS if group % g == 0 and in_features % g == 0), None)


def pack_int4(params: dict, kernel_group: int) -> dict:
    """Levels into the kernel's packing; our w = (q - zero)·scale as its w = (q - 8)·scale + offset, i.e.
    offset = (8 - zero)·scale, both (in/kernel_group, out, 2) as the kernel reads them."""
    weight, scale, zero = params["weight"], params["weight_scale"], params.get("weight_zero")
    in_features = weight.shape[1] * 2
    repeats = quant.int4_group_size(in_features, scale.shape[1]) // kernel_group
    scale = scale.repeat_interleave(repeats, dim=1)[:, :in_features // kernel_group]
    offset = torch.zeros_like(scale) if zero is None else \
        (8.0 - zero.repeat_interleave(repeats, dim=1)[:, :in_features // kernel_group]) * scale
    levels = quant.unpack_int4(weight).to(torch.int32)
    return {"weight": torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 2),
            "weight_scale": torch.stack([scale.t(), offset.t()], dim=-1).to(KERNEL_DTYPE).contiguous()}


def int4_product(x: torch.Tensor, weight: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    kernel_group = x.shape[-1] // scales_and_zeros.shape[0]
    return torch.ops.aten._weight_int4pack_mm_for_cpu(kernel_input(x), weight, kernel_group, scales_and_zeros)


# --- the dense fallback ----------------------------------------------------------------------------------------
def pack_dense(algo: str, params: dict) -> dict:
    """The float32 matrix, column-major like the CPU's float weights (kernels.reference.use_cpu_weight_layout)."""
    return {"weight": quant.dequantize_weight(algo, params).t().contiguous().t(), "weight_scale": None,
            "weight_zero": None}


# --- which product a layer gets --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CpuKernels:
    """The products CpuOps runs int8 and int4 layers on, each (x, packed weight, packed scales) → x · wᵀ in
    bfloat16: PyTorch's own unless another is given (a test stands in a torch without them). Each is checked once
    on a small matrix before a layer is packed for it; one that fails leaves those layers on the dequantized
    weight."""

    int8: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = int8_product
    int4: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = int4_product


@functools.cache
def kernel_works(product: Callable, bits: int) -> bool:
    """Whether `product` (the int8 one or the int4 one) exists in this torch and computes what we think, checked
    once on a small matrix (int4: zero points and levels all different)."""
    if bits == 8:
        algo, params = "W8A16", {"weight": torch.arange(-64, 64, dtype=torch.int8).reshape(4, 32),
                                 "weight_scale": torch.tensor([0.5, 1.0, 2.0, 0.25])}
    else:
        levels = (torch.arange(16 * 64) % 15).reshape(16, 64).to(torch.uint8)
        algo, params = "W4A16_AWQ", {"weight": quant.pack_int4(levels),
                                     "weight_scale": torch.linspace(0.25, 2.0, 32).reshape(16, 2),
                                     "weight_zero": torch.linspace(0.0, 15.0, 32).reshape(16, 2)}
    weight = quant.dequantize_weight(algo, params)
    x = torch.linspace(-1.0, 1.0, 2 * weight.shape[1]).reshape(2, -1)
    try:
        packed = CpuOps.pack_kernel(algo, params)[1]
        out = product(x, packed["weight"], packed["weight_scale"]).float()
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    ref = x.double() @ weight.double().t()
    return bool(((out - ref).norm() / ref.norm()) < 2e-2)


# --- decode steps: fewer, larger torch calls (on a CPU each call costs microseconds) ----------------------------
def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                     sliding_window: int | None, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """reference.paged_attention for a step of one query token per sequence: each sequence's cache blocks gathered
    whole (one index_select per cache half instead of one gathered row per key) and its query heads attending as
    they are laid out (no gather of q, no mask-select of the output). One sequence whose blocks lie in order (the
    usual case: the allocator hands out free blocks in order) attends over a view of the cache, its keys cut to
    those it may see: no gather, no mask (230 keys: 121 → 36 µs a layer)."""
    batch, heads, dim = q.shape
    kv_heads = kv_cache.shape[-2]
    if "cpu_decode" not in meta.scratch:                    # once per step, shared by all layers
        meta.scratch["cpu_decode"] = _decode_plan(meta, sliding_window)
    plan = meta.scratch["cpu_decode"]
    if isinstance(plan[0], int):                            # (first block, used blocks, first key, end key)
        first, used, start, end = plan
        k, v = (kv_cache[i, first:first + used].view(1, -1, kv_heads, dim)[:, start:end].transpose(1, 2)
                for i in (0, 1))
        allowed = None
    else:
        blocks, allowed = plan
        k, v = (kv_cache[i].index_select(0, blocks).view(batch, -1, kv_heads, dim).transpose(1, 2) for i in (0, 1))
    k, v = reference.dequantize_kv(k, v, kv_scale, q.dtype)
    out = F.scaled_dot_product_attention(q.view(batch, kv_heads, heads // kv_heads, dim), k, v, attn_mask=allowed,
                                         scale=scale)
    return out.reshape(batch, heads, dim)


def _decode_plan(meta: AttentionMetadata, sliding_window: int | None) -> tuple:
    """How decode_attention reads a step's keys: (first block, used blocks, first key, end key) of a view for one
    sequence with its blocks in order, else (the block tables flattened, the keys each sequence may see)."""
    if meta.num_seqs == 1:
        end = int(meta.seq_lens[0])
        used = -(-end // meta.tokens_per_block)
        ids = meta.block_tables[0, :used].tolist()
        if ids == list(range(ids[0], ids[0] + used)):
            return ids[0], used, 0 if sliding_window is None else max(0, end - sliding_window), end
    keys = torch.arange(meta.block_tables.shape[1] * meta.tokens_per_block)
    allowed = keys < meta.seq_lens[:, None]
    if sliding_window is not None:
        allowed &= keys > meta.seq_lens[:, None] - 1 - sliding_window
    return meta.block_tables.flatten(), allowed[:, None, None, :]


class CpuOps(ReferenceOps):
    """ReferenceOps with quantized layers on PyTorch's CPU kernels (chosen by select_ops for CPU devices; `kernels`:
    which products), and decode steps' attention and rotary embedding in fewer torch calls."""

    name = "cpu"

    def __init__(self, kernels: CpuKernels = CpuKernels(), fp8_context_fmha: bool = False):
        super().__init__(fp8_context_fmha)
        self.kernels = kernels

    @staticmethod
    def rope_and_cache(qkv, meta: AttentionMetadata, positions, cos_sin, kv_cache, heads, kv_heads, head_dim,
                       kv_scale=None):
        """ReferenceOps.rope_and_cache with q and k rotated together (one rotation, the same values)."""
        t = qkv.shape[0]
        if "cos_sin" not in meta.scratch:
            meta.scratch["cos_sin"] = cos_sin[positions].unsqueeze(1)
        rotated = reference.rotate(qkv[:, :(heads + kv_heads) * head_dim].view(t, heads + kv_heads, head_dim),
                                   meta.scratch["cos_sin"])
        v = qkv[:, (heads + kv_heads) * head_dim:].view(t, kv_heads, head_dim)
        reference.write_kv(rotated[:, heads:], v, kv_cache, meta.slot_mapping, kv_scale)
        return rotated[:, :heads]

    def attention(self, q, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None,
                  kv_scale=None):
        if meta.max_query_len == 1 and q.shape[0] == meta.seq_lens.shape[0]:
            return decode_attention(q, kv_cache, meta, scale, sliding_window, kv_scale)
        return super().attention(q, kv_cache, meta, scale, sliding_window, kv_scale)

    def pack_quant(self, algo: str, params: dict, gated: bool = False):
        if algo == "W8A16" and kernel_works(self.kernels.int8, 8) or \
                algo.startswith("W4A16") and kernel_works(self.kernels.int4, 4):
            return CpuOps.pack_kernel(algo, params) or (DENSE_LAYOUT, pack_dense(algo, params))
        return DENSE_LAYOUT, pack_dense(algo, params)

    @staticmethod
    def pack_kernel(algo: str, params: dict):
        """(layout, tensors) for the int8 or int4 kernel, or None where the layer's shape does not suit it."""
        if algo == "W8A16":
            return INT8_LAYOUT, pack_int8(params)
        out_features, in_features = params["weight"].shape[0], params["weight"].shape[1] * 2
        kernel_group = int4_kernel_group(in_features, params["weight_scale"].shape[1])
        if kernel_group is None or out_features % INT4_KERNEL_ROWS:
            return None
        return INT4_LAYOUT, {**pack_int4(params, kernel_group), "weight_zero": None}

    def quant_linear(self, x, algo: str, params: dict, bias: torch.Tensor | None = None) -> torch.Tensor:
        layout = params.get("layout")
        if layout == INT8_LAYOUT:
            out = self.kernels.int8(x, params["weight"], params["weight_scale"]).to(x.dtype)
        elif layout == INT4_LAYOUT:
            out = self.kernels.int4(x, params["weight"], params["weight_scale"]).to(x.dtype)
        elif layout == DENSE_LAYOUT:
            out = quant.dense_product(x, algo, params["weight"], params)
        else:
            return quant.quant_linear(x, algo, params, bias)
        return out if bias is None else out + bias

    def quant_linear_silu(self, x, algo: str, params: dict, bias=None):
        """SiLU(gate)·up through this instance's products."""
        return self.silu_and_mul(self.quant_linear(x, algo, params, bias))
