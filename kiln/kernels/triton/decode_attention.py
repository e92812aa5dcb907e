"""Decode steps over a 16-bit cache split into partitions, in one kernel: rope, the cache write of the new key and
value, attention over each partition and the split-K merge by the last partition to arrive (TritonOps'
rope_cache_attention; reference: rope_and_cache then paged_attention). On an H200 one kernel beats the three it
replaces: 6.1 -> 5.0 µs a layer at batch 1 over 256 keys, 8.4 -> 6.0 over 1024, 11.9 -> 6.9 at batch 8 over 256;
unsplit batches of 64-256 sequences are faster on the three (the attn_fused phase of gpu_suite: tuning.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch_args, wait_for_inputs
from .paged_attention import attention_config, kv_tile, merge_row, online_softmax, partition_tokens, split_k_partials

UNROLLED_MERGE = tl.constexpr(16)   # up to this many partitions the last program merges them in the layout of the
                                    # accumulators, all loads issued at once; more: row by row (merge_row)


@triton.jit
def _rotated(src, d, cos, sin, mask, HALF: tl.constexpr, DIM: tl.constexpr):
    """Rows at src (columns d) rotated as _rope_and_cache_kernel rotates them (the same float32 operations):
    x·cos - partner·sin in the first half, x·cos + partner·sin in the second."""
    x = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(src + ((d + HALF) % DIM)[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.where((d < HALF)[None, :], x * cos[None, :] - partner * sin[None, :],
                    x * cos[None, :] + partner * sin[None, :])


@triton.jit
def _merge_partials(part_m_ptr, part_l_ptr, part_acc_ptr, first_part, row_ok, d, NUM_PARTS: tl.constexpr,
                    DIM: tl.constexpr):
    """The rows' attention output from the NUM_PARTS partials (m, l, acc) at first_part + p, read past L1 (other
    SMs wrote them)."""
    m = tl.full(first_part.shape, float("-inf"), tl.float32)
    l = tl.zeros(first_part.shape, tl.float32)
    acc = tl.zeros([first_part.shape[0], DIM], tl.float32)
    for p in tl.static_range(NUM_PARTS):
        idx = first_part + p
        m_p = tl.load(part_m_ptr + idx, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        l_p = tl.load(part_l_ptr + idx, mask=row_ok, other=0.0, cache_modifier=".cg")
        acc_p = tl.load(part_acc_ptr + idx[:, None] * DIM + d[None, :], mask=row_ok[:, None], other=0.0,
                        cache_modifier=".cg")
        m_new = tl.maximum(m, m_p)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        beta = tl.exp(m_p - m_safe)
        l = l * alpha + l_p * beta
        acc = acc * alpha[:, None] + acc_p * beta[:, None]
        m = m_new
    return acc / tl.where(l == 0.0, 1.0, l)[:, None]


@triton.jit
def _attend_tile(q, k, v, kv_pos, stop, low, scale, row_ok, m, l, acc, PRECISION: tl.constexpr):
    """The online softmax (m, l, acc) of q's rows advanced over one tile of cached keys k and values v at positions
    kv_pos (those from stop on, or at or below low, masked)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale      # (ROWS, TILE)
    s = tl.where(row_ok[:, None] & ((kv_pos < stop) & (kv_pos > low))[None, :], s, float("-inf"))
    return online_softmax(s, v, m, l, acc, PRECISION)


@triton.jit
def _attend_new_key(q, k_new, v_new, scale, m, l, acc):
    """The online softmax advanced over the one new key and value (rounded to the cache's dtype, as if read back
    from it), with p rounded as the tiles' products round it."""
    s = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
    m_new = tl.maximum(m, s)
    p = tl.exp(s - m_new)
    alpha = tl.exp(m - m_new)
    p = p.to(v_new.dtype).to(tl.float32)
    return m_new, l * alpha + p, acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]


