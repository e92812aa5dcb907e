"""Causal attention of packed queries over the paged KV cache (reference: reference.paged_attention): prompts,
chunked context and the decode steps that decode_attention.py does not fuse; split-K partitions of long sequences
merged by _merge_kernel; decode steps over an 8-bit cache handed to mma_decode_attention where it takes them."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import mma_decode_attention, tuning
from .launch import launch_args, shared_memory, wait_for_inputs
from .rope_cache import kv_quant

ONE_PARTITION = 1 << 30     # PART_TOKENS of an unsplit sequence: more keys than any sequence has
LOG2E = tl.constexpr(1.4426950408889634)     # prompt scores are kept in base-2 units: exp2 is the hardware's exp


# Four cached int8 or e4m3 values of one int32 word → four fp16 values ($0..$3, in column order). int8: each byte,
# sign flipped, becomes the low byte of the fp16 1024 + (q + 128), then 1152 is subtracted; e4m3: two
# cvt.rn.f16x2.e4m3x2. Both are exact.
_INT8_WORD_TO_FP16 = tl.constexpr(
    "{ .reg .b32 u, a, b, c; xor.b32 u, $4, 0x80808080; prmt.b32 a, u, 0x64646464, 0x4140; "
    "prmt.b32 b, u, 0x64646464, 0x4342; mov.b32 c, 0x64806480; sub.f16x2 a, a, c; sub.f16x2 b, b, c; "
    "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }")
_FP8_WORD_TO_FP16 = tl.constexpr(
    "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
    "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }")


@triton.jit
def _cache_words_to_fp16(words, KV_QUANT: tl.constexpr, TILE: tl.constexpr, DIM: tl.constexpr):
    """(TILE, DIM/4) int32 words of a quantized cache → (TILE, DIM) fp16, converted in registers in the layout the
    words were loaded in, so that the tile reaches the tensor cores through shared memory as 16-bit values (an
    8-bit tile read transposed from shared memory goes a byte at a time)."""
    if KV_QUANT == 1:
        asm: tl.constexpr = _INT8_WORD_TO_FP16
    else:
        asm: tl.constexpr = _FP8_WORD_TO_FP16
    p0, p1, p2, p3 = tl.inline_asm_elementwise(asm, "=h,=h,=h,=h,r", [words],
                                               dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                               is_pure=True, pack=1)
    return tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), [TILE, DIM])


@triton.jit
def _cache_rows(table, start, stop, t, kv_head, KV_HEADS: tl.constexpr, BLOCK_TOKENS: tl.constexpr):
    """The (TILE,) cache rows of positions start + t of a sequence (its block table at `table`) and which of them
    are before stop."""
    kv_pos = start + t
    in_range = kv_pos < stop
    block = tl.load(table + kv_pos // BLOCK_TOKENS, mask=in_range, other=0).to(tl.int64)
    return (block * BLOCK_TOKENS + kv_pos % BLOCK_TOKENS) * KV_HEADS + kv_head, in_range


@triton.jit
def kv_tile(cache_ptr, cache_half, table, start, stop, t, d, kv_head, KV_HEADS: tl.constexpr,
             BLOCK_TOKENS: tl.constexpr, DIM: tl.constexpr):
    """Keys and values (TILE, DIM) of cache positions start + t (zeros from stop on)."""
    cached, in_range = _cache_rows(table, start, stop, t, kv_head, KV_HEADS, BLOCK_TOKENS)
    offsets = cached[:, None] * DIM + d[None, :]
    return (tl.load(cache_ptr + offsets, mask=in_range[:, None], other=0.0),
            tl.load(cache_ptr + cache_half + offsets, mask=in_range[:, None], other=0.0))


@triton.jit
def _load_cache_words(cache_ptr, cache_half, table, start, stop, t, w, kv_head, KV_HEADS: tl.constexpr,
                      BLOCK_TOKENS: tl.constexpr, DIM: tl.constexpr):
    """The (TILE, DIM/4) int32 words of keys and of values of cache positions start + t (zeros from stop on)."""
    cached, in_range = _cache_rows(table, start, stop, t, kv_head, KV_HEADS, BLOCK_TOKENS)
    words = cache_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + cached[:, None] * (DIM // 4) + w[None, :]
    return (tl.load(words, mask=in_range[:, None], other=0),
            tl.load(words + cache_half // 4, mask=in_range[:, None], other=0))


@triton.jit
def online_softmax(s, v, m, l, acc, PRECISION: tl.constexpr, BASE2: tl.constexpr = False):
    """The running max m, sum l and output acc of each row advanced over one tile's masked scores s (-inf where
    masked; natural units, or base-2 exponent units with BASE2) and values v."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if BASE2:
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
    else:
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
    l = l * alpha + tl.sum(p, axis=1)
    return m_new, l, tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)


