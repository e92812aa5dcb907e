"""The attention kernels against the torch reference on fresh random inputs, compiled on the GPU (`pytest -m gpu`
and the sweep `-m gpu_slow`, skipped without one): paged attention (prompts, chunks, decode steps, speculative
steps of a few tokens per sequence, split-K
partitions, sliding windows, 8-bit caches), the fused decode kernel (rope, cache write, attention and the merge in
one; also under Triton's interpreter on the CPU, marker `interpreter`: in the process tests/kernels/
test_interpreter.py starts) and the mma.sync decode kernel over 8-bit caches (Gluon and inline PTX: the GPU only)."""
from __future__ import annotations

import pytest
import torch

from conftest import gpu_cases, rel_err
from kiln.kernels import AttentionMetadata, ReferenceOps, reference
from kiln.kernels.rotary import rope_cos_sin

CUDA = torch.device("cuda")


def _paged_case(seqs, heads, kv_heads, dim, block, dtype, seed):
    """Random cache with scattered blocks, and metadata for sequences of (cached, new) tokens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return _scattered_case(seqs, heads, kv_heads, dim, block, dtype, g, spare_blocks=7, order_generator=None)


def _scattered_case(seqs, heads, kv_heads, dim, block, dtype, g, spare_blocks: int, order_generator):
    """(q, cache, meta) on g's device: a random cache of blocks in the order a permutation (drawn from
    order_generator) scatters them, and metadata for sequences of (cached, new) tokens."""
    device = g.device
    num_blocks = sum(-(-(c + n) // block) for c, n in seqs) + spare_blocks
    cache = torch.randn((2, num_blocks, block, kv_heads, dim), generator=g, device=device).to(dtype)
    order = torch.randperm(num_blocks, generator=order_generator).tolist()
    tables, slots, starts = [], [], [0]
    for cached, new in seqs:
        table = [order.pop() for _ in range(-(-(cached + new) // block))]
        tables.append(table)
        slots += [table[i // block] * block + i % block for i in range(cached, cached + new)]
        starts.append(starts[-1] + new)
    width = max(map(len, tables))
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    meta = AttentionMetadata(t(slots), t(starts), t([c + n for c, n in seqs]),
                             t([tb + [0] * (width - len(tb)) for tb in tables]), max(n for _, n in seqs),
                             max(c + n for c, n in seqs), block)
    q = torch.randn((starts[-1], heads, dim), generator=g, device=device).to(dtype)
    return q, cache, meta


@pytest.mark.parametrize("dim, heads, kv_heads, block", gpu_cases(
    [(dim, heads, kv_heads, block) for dim in (64, 128) for heads, kv_heads in ((8, 8), (16, 4), (32, 4))
     for block in (16, 32, 64)], default=[(128, 32, 4, 16), (64, 8, 8, 64), (128, 16, 4, 32)]))
def test_paged_attention_kernel(dim, heads, kv_heads, block):
    from kiln.kernels.triton.paged_attention import paged_attention

    cases = {"decode": [(1, 1), (37, 1), (1000, 1), (8191, 1), (4099, 1)],
             "prefill": [(0, 1), (0, 77), (0, 513), (300, 45), (33, 200)],
             "verify": [(36, 5), (1000, 5), (4094, 5), (7, 2), (511, 4)]}      # a last token and its drafts
    for name, seqs in cases.items():
        for window in (None, 100):
            q, cache, meta = _paged_case(seqs, heads, kv_heads, dim, block, torch.bfloat16, seed=dim + heads + block)
            ref = reference.paged_attention(q.float(), cache.float(), meta, dim ** -0.5, window)
            for parts in ((1, 4) if name == "decode" else (1,)):
                part_tokens = None if parts == 1 else -(-meta.block_tables.shape[1] * block // parts)
                for split in (False, True):
                    out = paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                          meta.max_query_len, dim ** -0.5, window, num_parts=parts,
                                          part_tokens=part_tokens, causal_split=split)
                    assert rel_err(out, ref) < 1e-2, (name, window, parts, split)


@pytest.mark.parametrize("dim, heads, kv_heads, block", gpu_cases(
    [(dim, heads, kv_heads, block) for dim in (64, 128) for heads, kv_heads in ((8, 8), (32, 8), (28, 4))
     for block in (16, 64)], default=[(128, 32, 8, 16), (64, 28, 4, 64)]))
def test_fused_decode_attention_kernel(dim, heads, kv_heads, block):
    """decode_attention (rope + cache write + attention + merge in one kernel) against the three kernels it
    replaces and the float reference, bf16, with and without split-K partitions and a sliding window; a padded
    row (length 0, slot -1) writes nothing."""
    from kiln.kernels.triton import decode_attention
    from kiln.kernels.triton.paged_attention import paged_attention
    from kiln.kernels.triton.rope_cache import rope_and_cache

    seqs = [(0, 1), (37, 1), (1000, 1), (4099, 1), (255, 1)]
    _, cache, meta = _paged_case(seqs, heads, kv_heads, dim, block, torch.bfloat16, seed=dim + heads + block)
    g = torch.Generator(device="cuda").manual_seed(heads)
    qkv = torch.randn((len(seqs) + 1, (heads + 2 * kv_heads) * dim), generator=g, device=CUDA).bfloat16()
    positions = torch.cat([meta.seq_lens - 1, torch.zeros(1, dtype=torch.int64, device=CUDA)])
    padded = lambda t, v: torch.cat([t, torch.full((1,) + t.shape[1:], v, dtype=t.dtype, device=CUDA)])  # noqa: E731
    slots, lens, tables = padded(meta.slot_mapping, -1), padded(meta.seq_lens, 0), padded(meta.block_tables, 0)
    table = rope_cos_sin(8192, dim, 500000.0, None).to(CUDA)
    for window in (None, 100):
        ref_cache = cache.clone()
        q = rope_and_cache(qkv[:-1], positions[:-1], table, ref_cache, meta.slot_mapping, heads, kv_heads, dim)
        ref = reference.paged_attention(q.float(), ref_cache.float(), meta, dim ** -0.5, window)
        for parts in (1, 4, 33):
            part_tokens = None if parts == 1 else -(-meta.block_tables.shape[1] * block // parts)
            unfused = paged_attention(q, ref_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 1,
                                      dim ** -0.5, window, num_parts=parts, part_tokens=part_tokens)
            out_cache = cache.clone()
            out = decode_attention.decode_attention(qkv, positions, table, out_cache, slots, tables, lens, heads,
                                                    kv_heads, dim, dim ** -0.5, window, num_parts=parts,
                                                    part_tokens=part_tokens)
            assert torch.equal(out_cache, ref_cache), (window, parts)
            assert rel_err(out[:-1], ref) < 1e-2 and rel_err(out[:-1], unfused) < 1e-2, (window, parts)
    assert not decode_attention._arrival_counters(CUDA, 1).any()


def _decode_case(seqs: list[int], heads: int, kv_heads: int, dim: int, block: int, seed: int):
    """A one-token step of sequences with `seqs` cached tokens each (-1: a CUDA graph's padded row: length 0, slot
    -1) over an fp16 cache (the interpreter has no bf16 arithmetic) of scattered blocks holding random old keys:
    (qkv, positions, cos_sin, cache, meta)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(c // block + 1 for c in seqs if c >= 0) + 3
    cache = torch.randn((2, num_blocks, block, kv_heads, dim), generator=g).half()
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots = [], []
    for cached in seqs:
        table = [order.pop() for _ in range(cached // block + 1)] if cached >= 0 else []
        tables.append(table)
        slots.append(table[cached // block] * block + cached % block if cached >= 0 else -1)
    width = max(map(len, tables))
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    lens = [c + 1 if c >= 0 else 0 for c in seqs]
    meta = AttentionMetadata(t(slots), t(list(range(len(seqs) + 1))), t(lens),
                             t([tb + [0] * (width - len(tb)) for tb in tables]), 1, max(lens), block)
    qkv = torch.randn((len(seqs), (heads + 2 * kv_heads) * dim), generator=g).half()
    positions = t([max(c, 0) for c in seqs])
    return qkv, positions, rope_cos_sin(1024, dim, 10000.0, None), cache, meta


@pytest.mark.interpreter
@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 2, 32), (4, 4, 16)])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("window", [None, 40])
def test_interpreted_fused_decode_attention_is_rope_cache_and_attention(heads, kv_heads, dim, split, window):
    """decode_attention (rope + cache write + attention + the last partition's merge, one kernel) against
    ReferenceOps' rope_and_cache then paged_attention: the same output and the same cache, the padded row's slot
    untouched; partitions of 64 keys (one tile) and of 128 (two), keys in several blocks; 9 partitions: merged row
    by row (more than UNROLLED_MERGE)."""
    from kiln.kernels.triton import decode_attention

    qkv, positions, cos_sin, cache, meta = _decode_case([0, 70, 130, 200, -1], heads, kv_heads, dim, 16, seed=dim)
    scale = dim ** -0.5
    ref_cache = cache.clone()                            # the reference on the real rows (it has no padded rows)
    real = AttentionMetadata(meta.slot_mapping[:4], meta.query_start_loc[:5], meta.seq_lens[:4],
                             meta.block_tables[:4], 1, meta.max_seq_len, meta.tokens_per_block)
    ref = ReferenceOps().rope_cache_attention(qkv[:4], real, positions[:4], cos_sin, ref_cache, heads, kv_heads,
                                              dim, scale, window)
    for parts, part_tokens in ((4, 64), (2, 128), (9, 64)) if split else ((1, None),):    # 201 keys at most
        out_cache = cache.clone()
        out = decode_attention.decode_attention(qkv, positions, cos_sin, out_cache, meta.slot_mapping,
                                                meta.block_tables, meta.seq_lens, heads, kv_heads, dim, scale, window,
                                                num_parts=parts, part_tokens=part_tokens)
        assert rel_err(out[:4], ref) < 1e-2, part_tokens
        assert torch.equal(out_cache, ref_cache)
    assert torch.equal(decode_attention._arrival_counters(qkv.device, 1)[:5 * kv_heads],
                       torch.zeros(5 * kv_heads, dtype=torch.int32))



def test_prompt_tiles_fall_back_where_their_stages_do_not_fit(monkeypatch):
    """tuning.PROMPT_ATTENTION needs its K/V stages in shared memory: an H100's 227 KB holds them at head dim 128, a
    GeForce card's ~100 KB does not (nor does head dim 256 on an H100), and those get the general tiles."""
    from kiln.kernels.triton import launch, paged_attention, tuning

    cuda = torch.device("cuda", 0)
    for shared, dim, expected in ((232448, 128, tuning.PROMPT_ATTENTION[0]), (101376, 128, tuning.ATTENTION_TILE),
                                  (232448, 256, tuning.ATTENTION_TILE), (101376, 64, tuning.PROMPT_ATTENTION[0])):
        monkeypatch.setattr(launch, "_shared_memory", lambda index, shared=shared: shared)
        assert paged_attention.attention_config(2048, torch.bfloat16, torch.bfloat16, dim, cuda)[0] == expected
    assert paged_attention.attention_config(2048, torch.bfloat16, torch.float32, 128, cuda)[3] == 64


@pytest.mark.interpreter
@pytest.mark.parametrize("block_rows, tile, causal_split", [(64, 64, False), (64, 32, True), (128, 64, True),
                                                         (None, None, None)])   # tuning.PROMPT_ATTENTION
@pytest.mark.parametrize("window", [None, 40])
def test_interpreted_prompt_attention(block_rows, tile, causal_split, window):
    """Prompts, chunks over a cached prefix and one-token rows in one packed step (GQA 4:1, blocks of 16) against
    the reference, for the tile shapes the context_attention benchmark compares (causal_split: the tiles below the
    diagonal without the causal mask)."""
    from kiln.kernels.triton.paged_attention import paged_attention

    seqs = [(0, 37), (20, 45), (0, 1), (70, 1), (100, 30)]
    g = torch.Generator().manual_seed((block_rows or 1) + (tile or 0))
    q, cache, meta = _scattered_case(seqs, 8, 2, 32, 16, torch.float16, g, spare_blocks=3,   # the interpreter
                                     order_generator=g)                                     # has no bf16
    ref = reference.paged_attention(q.float(), cache.float(), meta, 32 ** -0.5, window)
    out = paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
                          32 ** -0.5, window, tile=tile, block_rows=block_rows, causal_split=causal_split)
    assert rel_err(out, ref) < 1e-2


def _fp8_queries_case(g, on_grid: bool):
    """(q, e4m3 cache, kv_scale, meta) of prompts, a chunk over a cached prefix and one-token rows (GQA 4:1, blocks
    of 16). on_grid: every (token, head) row of q already lies on its own e4m3 grid (row max 448 · 2^-8), so that
    rounding it to e4m3 is exact (the interpreter's float32 → e4m3 conversion is off at binade edges)."""
    seqs = [(0, 37), (20, 45), (0, 1), (70, 1), (100, 30)]
    q, cache, meta = _scattered_case(seqs, 8, 2, 32, 16, torch.float16, g, spare_blocks=3,
                                     order_generator=g if g.device.type == "cpu" else None)    # randperm: CPU only
    if on_grid:
        grid = (q.float() * 40).to(torch.float8_e4m3fn).float()
        grid[..., 0] = 448.0
        q = (grid * 2.0 ** -8).to(torch.float16)
    return q, (cache.float() * 2).to(torch.float8_e4m3fn), torch.tensor([0.5, 0.25], device=g.device), meta


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [None, 40])
def test_interpreted_fp8_context_attention(window):
    """FP8 queries (use_fp8_context_fmha) over an e4m3 cache: each row's scale, the e4m3 product with the cached
    keys and the fp16 values give the reference's attention (queries on their e4m3 grid, see _fp8_queries_case)."""
    from kiln.kernels.triton.paged_attention import paged_attention

    q, cache, kv_scale, meta = _fp8_queries_case(torch.Generator().manual_seed(5), on_grid=True)
    ref = reference.paged_attention(q.float(), cache, meta, 32 ** -0.5, window, kv_scale, fp8_queries=True)
    for tile, rows, split in ((32, 64, True), (16, 32, False)):
        out = paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
                              32 ** -0.5, window, kv_scale=kv_scale, tile=tile, block_rows=rows, causal_split=split,
                              word_loads=False, fp8_queries=True)
        assert rel_err(out, ref) < 1e-2