@triton.jit(do_not_specialize=["bt_stride", "window"])
def _decode_attention_kernel(
        qkv_ptr, pos_ptr, cos_sin_ptr, slot_ptr, cache_ptr, cache_half, block_tables_ptr, bt_stride, seq_lens_ptr,
        out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, arrivals_ptr, scale, window,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr, TILE: tl.constexpr, PART_TOKENS: tl.constexpr, NUM_PARTS: tl.constexpr,
        PARTS_PAD: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """A one-token step of sequence `seq`, its KV head `kv_head`, keys of partition `part`: the GROUP query heads
    rotated from the fused projection qkv, attention over the partition's cached keys, and — in the program whose
    partition holds the new position — over the new key and value (rotated, rounded to the cache's dtype) from
    registers, which that program also writes to their cache slot. With NUM_PARTS > 1 each program stores its
    softmax partials and counts itself in at arrivals_ptr; the last to arrive merges them and sets the count back to
    0. The first tile of cached keys is loaded before the PDL wait (no kernel of this step writes them)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    HALF: tl.constexpr = DIM // 2
    heads = KV_HEADS * GROUP
    d = tl.arange(0, DIM)
    t = tl.arange(0, TILE)
    r = tl.arange(0, ROWS)
    row_ok = r < GROUP
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)                # 0 on a CUDA graph's padded rows
    new_pos = seq_len - 1
    part_first = part * PART_TOKENS
    part_end = part_first + PART_TOKENS
    first = part_first
    low = -1                                                          # keys at or below it are outside the window
    if window > 0:
        low = new_pos - window
        first = tl.maximum(first, (tl.maximum(low + 1, 0) // TILE) * TILE)
    owner = (new_pos >= part_first) & (new_pos < part_end)
    stop = tl.minimum(part_end, new_pos)                              # cached keys: those before the new one
    pos = tl.load(pos_ptr + seq).to(tl.int64)                         # step inputs: no kernel of the step writes
    cos = tl.load(cos_sin_ptr + pos * DIM + d % HALF)                 # them, so they are read before the PDL wait
    sin = tl.load(cos_sin_ptr + pos * DIM + HALF + d % HALF)
    k, v = kv_tile(cache_ptr, cache_half, table, first, stop, t, d, kv_head, KV_HEADS, BLOCK_TOKENS, DIM)
    wait_for_inputs(PDL)
    row = qkv_ptr + seq.to(tl.int64) * (heads + 2 * KV_HEADS) * DIM
    q = _rotated(row + (kv_head * GROUP + r)[:, None] * DIM, d, cos, sin, row_ok[:, None], HALF, DIM)
    q = q.to(qkv_ptr.dtype.element_ty)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM], tl.float32)
    if first < stop:
        m, l, acc = _attend_tile(q, k, v, first + t, stop, low, scale, row_ok, m, l, acc, PRECISION)
    for start in range(first + TILE, stop, TILE):
        k, v = kv_tile(cache_ptr, cache_half, table, start, stop, t, d, kv_head, KV_HEADS, BLOCK_TOKENS, DIM)
        m, l, acc = _attend_tile(q, k, v, start + t, stop, low, scale, row_ok, m, l, acc, PRECISION)
    if owner:
        k_src = row + (heads + kv_head) * DIM
        k_new = tl.sum(_rotated(k_src, d, cos, sin, (d < DIM)[None, :], HALF, DIM), axis=0)     # (DIM,)
        k_new = k_new.to(cache_ptr.dtype.element_ty)
        v_new = tl.load(k_src + KV_HEADS * DIM + d).to(cache_ptr.dtype.element_ty)
        m, l, acc = _attend_new_key(q, k_new, v_new, scale, m, l, acc)
        slot = tl.load(slot_ptr + seq)
        if slot >= 0:                                    # padded rows of a CUDA graph carry slot -1
            k_dst = cache_ptr + (slot * KV_HEADS + kv_head) * DIM + d
            tl.store(k_dst, k_new)
            tl.store(k_dst + cache_half, v_new)
    q_rows_first = seq.to(tl.int64) * heads + kv_head * GROUP
    q_rows = q_rows_first + r
    out_at = out_ptr + q_rows[:, None] * DIM + d[None, :]
    if NUM_PARTS == 1:
        tl.store(out_at, (acc / tl.where(l == 0.0, 1.0, l)[:, None]).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        idx = q_rows * NUM_PARTS + part
        tl.store(part_m_ptr + idx, m, mask=row_ok)
        tl.store(part_l_ptr + idx, l, mask=row_ok)
        tl.store(part_acc_ptr + idx[:, None] * DIM + d[None, :], acc, mask=row_ok[:, None])
        tl.debug_barrier()                                   # every thread's partials before the count
        counter = arrivals_ptr + seq * KV_HEADS + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == NUM_PARTS - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            if NUM_PARTS <= UNROLLED_MERGE:
                out = _merge_partials(part_m_ptr, part_l_ptr, part_acc_ptr, q_rows * NUM_PARTS, row_ok, d,
                                      NUM_PARTS, DIM)
                tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
            else:
                for g in tl.static_range(GROUP):
                    merge_row(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, q_rows_first + g, NUM_PARTS, PARTS_PAD,
                               DIM, ".cg")


_ARRIVALS: list[torch.Tensor] = []    # zeroed counters per device; older ones stay alive for graphs captured on them


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """n int32 counters at 0 (the fused decode kernel leaves them at 0). One set per device serves every launch
    because the runtime issues a device's kernels on one stream: two decode kernels never run at once."""
    for counters in reversed(_ARRIVALS):
        if counters.device == device and counters.numel() >= n:
            return counters
    _ARRIVALS.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return _ARRIVALS[-1]


def fused_decode_takes(qkv: torch.Tensor, kv_cache: torch.Tensor, max_query_len: int, num_parts: int, head_dim: int,
                       kv_scale: torch.Tensor | None) -> bool:
    """Whether a step goes to decode_attention: one token per sequence split into partitions (the small batches that
    partitions.decode_partitions splits, where one kernel beats three), a 16-bit cache, a power-of-two head size."""
    return (max_query_len == 1 and num_parts > 1 and kv_scale is None and kv_cache.dtype == qkv.dtype
            and qkv.dtype in (torch.float16, torch.bfloat16) and head_dim == triton.next_power_of_2(head_dim))


def decode_attention(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, heads: int,
                     kv_heads: int, head_dim: int, scale: float, sliding_window: int | None, num_parts: int = 1,
                     part_tokens: int | None = None, tile: int | None = None,
                     launch: dict | None = None) -> torch.Tensor:
    """rope_and_cache then paged_attention of a one-token step (fused_decode_takes) in one kernel: the attention
    output (T, H, D), k and v of the new tokens written to their cache slots. tile: keys per iteration
    (attention_config's by default)."""
    tokens = qkv.shape[0]
    tokens_per_block = kv_cache.shape[2]
    tile = tile or attention_config(1, kv_cache.dtype)[0]
    part_tokens = partition_tokens(num_parts, part_tokens, block_tables, tokens_per_block, tile)
    out = torch.empty((tokens, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    part_m, part_l, part_acc = split_k_partials(out, num_parts)
    group = heads // kv_heads
    _decode_attention_kernel[(tokens, kv_heads, num_parts)](
        qkv, positions, cos_sin, slot_mapping, kv_cache, kv_cache[0].numel(), block_tables, block_tables.stride(0),
        seq_lens, out, part_m, part_l, part_acc, _arrival_counters(qkv.device, tokens * kv_heads), scale,
        sliding_window or 0, KV_HEADS=kv_heads, GROUP=group, ROWS=max(16, triton.next_power_of_2(group)),
        DIM=head_dim, BLOCK_TOKENS=tokens_per_block, TILE=tile, PART_TOKENS=part_tokens, NUM_PARTS=num_parts,
        PARTS_PAD=triton.next_power_of_2(num_parts), PRECISION="tf32", num_warps=4, num_stages=2,
        **launch_args(launch))
    return out
