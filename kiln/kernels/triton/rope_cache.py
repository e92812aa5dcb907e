"""Rotary embedding and the KV-cache write of a fused q/k/v projection, one program per token (reference:
reference.rotary and reference.write_kv). The cache per layer is (2, num_blocks, tokens_per_block, KH, D), in the
model's dtype or quantized (int8, e4m3) with one scale for keys and one for values."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch_args, wait_for_inputs


@triton.jit
def _to_cache(x, scale, cache_ptr, KV_QUANT: tl.constexpr):
    """A float32 k or v block in the cache's dtype (KV_QUANT 1: int8, 2: fp8, both divided by scale)."""
    if KV_QUANT == 1:
        y = x / scale
        return tl.clamp(tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5)), -127.0, 127.0).to(tl.int8)
    elif KV_QUANT == 2:
        return tl.clamp(x / scale, -448.0, 448.0).to(cache_ptr.dtype.element_ty)
    else:
        return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _rope_and_cache_kernel(qkv_ptr, pos_ptr, cos_sin_ptr, slot_ptr, cache_ptr, q_out_ptr, cache_half, kv_scale_ptr,
                           HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                           HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr, KV_QUANT: tl.constexpr, PDL: tl.constexpr):
    """One program per token: rotate its q heads into q_out, its k heads into the cache, copy its v heads."""
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    dim = 2 * HALF
    row = qkv_ptr + token * (HEADS + 2 * KV_HEADS) * dim
    d = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * dim + d)[None, :]
    sin = tl.load(cos_sin_ptr + pos * dim + HALF + d)[None, :]
    h = tl.arange(0, HEADS_PAD)
    qm = (h < HEADS)[:, None]
    src = row + h[:, None] * dim + d[None, :]
    x1 = tl.load(src, mask=qm, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=qm, other=0.0).to(tl.float32)
    dst = q_out_ptr + (token * HEADS + h[:, None]) * dim + d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=qm)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=qm)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:                                        # padded rows of a CUDA graph carry slot -1
        kh = tl.arange(0, KV_PAD)
        km = (kh < KV_HEADS)[:, None]
        k_src = row + (HEADS + kh[:, None]) * dim + d[None, :]
        k1 = tl.load(k_src, mask=km, other=0.0).to(tl.float32)
        k2 = tl.load(k_src + HALF, mask=km, other=0.0).to(tl.float32)
        k_scale = 1.0
        v_scale = 1.0
        if KV_QUANT > 0:
            k_scale = tl.load(kv_scale_ptr)
            v_scale = tl.load(kv_scale_ptr + 1)
        k_dst = cache_ptr + (slot * KV_HEADS + kh[:, None]) * dim + d[None, :]
        tl.store(k_dst, _to_cache(k1 * cos - k2 * sin, k_scale, cache_ptr, KV_QUANT), mask=km)
        tl.store(k_dst + HALF, _to_cache(k2 * cos + k1 * sin, k_scale, cache_ptr, KV_QUANT), mask=km)
        v_src = k_src + KV_HEADS * dim
        v1 = tl.load(v_src, mask=km, other=0.0).to(tl.float32)
        v2 = tl.load(v_src + HALF, mask=km, other=0.0).to(tl.float32)
        tl.store(k_dst + cache_half, _to_cache(v1, v_scale, cache_ptr, KV_QUANT), mask=km)
        tl.store(k_dst + cache_half + HALF, _to_cache(v2, v_scale, cache_ptr, KV_QUANT), mask=km)


def kv_quant(kv_cache: torch.Tensor) -> int:
    """The KV_QUANT constexpr of a cache: 0 in the model's dtype, 1 int8, 2 e4m3."""
    return {torch.int8: 1, torch.float8_e4m3fn: 2}.get(kv_cache.dtype, 0)


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                   kv_scale: torch.Tensor | None = None, launch: dict | None = None) -> torch.Tensor:
    """Rotate q and k of the fused projection qkv (T, (H + 2KH) D); k, v go to their cache slots.
    Returns the rotated q (T, H, D)."""
    tokens = qkv.shape[0]
    q = torch.empty((tokens, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    _rope_and_cache_kernel[(tokens,)](qkv, positions, cos_sin, slot_mapping, kv_cache, q, kv_cache[0].numel(),
                                      cos_sin if kv_scale is None else kv_scale,
                                      HEADS=heads, KV_HEADS=kv_heads, HALF=head_dim // 2,
                                      HEADS_PAD=triton.next_power_of_2(heads),
                                      KV_PAD=triton.next_power_of_2(kv_heads), KV_QUANT=kv_quant(kv_cache), num_warps=4,
                                      **launch_args(launch))
    return q