def test_fp8_queries_round_each_row_to_e4m3():
    """The reference's FP8 queries are each (token, head) row rounded to e4m3 on its own scale: the same attention
    for queries already on their grid, a different one for random queries."""
    g = torch.Generator().manual_seed(5)
    for on_grid in (True, False):
        q, cache, kv_scale, meta = _fp8_queries_case(g, on_grid)
        plain = reference.paged_attention(q.float(), cache, meta, 32 ** -0.5, None, kv_scale)
        fp8 = reference.paged_attention(q.float(), cache, meta, 32 ** -0.5, None, kv_scale, fp8_queries=True)
        assert (rel_err(fp8, plain) < 1e-6) == on_grid
        assert rel_err(fp8, plain) < 0.1


def _mixed_step(g, kv: str):
    """(q, cache, kv_scale, meta) of a step whose first three sequences decode one token each (the step's leading
    decodes, meta.decode_seqs) before two prompts, a chunk over a cached prefix, and a one-token sequence after
    them; a bf16 or e4m3 ("FP8") cache."""
    seqs = [(70, 1), (300, 1), (5, 1), (0, 37), (20, 45), (40, 1)]
    q, cache, meta = _scattered_case(seqs, 8, 2, 64, 16, torch.bfloat16, g, spare_blocks=3,
                                     order_generator=g if g.device.type == "cpu" else None)
    meta.decode_seqs = 3
    if kv == "FP8":
        return q, (cache.float() * 2).to(torch.float8_e4m3fn), torch.tensor([0.5, 0.25], device=g.device), meta
    return q, cache, None, meta


