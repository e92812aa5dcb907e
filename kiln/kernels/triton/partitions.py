"""Split-K partitions of decode attention (multi_block_mode): how many programs share one sequence's keys. Plain
Python over tuning's constants; TritonOps.decode_partitions applies it to a step."""
from __future__ import annotations

from .tuning import BUSY_PROGRAMS, BUSY_WARPS, LONG_CONTEXT, MIN_PARTITION, PARTITION_TOKENS


def decode_partitions(programs: int, max_keys: int, one_warp: bool) -> tuple[int, int | None]:
    """Split-K partitions (num_parts, part_tokens) of decode attention with `programs` (sequence, KV head) pairs
    over up to max_keys keys: when the pairs alone leave the GPU idle, or when sequences are long enough
    (LONG_CONTEXT) that one program per pair would stream its keys too slowly. Batches of fewer pairs than fill the
    GPU (BUSY_PROGRAMS, or ~8× more one-warp programs of mma_decode_attention: BUSY_WARPS) get partitions of fewer
    keys, down to MIN_PARTITION, so that programs × partitions fill it."""
    busy = BUSY_WARPS if one_warp else BUSY_PROGRAMS
    if max_keys <= MIN_PARTITION or (programs >= busy and max_keys <= LONG_CONTEXT):
        return 1, None
    part = PARTITION_TOKENS
    if programs < busy:
        unit = 16 if one_warp else MIN_PARTITION                          # a one-warp step; a Triton tile
        wanted = -(-max_keys * programs // busy)                           # keys per partition to fill the GPU
        part = min(PARTITION_TOKENS, max(MIN_PARTITION, -(-wanted // unit) * unit))
    parts = -(-max_keys // part)
    return (1, None) if parts == 1 else (parts, part)
