"""Triton kernels for NVIDIA GPUs. Each has its pure-torch twin in reference.py (the oracle in tests).

Shapes follow the reference: packed tokens (T, ·), KV cache per layer (2, num_blocks, tokens_per_block, KH, D).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# --- RMSNorm (+ residual add) --------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        tl.store(res_ptr + row * n_cols + cols, x, mask=mask)          # the new residual, in place
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, w * (xf * inv).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    _rms_norm_kernel[(x.shape[0],)](x, x, weight, out, x.shape[-1], eps, HAS_RES=False,
                                    BLOCK=triton.next_power_of_2(x.shape[-1]), num_warps=8)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual); the sum is written into `residual`."""
    out = torch.empty_like(x)
    _rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, x.shape[-1], eps, HAS_RES=True,
                                    BLOCK=triton.next_power_of_2(x.shape[-1]), num_warps=8)
    return out, residual


# --- SiLU(gate) * up -----------------------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + row * n_cols + cols, act * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
    block = 1024
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, n, BLOCK=block, num_warps=4)
    return out


# --- rotary embedding + KV-cache write -----------------------------------------------------------------------
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
                           HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr, KV_QUANT: tl.constexpr):
    """One program per token: rotate its q heads into q_out, its k heads into the cache, copy its v heads."""
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