def test_fp8_queries_leave_a_steps_leading_decodes_alone():
    """With FP8 queries the reference rounds the prompt rows to e4m3 and keeps the leading decode tokens' rows (which
    the GPU attends as a decode step's) in 16 bits, the later one-token row included in the prompts' rounding."""
    q, cache, kv_scale, meta = _mixed_step(torch.Generator().manual_seed(3), "FP8")
    plain = reference.paged_attention(q.float(), cache, meta, 0.125, None, kv_scale)
    fp8 = reference.paged_attention(q.float(), cache, meta, 0.125, None, kv_scale, fp8_queries=True)
    meta.decode_seqs = 0
    every_row = reference.paged_attention(q.float(), cache, meta, 0.125, None, kv_scale, fp8_queries=True)
    assert torch.allclose(fp8[:3], plain[:3], atol=1e-6) and torch.allclose(fp8[3:], every_row[3:], atol=1e-6)
    assert rel_err(fp8[3:], plain[3:]) > 1e-3


def test_leading_decodes_counts_one_token_sequences_before_the_first_prompt():
    from kiln.runtime.step import leading_decodes

    assert leading_decodes([0, 1, 2, 3, 40, 41]) == 3
    assert leading_decodes([0, 37, 38]) == 0 and leading_decodes([0, 1, 2]) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("kv, fp8_queries", [("bf16", False), ("FP8", False), ("FP8", True)])