@triton.jit
def online_softmax_whole(s, v, m, l, acc, qk_scale, PRECISION: tl.constexpr):
    """online_softmax in base-2 units over a tile no row masks, its scores s not yet scaled (by qk_scale, one
    positive factor a row): the running max stays finite, so no -inf guard, and scaling and shifting are one
    multiply-add an element."""
    m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)
    p = tl.exp2(s * qk_scale[:, None] - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, axis=1)
    return m_new, l, tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)


@triton.jit
def _kv_tile_as(q, cache_ptr, cache_half, table, start, stop, t, d, w, kv_head, KV_HEADS: tl.constexpr,
                BLOCK_TOKENS: tl.constexpr, DIM: tl.constexpr, TILE: tl.constexpr, KV_QUANT: tl.constexpr,
                WORDS: tl.constexpr):
    """Keys and values (TILE, DIM) of cache positions start + t in q's dtype (zeros from stop on); e4m3 queries
    (FP8 context attention) get the keys as the e4m3 cache holds them and the values in fp16."""
    # one return per static branch: Triton unifies the types of every return it generates
    if q.dtype == tl.float8e4nv and WORDS:
        cached, in_range = _cache_rows(table, start, stop, t, kv_head, KV_HEADS, BLOCK_TOKENS)
        k = tl.load(cache_ptr + cached[:, None] * DIM + d[None, :], mask=in_range[:, None], other=0.0)
        v_words = tl.load(cache_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + cache_half // 4
                          + cached[:, None] * (DIM // 4) + w[None, :], mask=in_range[:, None], other=0)
        return k, _cache_words_to_fp16(v_words, KV_QUANT, TILE, DIM)
    elif WORDS:
        k_words, v_words = _load_cache_words(cache_ptr, cache_half, table, start, stop, t, w, kv_head, KV_HEADS,
                                             BLOCK_TOKENS, DIM)
        return _cache_words_to_fp16(k_words, KV_QUANT, TILE, DIM), _cache_words_to_fp16(v_words, KV_QUANT, TILE, DIM)
    else:
        k, v = kv_tile(cache_ptr, cache_half, table, start, stop, t, d, kv_head, KV_HEADS, BLOCK_TOKENS, DIM)
        v_dtype: tl.constexpr = tl.float16 if q.dtype == tl.float8e4nv else q.dtype
        return k.to(q.dtype), v.to(v_dtype)


@triton.jit(do_not_specialize=["bt_stride", "window"])     # both vary between steps: no recompiles for them
def _paged_attention_kernel(
        q_ptr, cache_ptr, cache_half, block_tables_ptr, bt_stride, seq_lens_ptr, q_start_ptr, out_ptr,
        part_m_ptr, part_l_ptr, part_acc_ptr, scale, window, kv_scale_ptr,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr, TILE: tl.constexpr, BLOCK_Q: tl.constexpr, PART_TOKENS: tl.constexpr,
        NUM_PARTS: tl.constexpr, PRECISION: tl.constexpr, KV_QUANT: tl.constexpr, WORD_LOADS: tl.constexpr,
        CAUSAL_SPLIT: tl.constexpr, FP8_QUERIES: tl.constexpr, PDL: tl.constexpr):
    """One program: BLOCK_Q query tokens of one sequence × the GROUP query heads of one KV head, over the keys of
    one partition of the sequence, TILE tokens at a time (each token's cache block looked up in the block
    table). With NUM_PARTS > 1 the partitions' softmax statistics are merged by _merge_kernel (split-K).
    WORD_LOADS (quantized caches): read the cache as int32 words converted by _cache_words_to_fp16; otherwise as
    8-bit values converted by Triton. CAUSAL_SPLIT (no sliding window): the tiles every query row of the block sees
    whole run without the causal mask, only the tiles on the diagonal with it. FP8_QUERIES (an e4m3 cache): each
    query row is quantized to e4m3 with its own scale and multiplied by the cached keys on the FP8 tensor cores."""
    wait_for_inputs(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Causal rows: later query blocks see more keys. The GPU starts programs in grid order, so the last blocks go
    # first and the short ones fill in behind them instead of leaving a tail of long ones.
    qblock_part = tl.num_programs(2) - 1 - tl.program_id(2)
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
    # m and the scores in base-2 exponent units; split-K partials store m in natural units for _merge_kernel
    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM], tl.float32)
    if KV_QUANT > 0:
        # A quantized cache is multiplied as it is stored (int8 and e4m3 convert exactly to fp16, one instruction
        # per value pair) with its scales applied once: the key scale to the scores, the value scale to the output.
        scale = scale * tl.load(kv_scale_ptr)
    qk_scale = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32) + scale * LOG2E      # a factor per query row
    if FP8_QUERIES:
        q32 = q.to(tl.float32)
        q_amax = tl.max(tl.abs(q32), axis=1)
        q_step = tl.maximum(q_amax, 1e-8) / 448.0       # as quant.quantize_activations_fp8 (448: e4m3's largest)
        q = (q32 / q_step[:, None]).to(tl.float8e4nv, fp_downcast_rounding="rtne")
        qk_scale = qk_scale * q_step
    elif KV_QUANT > 0 and q.dtype != tl.float32:
        q = q.to(tl.float16)
    t = tl.arange(0, TILE)
    w = tl.arange(0, DIM // 4)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    WORDS: tl.constexpr = KV_QUANT > 0 and (q.dtype == tl.float16 or q.dtype == tl.float8e4nv) and WORD_LOADS
    masked_from = first
    if CAUSAL_SPLIT:
        if window == 0:     # keys before the block's first query position are seen by every row: no mask there
            block_first = seq_len - q_len + qblock * BLOCK_Q
            masked_from = tl.maximum(first, tl.minimum(stop, first + (block_first + 1 - first) // TILE * TILE))
        for start in range(first, masked_from, TILE):
            k, v = _kv_tile_as(q, cache_ptr, cache_half, table, start, stop, t, d, w, kv_head, KV_HEADS,
                               BLOCK_TOKENS, DIM, TILE, KV_QUANT, WORDS)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            m, l, acc = online_softmax_whole(s, v, m, l, acc, qk_scale, PRECISION)
    for start in range(masked_from, stop, TILE):
        kv_pos = start + t
        in_range = kv_pos < stop
        k, v = _kv_tile_as(q, cache_ptr, cache_half, table, start, stop, t, d, w, kv_head, KV_HEADS, BLOCK_TOKENS,
                           DIM, TILE, KV_QUANT, WORDS)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale[:, None]  # (rows, TILE)
        ok = (kv_pos[None, :] <= q_pos[:, None]) & row_ok[:, None] & in_range[None, :]
        if window > 0:
            ok = ok & (kv_pos[None, :] > q_pos[:, None] - window)
        m, l, acc = online_softmax(tl.where(ok, s, float("-inf")), v, m, l, acc, PRECISION, True)
    if KV_QUANT > 0:
        acc = acc * tl.load(kv_scale_ptr + 1)
    if NUM_PARTS == 1:
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + q_rows[:, None] * DIM + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        idx = q_rows * NUM_PARTS + part
        tl.store(part_m_ptr + idx, m / LOG2E, mask=row_ok)
        tl.store(part_l_ptr + idx, l, mask=row_ok)
        tl.store(part_acc_ptr + idx[:, None] * DIM + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def merge_row(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, row, NUM_PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
               DIM: tl.constexpr, CACHE: tl.constexpr):
    """Combine the per-partition softmax statistics of one (token, head) row into its output (all partitions
    loads in flight together). CACHE: the loads' cache modifier (".cg" where other SMs wrote them in this kernel)."""
    parts = tl.arange(0, PARTS_PAD)
    real = parts < NUM_PARTS
    m = tl.load(part_m_ptr + row * NUM_PARTS + parts, mask=real, other=float("-inf"), cache_modifier=CACHE)
    l = tl.load(part_l_ptr + row * NUM_PARTS + parts, mask=real, other=0.0, cache_modifier=CACHE)
    d = tl.arange(0, DIM)
    acc = tl.load(part_acc_ptr + (row * NUM_PARTS + parts)[:, None] * DIM + d[None, :], mask=real[:, None], other=0.0,
                  cache_modifier=CACHE)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
    total = tl.sum(acc * w[:, None], axis=0)
    norm = tl.sum(l * w, axis=0)
    tl.store(out_ptr + row * DIM + d, (total / tl.where(norm == 0.0, 1.0, norm)).to(out_ptr.dtype.element_ty))


@triton.jit
def _merge_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, NUM_PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
                  DIM: tl.constexpr, PDL: tl.constexpr):
    """Combine the per-partition softmax statistics of one (token, head) row."""
    wait_for_inputs(PDL)
    merge_row(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, tl.program_id(0).to(tl.int64), NUM_PARTS, PARTS_PAD,
               DIM, "")


def partition_tokens(num_parts: int, part_tokens: int | None, block_tables: torch.Tensor, tokens_per_block: int,
                     step: int) -> int:
    """Keys per split-K partition (the PART_TOKENS constexpr), a multiple of the kernel's step: ONE_PARTITION
    unsplit (the table's width varies between steps and would recompile), by default the whole block table."""
    if num_parts == 1:
        return ONE_PARTITION
    if part_tokens is None:
        part_tokens = block_tables.shape[1] * tokens_per_block
    return triton.cdiv(part_tokens, step) * step


def split_k_partials(out: torch.Tensor, num_parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 (m, l, acc) of every (token, head) row of out (T, H, D) and partition; out itself (unused) for one
    partition."""
    if num_parts == 1:
        return out, out, out
    tokens, heads, dim = out.shape
    part_m = torch.empty((tokens * heads * num_parts,), dtype=torch.float32, device=out.device)
    return part_m, torch.empty_like(part_m), torch.empty((part_m.numel(), dim), dtype=torch.float32, device=out.device)


def attention_config(max_query_len: int, kv_dtype: torch.dtype, q_dtype: torch.dtype = torch.bfloat16,
                     dim: int = 128, device: torch.device | None = None, fp8_queries: bool = False
                     ) -> tuple[int, tuple[int, int], bool, int, bool]:
    """(keys per tile, (num_warps, num_stages), word loads of a quantized cache, query rows a program holds, causal
    split) of the paged attention kernel: tuning.DECODE_FP8_TILE for decode over an e4m3 cache,
    tuning.PROMPT_ATTENTION (tuning.PROMPT_ATTENTION_FP8Q with fp8_queries) for steps with prompt tokens and 16-bit
    queries where its K/V stages fit the GPU's shared memory (Hopper's 227 KB at head dim 128; not the ~100 KB of
    GeForce cards)."""
    if max_query_len == 1 and kv_dtype == torch.float8_e4m3fn:
        return tuning.DECODE_FP8_TILE, tuning.ATTENTION_LAUNCH, True, 64, False
    if max_query_len > 1 and q_dtype in (torch.float16, torch.bfloat16):
        tile, launch, rows, split = tuning.PROMPT_ATTENTION_FP8Q if fp8_queries else tuning.PROMPT_ATTENTION
        if launch[1] * 2 * tile * dim * 2 <= shared_memory(device):      # stages × (K, V) × 16-bit values
            return tile, launch, True, rows, split
    return tuning.ATTENTION_TILE, tuning.ATTENTION_LAUNCH, True, 64, False


@functools.cache
def decode_mma(kv_dtype: torch.dtype, head_dim: int, group: int, tokens_per_block: int, device) -> bool:
    """Whether decode attention over this cache runs on mma_decode_attention (one warp per program; split-K
    partitions are chosen for that: partitions.decode_partitions): 2.0x faster than _paged_attention_kernel at 512
    sequences of 128-256 keys, 1.7x at 256 of 1-2k (the attn_sweep phase of gpu_suite: tuning.py)."""
    return (mma_decode_attention.takes(kv_dtype, head_dim, group, tokens_per_block)
            and mma_decode_attention.available(device))


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, max_query_len: int, scale: float, sliding_window: int | None,
                    num_parts: int = 1, part_tokens: int | None = None, tile: int | None = None,
                    kv_scale: torch.Tensor | None = None, warps_stages: tuple[int, int] | None = None,
                    word_loads: bool | None = None, mma: bool = True, launch: dict | None = None,
                    block_rows: int | None = None, causal_split: bool | None = None,
                    fp8_queries: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed queries q (T, H, D) over each sequence's paged keys/values → (T, H, D).

    num_parts > 1 splits each sequence's keys into partitions of part_tokens (multi_block_mode) and merges them.
    tile (keys per iteration), warps_stages (num_warps, num_stages), word_loads, block_rows and causal_split
    default to attention_config's.
    A decode step over an 8-bit cache goes to mma_decode_attention where it takes it (mma=False: to the Triton
    kernel, which the tests compare it with). block_rows: query rows (tokens × the KV head's query heads) a prompt
    program holds; causal_split: the tiles below the diagonal run without the causal mask (_paged_attention_kernel's
    CAUSAL_SPLIT); fp8_queries: over an e4m3 cache, the queries are quantized to e4m3 a row at a time and
    multiplied by the keys on the FP8 tensor cores (PluginConfig.use_fp8_context_fmha; reference.paged_attention's
    fp8_queries). out: where the result goes (contiguous, q's shape; default a new tensor)."""
    tokens, heads, dim = q.shape
    kv_heads, tokens_per_block = kv_cache.shape[-2], kv_cache.shape[2]
    fp8_queries = fp8_queries and kv_cache.dtype == torch.float8_e4m3fn
    default_tile, default_launch, default_words, default_rows, default_split = attention_config(
        max_query_len, kv_cache.dtype, q.dtype, dim, q.device, fp8_queries)
    tile, (num_warps, num_stages) = tile or default_tile, warps_stages or default_launch
    word_loads = default_words if word_loads is None else word_loads
    block_rows = block_rows or default_rows
    causal_split = default_split if causal_split is None else causal_split
    launch = launch_args(launch)
    group = heads // kv_heads
    group_pad = max(1, triton.next_power_of_2(group))
    block_q = 1 if max_query_len == 1 else max(1, block_rows // group_pad)
    block_q = max(block_q, triton.cdiv(16, group_pad))                  # tl.dot needs at least 16 rows
    one_warp = (mma and max_query_len == 1 and kv_scale is not None
                and decode_mma(kv_cache.dtype, dim, group, tokens_per_block, q.device))
    part_tokens = partition_tokens(num_parts, part_tokens, block_tables, tokens_per_block,
                                   mma_decode_attention.CHUNK if one_warp else tile)
    out = torch.empty_like(q) if out is None else out
    part_m, part_l, part_acc = split_k_partials(out, num_parts)
    if one_warp:
        mma_decode_attention.decode_attention(
            q, kv_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, kv_scale, out,
            (part_m, part_l, part_acc) if num_parts > 1 else None, num_parts, part_tokens, launch)
    else:
        grid = (seq_lens.shape[0], kv_heads, triton.cdiv(max_query_len, block_q) * num_parts)
        _paged_attention_kernel[grid](
            q, kv_cache, kv_cache[0].numel(), block_tables, block_tables.stride(0), seq_lens, query_start_loc, out,
            part_m, part_l, part_acc, scale, sliding_window or 0, q if kv_scale is None else kv_scale,
            KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, DIM=dim, BLOCK_TOKENS=tokens_per_block, TILE=tile,
            BLOCK_Q=block_q, PART_TOKENS=part_tokens, NUM_PARTS=num_parts,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_QUANT=kv_quant(kv_cache),
            WORD_LOADS=word_loads, CAUSAL_SPLIT=causal_split,
            FP8_QUERIES=fp8_queries,
            num_warps=num_warps, num_stages=num_stages, **launch)
    if num_parts > 1:
        _merge_kernel[(tokens * heads,)](part_m, part_l, part_acc, out, NUM_PARTS=num_parts,
                                         PARTS_PAD=triton.next_power_of_2(num_parts), DIM=dim, num_warps=4, **launch)
    return out