def _kv_quant(kv_cache: torch.Tensor) -> int:
    return {torch.int8: 1, torch.float8_e4m3fn: 2}.get(kv_cache.dtype, 0)


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                   kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate q and k of the fused projection qkv (T, (H + 2KH) D); k, v go to their cache slots.
    Returns the rotated q (T, H, D)."""
    tokens = qkv.shape[0]
    q = torch.empty((tokens, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    _rope_and_cache_kernel[(tokens,)](qkv, positions, cos_sin, slot_mapping, kv_cache, q, kv_cache[0].numel(),
                                      cos_sin if kv_scale is None else kv_scale,
                                      HEADS=heads, KV_HEADS=kv_heads, HALF=head_dim // 2,
                                      HEADS_PAD=triton.next_power_of_2(heads),
                                      KV_PAD=triton.next_power_of_2(kv_heads), KV_QUANT=_kv_quant(kv_cache), num_warps=4)
    return q


# --- attention over the paged cache --------------------------------------------------------------------------
@triton.jit
def _paged_attention_kernel(
        q_ptr, cache_ptr, cache_half, block_tables_ptr, bt_stride, seq_lens_ptr, q_start_ptr, out_ptr,
        part_m_ptr, part_l_ptr, part_acc_ptr, scale, window, kv_scale_ptr,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr, TILE: tl.constexpr, BLOCK_Q: tl.constexpr, PART_TOKENS: tl.constexpr,
        NUM_PARTS: tl.constexpr, PRECISION: tl.constexpr, KV_QUANT: tl.constexpr):
    """One program: BLOCK_Q query tokens of one sequence × the GROUP query heads of one KV head, over the keys of
    one partition of the sequence, TILE tokens at a time (each token's cache block looked up in the block
    table). With NUM_PARTS > 1 the partitions' softmax statistics are merged by _merge_kernel (split-K)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    qblock_part = tl.program_id(2)
    qblock = qblock_part // NUM_PARTS
    part = qblock_part % NUM_PARTS
    heads = KV_HEADS * GROUP
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    q_start = tl.load(q_start_ptr + seq).to(tl.int32)
    q_len = tl.load(q_start_ptr + seq + 1).to(tl.int32) - q_start
    if qblock * BLOCK_Q >= q_len:
        return
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = qblock * BLOCK_Q + rows // GROUP_PAD                      # query token within the sequence
    g = rows % GROUP_PAD
    row_ok = (token < q_len) & (g < GROUP)
    q_pos = seq_len - q_len + token                                   # its position in the sequence
    d = tl.arange(0, DIM)
    q_rows = (q_start + token).to(tl.int64) * heads + kv_head * GROUP + g
    q = tl.load(q_ptr + q_rows[:, None] * DIM + d[None, :], mask=row_ok[:, None], other=0.0)
    end = seq_len - q_len + tl.minimum(q_len, (qblock + 1) * BLOCK_Q)  # keys [0, end) can be attended to
    first = part * PART_TOKENS
    stop = tl.minimum(first + PART_TOKENS, end)
    if window > 0:
        lowest = tl.maximum(seq_len - q_len + qblock * BLOCK_Q - window + 1, 0)
        first = tl.maximum(first, (lowest // TILE) * TILE)
    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM], tl.float32)
    t = tl.arange(0, TILE)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    for start in range(first, stop, TILE):
        kv_pos = start + t
        in_range = kv_pos < stop
        block = tl.load(table + kv_pos // BLOCK_TOKENS, mask=in_range, other=0).to(tl.int64)
        kv_offsets = ((block * BLOCK_TOKENS + kv_pos % BLOCK_TOKENS) * KV_HEADS + kv_head)[:, None] * DIM + d[None, :]
        k = tl.load(cache_ptr + kv_offsets, mask=in_range[:, None], other=0.0)
        v = tl.load(cache_ptr + cache_half + kv_offsets, mask=in_range[:, None], other=0.0)
        if KV_QUANT > 0:                                              # dequantize the cached keys and values
            k = (k.to(tl.float32) * tl.load(kv_scale_ptr)).to(q.dtype)
            v = (v.to(tl.float32) * tl.load(kv_scale_ptr + 1)).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (rows, TILE)
        ok = (kv_pos[None, :] <= q_pos[:, None]) & row_ok[:, None] & in_range[None, :]
        if window > 0:
            ok = ok & (kv_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if NUM_PARTS == 1:
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + q_rows[:, None] * DIM + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        idx = q_rows * NUM_PARTS + part
        tl.store(part_m_ptr + idx, m, mask=row_ok)
        tl.store(part_l_ptr + idx, l, mask=row_ok)
        tl.store(part_acc_ptr + idx[:, None] * DIM + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, NUM_PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
                  DIM: tl.constexpr):
    """Combine the per-partition softmax statistics of one (token, head) row."""
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, PARTS_PAD)
    real = parts < NUM_PARTS
    m = tl.load(part_m_ptr + row * NUM_PARTS + parts, mask=real, other=float("-inf"))
    l = tl.load(part_l_ptr + row * NUM_PARTS + parts, mask=real, other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
    d = tl.arange(0, DIM)
    acc = tl.load(part_acc_ptr + (row * NUM_PARTS + parts)[:, None] * DIM + d[None, :], mask=real[:, None], other=0.0)
    total = tl.sum(acc * w[:, None], axis=0)
    norm = tl.sum(l * w, axis=0)
    tl.store(out_ptr + row * DIM + d, (total / tl.where(norm == 0.0, 1.0, norm)).to(out_ptr.dtype.element_ty))


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, max_query_len: int, scale: float, sliding_window: int | None,
                    num_parts: int = 1, part_tokens: int | None = None, tile: int = 64,
                    kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed queries q (T, H, D) over each sequence's paged keys/values → (T, H, D).

    num_parts > 1 splits each sequence's keys into partitions of part_tokens (multi_block_mode) and merges them."""
    tokens, heads, dim = q.shape
    kv_heads, tokens_per_block = kv_cache.shape[-2], kv_cache.shape[2]
    group = heads // kv_heads
    group_pad = max(1, triton.next_power_of_2(group))
    block_q = 1 if max_query_len == 1 else max(1, 64 // group_pad)
    block_q = max(block_q, triton.cdiv(16, group_pad))                  # tl.dot needs at least 16 rows
    if part_tokens is None:
        part_tokens = block_tables.shape[1] * tokens_per_block
    part_tokens = triton.cdiv(part_tokens, tile) * tile
    out = torch.empty_like(q)
    if num_parts > 1:
        part_m = torch.empty((tokens * heads * num_parts,), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((tokens * heads * num_parts, dim), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out
    grid = (seq_lens.shape[0], kv_heads, triton.cdiv(max_query_len, block_q) * num_parts)
    _paged_attention_kernel[grid](
        q, kv_cache, kv_cache[0].numel(), block_tables, block_tables.stride(0), seq_lens, query_start_loc, out,
        part_m, part_l, part_acc, scale, sliding_window or 0, q if kv_scale is None else kv_scale, KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad,
        DIM=dim, BLOCK_TOKENS=tokens_per_block, TILE=tile, BLOCK_Q=block_q, PART_TOKENS=part_tokens,
        NUM_PARTS=num_parts, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_QUANT=_kv_quant(kv_cache),
        num_warps=4, num_stages=2)
    if num_parts > 1:
        _merge_kernel[(tokens * heads,)](part_m, part_l, part_acc, out, NUM_PARTS=num_parts,
                                         PARTS_PAD=triton.next_power_of_2(num_parts), DIM=dim, num_warps=4)
    return out



# --- matrix products on quantized weights ----------------------------------------------------------------------
@triton.jit
def _weight_only_matmul_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, GROUPS,
                               BITS: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out (M, N) = x (M, K) @ dequant(w)^T, dequantizing int8 or packed int4 weights tile by tile."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
        if BITS == 8:
            q = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=n_ok[:, None], other=0).to(tl.float32)
        else:
            packed = tl.load(w_ptr + rn[:, None].to(tl.int64) * (K // 2) + rk[None, :] // 2, mask=n_ok[:, None], other=0)
            q = ((packed >> ((rk[None, :] % 2) * 4).to(tl.uint8)) & 0xF).to(tl.float32)
        group = k0 // GROUP
        s = tl.load(scale_ptr + rn * GROUPS + group, mask=n_ok, other=0.0)[:, None]
        if HAS_ZERO:
            q = q - tl.load(zero_ptr + rn * GROUPS + group, mask=n_ok, other=0.0)[:, None]
        elif BITS == 4:
            q = q - 8.0
        acc += tl.dot(x, tl.trans((q * s).to(x.dtype)))
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & n_ok[None, :])


def weight_only_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                       bits: int) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    from .quant import int4_group_size

    scale2d = scale.reshape(n, -1)
    groups = scale2d.shape[1]
    group = int4_group_size(k, groups)
    block_k = min(64, group)
    block_m = 16 if m <= 16 else 64
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _weight_only_matmul_kernel[grid](x.contiguous(), weight, scale2d, scale2d if zero is None else zero, out, m, n, k,
                                     groups, BITS=bits, HAS_ZERO=zero is not None, GROUP=group, BLOCK_M=block_m,
                                     BLOCK_N=64, BLOCK_K=block_k, num_warps=4, num_stages=3)
    return out


def quant_linear(x: torch.Tensor, algo: str, params: dict, bias: torch.Tensor | None) -> torch.Tensor:
    """Quantized linear layers on the GPU: Triton for weight-only int8/int4, torch._scaled_mm for FP8,
    torch._int_mm for W8A8 (the reference where a product's shape is below those kernels' minimums)."""
    from . import quant

    if algo == "W8A16" or algo.startswith("W4A16"):
        product = weight_only_gemv if x.shape[0] <= GEMV_MAX_ROWS else weight_only_matmul
        out = product(x, params["weight"], params["weight_scale"], params.get("weight_zero"), 8 if algo == "W8A16" else 4)
    elif algo.startswith("FP8"):
        xs = x.float() / params["smoother"] if "smoother" in params else x
        qx, sx = quant.quantize_activations_fp8(xs, params.get("input_scale"))
        sx = sx.expand(x.shape[0], 1).contiguous() if sx.dim() < 2 or sx.shape[0] != x.shape[0] else sx
        out = torch._scaled_mm(qx, params["weight"].t(), scale_a=sx.float(),
                               scale_b=params["weight_scale"].float()[None, :], out_dtype=x.dtype)
    elif x.shape[0] > 16 and x.shape[1] % 8 == 0 and params["weight"].shape[0] % 8 == 0:
        xs = x.float() / params["smoother"] if "smoother" in params else x.float()
        static = params.get("input_scale")
        if static is None:
            qx, sx = quant.quantize_activations_int8(xs)
        else:
            qx, sx = torch.round(xs / static).clamp(-127, 127).to(torch.int8), static
        acc = torch._int_mm(qx, params["weight"].t())
        out = (acc.float() * sx * params["weight_scale"][None, :]).to(x.dtype)
    else:
        return quant.quant_linear(x, algo, params, bias)
    return out if bias is None else out + bias


def _tiles_within_a_group(configs, named_args, **kwargs):
    """A tile of K may not straddle two quantization groups."""
    group = kwargs.get("GROUP", named_args.get("GROUP"))
    return [c for c in configs if c.kwargs["BLOCK_K"] <= group] or [min(configs, key=lambda c: c.kwargs["BLOCK_K"])]


@triton.autotune(configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=3)
                          for bn, bk, w in ((16, 256, 4), (32, 128, 4), (64, 128, 8), (16, 128, 2), (8, 256, 2),
                                            (16, 64, 2), (32, 32, 2))],
                 key=["N", "K", "M_PAD", "BITS", "GROUP"], prune_configs_by={"early_config_prune": _tiles_within_a_group})
@triton.jit
def _weight_only_gemv_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, N, K, GROUPS,
                             BITS: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr, M_PAD: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A few rows of x against int8 or packed int4 weights: each program streams BLOCK_N weight rows once,
    summing per group and scaling once per group (int4 takes even and odd columns from the two nibbles)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = tl.arange(0, M_PAD)
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // GROUP
        s = tl.load(scale_ptr + n * GROUPS + g, mask=n_ok, other=0.0)
        if BITS == 8:
            rk = k0 + tl.arange(0, BLOCK_K)
            q = tl.load(w_ptr + n[:, None].to(tl.int64) * K + rk[None, :], mask=n_ok[:, None] & (rk[None, :] < K),
                        other=0).to(tl.float32)
            for m in tl.static_range(M_PAD):
                x = tl.load(x_ptr + m * K + rk, mask=rk < K, other=0.0).to(tl.float32)
                part = tl.sum(q * x[None, :], axis=1) * s
                acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
        else:
            half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_ptr + n[:, None].to(tl.int64) * (K // 2) + half[None, :],
                             mask=n_ok[:, None] & (half[None, :] < K // 2), other=0)
            low = (packed & 0xF).to(tl.float32)
            high = (packed >> 4).to(tl.float32)
            if HAS_ZERO:
                z = tl.load(zero_ptr + n * GROUPS + g, mask=n_ok, other=0.0)
            else:
                z = tl.full([BLOCK_N], 8.0, tl.float32)
            for m in tl.static_range(M_PAD):
                xe = tl.load(x_ptr + m * K + 2 * half, mask=2 * half < K, other=0.0).to(tl.float32)
                xo = tl.load(x_ptr + m * K + 2 * half + 1, mask=2 * half + 1 < K, other=0.0).to(tl.float32)
                dot = tl.sum(low * xe[None, :] + high * xo[None, :], axis=1)
                part = s * (dot - z * (tl.sum(xe, axis=0) + tl.sum(xo, axis=0)))
                acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
    tl.store(out_ptr + rows[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])


GEMV_MAX_ROWS = 4


def weight_only_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                     bits: int) -> torch.Tensor:
    """The weight-only product for at most GEMV_MAX_ROWS rows (decoding), reading each weight byte once."""
    from .quant import int4_group_size

    m, k = x.shape
    n = weight.shape[0]
    scale2d = scale.reshape(n, -1)
    groups = scale2d.shape[1]
    group = int4_group_size(k, groups)
    m_pad = triton.next_power_of_2(m)
    if m_pad != m:
        x = torch.cat([x, x.new_zeros(m_pad - m, k)])
    out = torch.empty((m_pad, n), dtype=x.dtype, device=x.device)
    _weight_only_gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
        x.contiguous(), weight, scale2d, scale2d if zero is None else zero, out, n, k, groups, BITS=bits,
        HAS_ZERO=zero is not None, GROUP=group, M_PAD=m_pad)
    return out[:m]