def test_mixed_step_attends_its_decodes_as_a_decode_step(kv, fp8_queries):
    """TritonOps.attention on a step of leading decodes and prompts: the decode tokens on the decode kernels, the
    rest on the prompt kernel, each writing its rows of one output: the reference's attention (FP8 queries for the
    prompt rows alone), and without the split (decode_seqs 0) the prompt kernel's for every row."""
    from kiln.kernels import TritonOps, TritonOptions

    q, cache, kv_scale, meta = _mixed_step(torch.Generator(device="cuda").manual_seed(11), kv)
    ops = TritonOps(TritonOptions(fp8_context_fmha=fp8_queries))
    ref = reference.paged_attention(q.float(), cache.float() if kv == "bf16" else cache, meta, 0.125, None,
                                    kv_scale, fp8_queries=fp8_queries)
    out = ops.attention(q, cache, meta, 0.125, None, kv_scale)
    assert rel_err(out, ref) < 1e-2, rel_err(out, ref)
    if not fp8_queries:
        meta.decode_seqs = 0
        assert rel_err(ops.attention(q, cache, meta, 0.125, None, kv_scale), ref) < 1e-2


@pytest.mark.gpu
def test_fp8_context_attention():
    """FP8 queries on the GPU's FP8 tensor cores, random (off-grid) queries in bf16: the reference with the same
    rounding to e4m3, much closer than the 16-bit attention is (the FP8 path is the one taken), with the engine's
    prompt tiles and the general ones."""
    from kiln.kernels.triton.paged_attention import paged_attention

    g = torch.Generator(device="cuda").manual_seed(7)
    q, cache, kv_scale, meta = _fp8_queries_case(g, on_grid=False)
    q = q.to(torch.bfloat16)
    ref = reference.paged_attention(q.float(), cache, meta, 32 ** -0.5, None, kv_scale, fp8_queries=True)
    plain = reference.paged_attention(q.float(), cache, meta, 32 ** -0.5, None, kv_scale)
    for tile, rows, split in ((None, None, None), (64, 64, False)):
        out = paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
                              32 ** -0.5, None, kv_scale=kv_scale, tile=tile, block_rows=rows, causal_split=split,
                              fp8_queries=True)
        assert rel_err(out, ref) < 1e-2 and rel_err(out, ref) < rel_err(ref, plain) / 3


