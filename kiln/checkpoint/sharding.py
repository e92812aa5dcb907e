"""Tensor and pipeline parallel sharding of a checkpoint: what each rank holds.

Tensor parallelism (tp ranks): q/k/v and gate/up are split by output rows (column-parallel), o and down by input
columns (row-parallel, summed by an all-reduce); query heads are divided, KV heads divided when there are at least
tp of them and otherwise replicated (rank r keeps KV head r // (tp / kv_heads)); the LM head is split by vocabulary
rows (padded to a multiple of tp, logits all-gathered); the embedding is replicated, or split by vocabulary rows
(embedding_sharding_dim 0) or hidden columns (1) with use_parallel_embedding. Mixtral experts are divided among
ranks (moe_tp_mode 0, expert parallel) or each split by its intermediate size (1, tensor parallel).
Pipeline parallelism (pp stages): consecutive layers per stage; the first stage holds the embedding, the last the
final norm and the LM head.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kiln.config import Mapping, PretrainedConfig


@dataclass(frozen=True)
class LocalDims:
    heads: int
    kv_heads: int
    intermediate: int
    vocab_padded: int
    layers: range
    experts: range
    first_stage: bool
    last_stage: bool


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def check_parallel(config: PretrainedConfig) -> None:
    """The model's shapes must divide by the parallelism; a ValueError names what does not."""
    m, tp = config.mapping, config.mapping.tp_size
    problems = []
    if config.num_attention_heads % tp:
        problems.append(f"num_attention_heads={config.num_attention_heads} is not divisible by tp_size={tp}")
    kv = config.num_key_value_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        problems.append(f"num_key_value_heads={kv} neither divides nor is divisible by tp_size={tp}")
    if config.intermediate_size % tp and not (config.is_moe and config.moe_tp_mode == 0):
        problems.append(f"intermediate_size={config.intermediate_size} is not divisible by tp_size={tp}")
    if config.is_moe and config.moe_tp_mode == 0 and config.moe_num_experts % tp:
        problems.append(f"moe_num_experts={config.moe_num_experts} is not divisible by tp_size={tp} (expert parallel)")
    if config.use_parallel_embedding and config.embedding_sharding_dim == 1 and config.hidden_size % tp:
        problems.append(f"hidden_size={config.hidden_size} is not divisible by tp_size={tp} (embedding_sharding_dim 1)")
    if m.pp_size > config.num_hidden_layers:
        problems.append(f"pp_size={m.pp_size} exceeds num_hidden_layers={config.num_hidden_layers}")
    if problems:
        raise ValueError("cannot shard the model: " + "; ".join(problems))


def local_dims(config: PretrainedConfig) -> LocalDims:
    m, tp = config.mapping, config.mapping.tp_size
    kv = config.num_key_value_heads
    experts = range(config.moe_num_experts)
    inter = config.intermediate_size // tp
    if config.is_moe and config.moe_tp_mode == 0:
        per = config.moe_num_experts // tp
        experts, inter = range(m.tp_rank * per, (m.tp_rank + 1) * per), config.intermediate_size
    return LocalDims(heads=config.num_attention_heads // tp, kv_heads=kv // tp if kv >= tp else 1,
                     intermediate=inter, vocab_padded=-(-config.vocab_size // tp) * tp,
                     layers=stage_layers(config.num_hidden_layers, m.pp_size, m.pp_rank), experts=experts,
                     first_stage=m.pp_rank == 0, last_stage=m.pp_rank == m.pp_size - 1)


def shard_weights(full: PretrainedConfig, weights: dict[str, torch.Tensor], mapping: Mapping):
    """(config of `mapping.rank`, that rank's tensors) from the tensors of an unsharded (tp = pp = 1) model."""
    config = dataclasses.replace(full, mapping=mapping)
    check_parallel(config)
    if full.quantization.quant_algo is not None and mapping.tp_size > 1:
        raise ValueError("tensor parallelism of quantized weights is not supported yet")
    dims, tp, r = local_dims(config), mapping.tp_size, mapping.tp_rank
    hd, kv = full.head_dim, full.num_key_value_heads
    rows = lambda t, n: t.narrow(0, r * n, n)                                  # noqa: E731
    cols = lambda t, n: t.narrow(1, r * n, n)                                  # noqa: E731
    kv_first = r * dims.kv_heads if kv >= tp else r // (tp // kv)
    out = {}
    for name, t in weights.items():
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        if layer is not None and layer not in dims.layers:
            continue
        if name == "embed_tokens.weight":
            if dims.first_stage or (full.tie_word_embeddings and dims.last_stage):
                out[name] = _shard_embedding(t, config, dims)
            continue
        if name in ("norm.weight", "lm_head.weight") and not dims.last_stage:
            continue
        if name == "lm_head.weight":
            out[name] = rows(_pad_rows(t, dims.vocab_padded), dims.vocab_padded // tp)
        elif ".attn.q_proj." in name:
            out[name] = rows(t, dims.heads * hd)
        elif ".attn.k_proj." in name or ".attn.v_proj." in name:
            out[name] = t.narrow(0, kv_first * hd, dims.kv_heads * hd)
        elif name.endswith("attn.o_proj.weight"):
            out[name] = cols(t, dims.heads * hd)
        elif ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            out[name] = rows(t, dims.intermediate)
        elif name.endswith("mlp.down_proj.weight"):
            out[name] = cols(t, dims.intermediate)
        elif name.endswith(("moe.gate_proj", "moe.up_proj", "moe.down_proj")):
            t = t[dims.experts.start:dims.experts.stop]
            if full.moe_tp_mode == 1:
                t = t.narrow(1 if not name.endswith("down_proj") else 2, r * dims.intermediate, dims.intermediate)
            out[name] = t
        elif name.endswith(("o_proj.bias", "down_proj.bias")):
            out[name] = t if r == 0 else torch.zeros_like(t)                   # added once: the sum is all-reduced
        else:                                                                # norms, router
            out[name] = t
    return config, {k: v.contiguous() for k, v in out.items()}


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _shard_embedding(t: torch.Tensor, config: PretrainedConfig, dims: LocalDims) -> torch.Tensor:
    tp, r = config.mapping.tp_size, config.mapping.tp_rank
    if not config.use_parallel_embedding or tp == 1:
        return t
    if config.embedding_sharding_dim == 0:
        per = dims.vocab_padded // tp
        return _pad_rows(t, dims.vocab_padded).narrow(0, r * per, per)
    per = config.hidden_size // tp
    return t.narrow(1, r * per, per)
