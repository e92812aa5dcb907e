"""auto_parallel: pick tensor and pipeline parallelism for a model on `world_size` ranks, and say why."""
from __future__ import annotations

import dataclasses

from kiln.checkpoint.sharding import check_parallel
from kiln.config import Mapping, PretrainedConfig


def weight_bytes(config: PretrainedConfig) -> int:
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    attn = h * (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim + \
        config.num_attention_heads * config.head_dim * h
    mlp = 3 * h * i * max(1, config.moe_num_experts)
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[config.dtype]
    return (layers * (attn + mlp) + embeddings) * itemsize


def parallel_candidates(config: PretrainedConfig, world_size: int) -> list[tuple[int, int, str | None]]:
    """Every tp × pp split of world_size ranks, largest tp first, with why the model cannot be sharded so (None:
    it can)."""
    candidates = []
    for tp in sorted((t for t in range(1, world_size + 1) if world_size % t == 0), reverse=True):
        pp = world_size // tp
        try:
            check_parallel(dataclasses.replace(config, mapping=Mapping(world_size, 0, tp, pp)))
            candidates.append((tp, pp, None))
        except ValueError as err:
            candidates.append((tp, pp, str(err)))
    return candidates


def choose_parallelism(config: PretrainedConfig, world_size: int, max_memory_bytes: int | None = None):
    """(tp_size, pp_size, reason). Tensor parallelism first (it also cuts latency), as far as the heads allow;
    pipeline stages for the rest. Every candidate must shard cleanly and fit the memory limit."""
    reasons = []
    for tp, pp, problem in parallel_candidates(config, world_size):
        if problem is not None:
            reasons.append(f"tp={tp}, pp={pp}: {problem}")
            continue
        per_rank = weight_bytes(config) / world_size
        if max_memory_bytes is not None and per_rank > max_memory_bytes:
            raise ValueError(f"auto_parallel: {per_rank / 2**30:.1f} GiB of weights per rank exceed the "
                             f"{max_memory_bytes / 2**30:.1f} GiB limit with {world_size} ranks")
        why = (f"tp={tp}, pp={pp}: the largest tensor parallelism the model's {config.num_attention_heads} query / "
               f"{config.num_key_value_heads} KV heads and sizes allow on {world_size} ranks"
               f" ({per_rank / 2**30:.2f} GiB of weights per rank)")
        return tp, pp, "; ".join(reasons + [why])
    raise ValueError("auto_parallel: no tp×pp split of the model fits: " + "; ".join(reasons))


def describe_search(config: PretrainedConfig, world_size: int, max_memory_bytes: int | None,
                    chosen: tuple[int, int]) -> list[str]:
    """AutoParallelConfig.debug_mode's account of the search: every candidate, whether it shards, which one won."""
    per_rank = weight_bytes(config) / world_size
    limit = "no limit" if max_memory_bytes is None else f"limit {max_memory_bytes / 2**30:.2f} GiB"
    lines = [f"auto_parallel search over {world_size} ranks, {per_rank / 2**30:.3f} GiB of weights per rank "
             f"({limit}); the largest tensor parallelism that shards wins (it also cuts latency):"]
    for tp, pp, problem in parallel_candidates(config, world_size):
        if problem is None:
            problem = "chosen" if (tp, pp) == chosen else f"shards, but tp={chosen[0]} is larger"
        lines.append(f"  tp={tp}, pp={pp}: {problem}")
    return lines