@pytest.mark.parametrize("kv, dim, heads, kv_heads, block", gpu_cases(
    [(kv, *shape, block) for kv in ("INT8", "FP8")
     for shape in ((128, 32, 8), (128, 28, 4), (128, 8, 8), (64, 64, 8), (64, 9, 3)) for block in (16, 32, 64)],
    default=[("INT8", 128, 32, 8, 16), ("FP8", 128, 28, 4, 32), ("INT8", 64, 9, 3, 64), ("FP8", 64, 64, 8, 16)]))
def test_mma_decode_attention(kv, dim, heads, kv_heads, block):
    """The mma.sync decode kernel over an 8-bit cache against the float reference and the Triton kernel: one query
    token per sequence, windows, split-K partitions, and a padded row (no query token, as CUDA graphs add)."""
    from kiln.kernels.triton import mma_decode_attention
    from kiln.kernels.triton.paged_attention import paged_attention

    dtype = torch.int8 if kv == "INT8" else torch.float8_e4m3fn
    assert mma_decode_attention.takes(dtype, dim, heads // kv_heads, block)
    seqs = [(0, 1), (36, 1), (1000, 1), (4098, 1), (127, 1), (15, 1)]
    q, cache, meta = _paged_case(seqs, heads, kv_heads, dim, block, torch.bfloat16, seed=dim + heads + block)
    cache = (cache.float() * 20).clamp(-100, 100).to(dtype) if kv == "INT8" else (cache.float() * 50).to(dtype)
    kv_scale = torch.tensor([0.05, 0.03], device=CUDA)
    starts = torch.cat([meta.query_start_loc, meta.query_start_loc[-1:]])       # one more sequence, no token
    seq_lens = torch.cat([meta.seq_lens, meta.seq_lens[:1]])
    tables = torch.cat([meta.block_tables, meta.block_tables[:1]])
    for window in (None, 100):
        ref = reference.paged_attention(q.float(), cache, meta, dim ** -0.5, window, kv_scale)
        for parts in (1, 3):
            part_tokens = None if parts == 1 else -(-tables.shape[1] * block // parts)
            outs = [paged_attention(q, cache, tables, seq_lens, starts, 1, dim ** -0.5, window, num_parts=parts,
                                    part_tokens=part_tokens, kv_scale=kv_scale, mma=mma) for mma in (True, False)]
            assert rel_err(outs[0], ref) < 1e-2, (window, parts)
            assert rel_err(outs[0], outs[1]) < 1e-2, (window, parts)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["INT8", "FP8"])
def test_quantized_kv_cache_kernels(kv):
    from kiln.kernels.triton.paged_attention import paged_attention

    dtype = torch.int8 if kv == "INT8" else torch.float8_e4m3fn
    q, cache, meta = _paged_case([(300, 1), (0, 40), (33, 7)], 32, 8, 128, 32, torch.bfloat16, seed=5)
    cache = cache.float().clamp(-100, 100).to(dtype) if kv == "INT8" else cache.float().to(dtype)
    kv_scale = torch.tensor([0.02, 0.03], device=CUDA)
    ref = reference.paged_attention(q.float(), cache, meta, 128 ** -0.5, None, kv_scale)
    out = paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
                          128 ** -0.5, None, kv_scale=kv_scale)
    assert rel_err(out, ref) < 2e-2

