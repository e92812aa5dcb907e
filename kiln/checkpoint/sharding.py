"""Tensor and pipeline parallel sharding of a checkpoint: what each rank holds.

Tensor parallelism (tp ranks): q/k/v and gate/up are split by output rows (column-parallel), o and down by input
columns (row-parallel, summed by an all-reduce); query heads are divided, KV heads divided when there are at least
tp of them and otherwise replicated (rank r keeps KV head r // (tp / kv_heads)); the LM head is split by vocabulary
rows (padded to a multiple of tp, logits all-gathered); the embedding is replicated, or split by vocabulary rows
(embedding_sharding_dim 0) or hidden columns (1) with use_parallel_embedding. Mixtral experts are divided among
ranks (moe_tp_mode 0, expert parallel) or each split by its intermediate size (1, tensor parallel). Quantized experts
split as dense layers do.
Quantized layers split the same way: per-output-channel scales follow their rows; row-parallel layers split packed
int4 columns and their groups' scales/zeros (groups may not straddle ranks) and SmoothQuant factors by input
channel; static activation scales are whole on every rank.
Pipeline parallelism (pp stages): consecutive layers per stage; the first stage holds the embedding, the last the
final norm and the LM head.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kiln.config import Mapping, PretrainedConfig

from .lazy import TensorSpec

_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


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
    problems += _quantized_problems(config)
    if m.pp_size > config.num_hidden_layers:
        problems.append(f"pp_size={m.pp_size} exceeds num_hidden_layers={config.num_hidden_layers}")
    if problems:
        raise ValueError("cannot shard the model: " + "; ".join(problems))


def _quantized_problems(config: PretrainedConfig) -> list[str]:
    """Row-parallel layers split their inputs: int4 packs two inputs per byte, and groups must not straddle ranks."""
    quant, tp = config.quantization, config.mapping.tp_size
    if tp == 1 or not (quant.quant_algo or "").startswith("W4A16"):
        return []
    unit = quant.group_size if quant.quant_algo in ("W4A16_GPTQ", "W4A16_AWQ") else 2
    inputs = {"attention output inputs": config.num_attention_heads * config.head_dim // tp}
    if not (config.is_moe and config.moe_tp_mode == 0):          # expert parallel: experts keep their inputs whole
        inputs["MLP down-projection inputs"] = config.intermediate_size // tp
    return [f"{what} per rank ({n}) are not a multiple of {unit} ({quant.quant_algo} with tp_size={tp})"
            for what, n in inputs.items() if n % unit]


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
    cut = _cutter(full, mapping)
    out = {name: part for name, t in weights.items() if (part := cut(name, t)) is not None}
    return config, {k: v.contiguous() for k, v in out.items()}


def shard_view(full: PretrainedConfig, weights, mapping: Mapping):
    """`mapping.rank`'s share of an unsharded model's weights (a dict or kiln.checkpoint.lazy weights) as
    LazyWeights: each tensor cut when it is made (the others are never made)."""
    from .lazy import LazyWeights, iter_take, meta_tensors, units_like, weights_device

    check_parallel(dataclasses.replace(full, mapping=mapping))
    cut = _cutter(full, mapping)
    specs = {name: TensorSpec(tuple(part.shape), part.dtype) for name, t in meta_tensors(weights).items()
             if (part := cut(name, t)) is not None}

    def make(names: list[str]) -> dict[str, torch.Tensor]:
        return {name: cut(name, t).contiguous() for name, t in iter_take(weights, names)}

    label = getattr(weights, "source", "model")
    return LazyWeights(specs, units_like(weights, specs), make, f"{label} (rank {mapping.rank})",
                       weights_device(weights))


def rank_parts(full: PretrainedConfig, weights, mapping: Mapping):
    """(rank → name → TensorSpec of what it holds, and an iterator giving, for each tensor of the unsharded model's
    `weights` as it is made, the [(rank, name, part)] of the ranks holding part of it): every rank of `mapping`
    cut from one pass over the weights."""
    from .lazy import meta_tensors

    check_parallel(dataclasses.replace(full, mapping=mapping))
    cutters = {rank: _cutter(full, mapping.for_rank(rank)) for rank in range(mapping.world_size)}
    meta = meta_tensors(weights)
    specs = {rank: {name: TensorSpec(tuple(part.shape), part.dtype) for name, t in meta.items()
                    if (part := cut(name, t)) is not None} for rank, cut in cutters.items()}

    def parts():
        for name, t in weights.items():
            yield [(rank, name, part.contiguous()) for rank, cut in cutters.items()
                   if (part := cut(name, t)) is not None]

    return specs, parts()


def shard_lora(config: PretrainedConfig, layer: str, a: torch.Tensor, b: torch.Tensor):
    """`config.mapping.rank`'s share of a LoRA pair on the checkpoint layer `layer` (layers.3.attn.q_proj): A (r, in)
    and B (out, r) cut as the layer's weight is, B by rows for a column-parallel layer (q/k/v, gate/up), A by input
    columns for a row-parallel one (o, down: each rank's partial product is summed by the layer's all-reduce); the
    other whole. None where the layer is on another pipeline stage."""
    cut = _cutter(config, config.mapping)
    weight = f"{layer}.weight"
    if layer.endswith(("o_proj", "down_proj")):
        part = cut(weight, a)
        return None if part is None else (part.contiguous(), b)
    part = cut(weight, b)
    return None if part is None else (a, part.contiguous())


def _cutter(full: PretrainedConfig, mapping: Mapping):
    """(name, tensor of the unsharded model) → the part of it `mapping.rank` holds, or None."""
    config = dataclasses.replace(full, mapping=mapping)
    dims, tp, r = local_dims(config), mapping.tp_size, mapping.tp_rank
    hd, kv = full.head_dim, full.num_key_value_heads
    kv_first = r * dims.kv_heads if kv >= tp else r // (tp // kv)
    columns = {"q_proj": (r * dims.heads * hd, dims.heads * hd), "k_proj": (kv_first * hd, dims.kv_heads * hd),
               "v_proj": (kv_first * hd, dims.kv_heads * hd), "gate_proj": (r * dims.intermediate, dims.intermediate),
               "up_proj": (r * dims.intermediate, dims.intermediate)}
    row_inputs = ("o_proj", "down_proj")

    def cut(name: str, t: torch.Tensor) -> torch.Tensor | None:
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        if layer is not None and layer not in dims.layers:
            return None
        if name == "embed_tokens.weight":
            keep = dims.first_stage or (full.tie_word_embeddings and dims.last_stage)
            return _shard_embedding(t, config, dims) if keep else None
        if name in ("norm.weight", "lm_head.weight") and not dims.last_stage:
            return None
        module, tensor = _module_and_tensor(name)
        if ".moe." in name and module in _EXPERT_PROJECTIONS:
            return _shard_experts(t, module, tensor, config, dims)
        if module == "lm_head" and tensor != "input_scale":
            return _pad_rows(t, dims.vocab_padded).narrow(0, r * dims.vocab_padded // tp, dims.vocab_padded // tp)
        if module in columns and tensor != "input_scale":
            return t.narrow(0, *columns[module])
        if module in row_inputs:
            return _shard_row_parallel(t, tensor, tp, r)
        return t                                                  # norms, router, static activation scales

    return cut


def _module_and_tensor(name: str) -> tuple[str, str]:
    """layers.3.attn.q_proj.weight_scale → ("q_proj", "weight_scale"); lm_head.weight → ("lm_head", "weight");
    float experts layers.3.moe.down_proj → ("down_proj", "weight")."""
    parts = name.split(".")
    if parts[-1] in _EXPERT_PROJECTIONS:
        return parts[-1], "weight"
    return (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)


def _shard_experts(t: torch.Tensor, module: str, tensor: str, config: PretrainedConfig, dims: LocalDims):
    """A stacked expert tensor (E, out, in), or a quantized one with that leading dimension: this rank's experts
    (expert parallel), or every expert's slice (tensor parallel: gate/up rows, down's input columns — packed int4
    bytes and their groups' scales — as the dense layers split). A static input scale is whole on every rank."""
    if tensor == "input_scale":
        return t
    t = t[dims.experts.start:dims.experts.stop]
    if config.moe_tp_mode == 0:
        return t
    tp, r = config.mapping.tp_size, config.mapping.tp_rank
    if module != "down_proj":
        return t.narrow(1, r * dims.intermediate, dims.intermediate)
    if t.dim() < 3 or t.shape[2] == 1:               # a per-output-channel scale (or zero point)
        return t
    per = t.shape[2] // tp
    return t.narrow(2, r * per, per)


def _shard_row_parallel(t: torch.Tensor, tensor: str, tp: int, r: int) -> torch.Tensor:
    """A row-parallel (o_proj, down_proj) tensor: this rank's input columns (two per byte for packed int4, and
    their groups' scales); per-output-channel scales and the static input scale stay whole."""
    if tensor == "weight" or (tensor in ("weight_scale", "weight_zero") and t.dim() == 2 and t.shape[1] > 1):
        per = t.shape[1] // tp
        return t.narrow(1, r * per, per)
    if tensor == "smoother":                      # one factor per input channel
        per = t.shape[0] // tp
        return t.narrow(0, r * per, per)
    if tensor == "bias":
        return t if r == 0 else torch.zeros_like(t)       # added once: the sum is all-reduced
    return t


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
