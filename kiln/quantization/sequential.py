"""W8A16, W4A16_AWQ, W4A16_GPTQ and the FP8 modes: weights quantized decoder layer by decoder layer on calibration
inputs.

Per layer: capture the inputs X of its four linear modules (from the already-quantized layers before it) and keep
H = XᵀX / tokens and the mean |x| per channel. W4A16_AWQ then searches and folds its per-channel scales; the int4
modules get a clipping search for their group grids, then their levels by round to nearest (AWQ) or GPTQ, then the
grid refitted to the levels by least squares (refit.py) and the levels rounded again on it, and with
`learned_rounding_steps` the whole layer's roundings re-chosen toward the float network's outputs (tune.py); int8
(W8A16) and FP8 weights (per channel, scale from the row's largest magnitude) are rounded by GPTQ. The layer's
weights are replaced by their quantized values before its outputs feed the next layer. An MoE layer's experts are
quantized the same way one at a time, each on the tokens the router sends it (experts.py, _quantize_experts).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.config import QuantConfig
from kiln.kernels.quant import FP8_MAX, int4_grid, int4_levels, int4_positions, int4_values
from kiln.models.base import PretrainedModel
from kiln.utils.steps import progress

from .awq import fake_quantize, search_clip, search_scales, tie_heads
from .experts import PROJECTIONS as EXPERT_PROJECTIONS, ExpertInputs, hessian, routed_inputs
from .gptq import gptq_fp8, gptq_int4, gptq_int8
from .layerwise import LayerRunner
from .refit import refit_grid
from .tune import IntGrid, learn_rounding

LINEARS = ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
ALGOS = ("W8A16", "W4A16_GPTQ", "W4A16_AWQ", "FP8", "FP8_PER_CHANNEL_PER_TOKEN")
REFITS = 1          # int4: times the grid is refitted to the levels and the levels rounded again on it


def quantize_layers(model: PretrainedModel, quant_config: QuantConfig, sequences: list[list[int]],
                    quiet: bool = False, device=None):
    """Per layer, in order, as it is quantized (on `device`; default: where the weights are): (its index,
    {engine module name: {weight (int4 levels unpacked, or e4m3), weight_scale[, weight_zero]}, each with one row per
    output}, {engine name: float weight that AWQ changed (norms, biases)}, the largest |key| and |value| the
    quantized layer caches)."""
    runner = LayerRunner(model, sequences, device)
    names = [n for n in (LINEARS[:2] if model.config.is_moe else LINEARS) if quant_config.quantizes(n)]
    experts = model.config.is_moe and any(quant_config.quantizes(n) for n in EXPERT_PROJECTIONS)
    steps = quant_config.learned_rounding_steps
    float_stream = runner.stream() if steps else None      # the float network's own residual stream
    layers = progress(runner.layers(), "Quantizing layers", total=len(runner.net.layers), quiet=quiet)
    for index, layer in layers:
        results, changed = {}, {}
        inputs = runner.capture(layer, names + (["moe"] if experts else []))
        moe_inputs = inputs.pop("moe", None)
        stats = _statistics(inputs)
        if steps:
            with torch.no_grad():
                float_stream = runner.forward(layer, float_stream)
        if quant_config.quant_algo == "W4A16_AWQ":
            _apply_awq(layer, stats, model.config, quant_config)
            changed.update({f"layers.{index}.{k}": v.detach().clone() for k, v in layer.state_dict().items()
                            if "norm" in k or k.endswith("bias")})
        grids = {}
        for name in names:
            tensors, grids[name] = _quantize_linear(layer.get_submodule(name), stats[name][0], quant_config,
                                                    _clip_rows(name, model.config), positions=bool(steps))
            results[f"layers.{index}.{name}"] = tensors
        if experts:
            results.update({f"layers.{index}.{name}": tensors
                            for name, tensors in _quantize_experts(layer.moe, moe_inputs, quant_config).items()})
        if steps:
            _learn_rounding(runner, layer, grids, float_stream, steps, int(index), results, f"layers.{index}.")
        runner.advance(layer)
        yield int(index), results, changed, runner.kv_peaks()


def _learn_rounding(runner, layer, grids: dict[str, IntGrid], target, steps: int, seed: int, results: dict,
                    prefix: str) -> None:
    """Re-choose the layer's int4 roundings toward `target` (tune.py); its weights and `results` follow."""
    for name, grid in learn_rounding(runner, layer, grids, runner.stream(), target, steps, seed).items():
        tensors = results[prefix + name]
        tensors.update(weight=grid.levels, weight_scale=grid.scale)
        if grid.zero is not None:
            tensors["weight_zero"] = grid.zero
        _assign(layer.get_submodule(name).weight, int4_values(grid.levels, grid.scale, grid.zero))


def _statistics(inputs: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per module: (H = XᵀX / tokens, mean |x| per input channel) of its captured inputs X."""
    return {name: (x.T @ x / x.shape[0], x.abs().mean(dim=0)) for name, x in inputs.items()}


def _clip_rows(name: str, config) -> torch.Tensor | None:
    """Rows whose range may be clipped: not q and k (attention scores are too sensitive), as AutoAWQ."""
    if name != "attn.qkv_proj":
        return None
    qk = (config.num_attention_heads + config.num_key_value_heads) * config.head_dim
    return torch.arange(qk + config.num_key_value_heads * config.head_dim) >= qk


def _quantize_linear(module, hessian: torch.Tensor, quant_config: QuantConfig, rows: torch.Tensor | None,
                     positions: bool = False) -> tuple[dict[str, torch.Tensor], IntGrid | None]:
    """(the module's quantized tensors, and with `positions` its int4 grid with the positions its levels were
    rounded from)."""
    w = module.weight.detach().float()
    if quant_config.quant_algo == "W8A16" or quant_config.quant_algo.startswith("FP8"):
        return _quantize_per_channel(module, w, hessian, quant_config.quant_algo), None
    group, zero_point = quant_config.group_size, quant_config.has_zero_point
    ratio = search_clip(w, hessian, group, zero_point, None if rows is None else rows.to(w.device))
    scale, zero = int4_grid(w, group, zero_point, ratio)
    by_gptq = quant_config.quant_algo == "W4A16_GPTQ"
    rounded = torch.empty_like(w) if positions and by_gptq else None      # GPTQ's error-compensated values

    def round_levels(scale, zero):
        return gptq_int4(w, hessian, scale, zero, rounded) if by_gptq else int4_levels(w, scale, zero)

    levels = round_levels(scale, zero)
    for _ in range(REFITS):
        scale, zero = refit_grid(w, hessian, levels, scale, zero)
        levels = round_levels(scale, zero)
    # positions on the grid the levels were rounded on: each is within half a level of its own (unless clamped)
    moved = int4_positions(w if rounded is None else rounded, scale, zero) if positions else None
    scale, zero = refit_grid(w, hessian, levels, scale, zero)
    deq = int4_values(levels, scale, zero)
    _assign(module.weight, deq)
    grid = IntGrid(levels, scale, zero, moved) if positions else None
    return {"weight": levels, "weight_scale": scale, **({"weight_zero": zero} if zero is not None else {})}, grid


def _quantize_per_channel(module, w: torch.Tensor, hessian: torch.Tensor, algo: str) -> dict[str, torch.Tensor]:
    """int8 or e4m3 per output row, the row's largest magnitude on the format's largest value, rounded by GPTQ."""
    int8 = algo == "W8A16"
    scale = w.abs().amax(dim=1).clamp_min(1e-8) / (127.0 if int8 else FP8_MAX)
    q = (gptq_int8 if int8 else gptq_fp8)(w, hessian, scale)
    _assign(module.weight, q.float() * scale[:, None])
    return {"weight": q, "weight_scale": scale}


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace a parameter's values (never in place: the float network shares tensors with the model)."""
    param.data = value.to(param.dtype).contiguous()


def _scale_rows(module, rows: slice, factor: torch.Tensor) -> None:
    """Divide the output rows `rows` of a linear module (and its bias) by `factor`: they absorb 1/s."""
    for param in (module.weight, module.bias):
        if param is not None:
            value = param.detach().float().clone()
            value[rows] = value[rows] / (factor[:, None] if value.dim() == 2 else factor)
            _assign(param, value)


def _apply_awq(layer, stats: dict, config, quant_config: QuantConfig) -> None:
    """Search and fold AWQ scales for each quantized module of the layer; `stats` follow (X → X / s)."""
    group, zero_point = quant_config.group_size, quant_config.has_zero_point
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    qkv = layer.attn.qkv_proj
    v_rows = slice((heads + kv_heads) * head_dim, None)
    repeats = heads // kv_heads
    per_kv_head = lambda s: s.view(kv_heads, repeats, head_dim)[:, 0].reshape(-1)      # noqa: E731

    def into_norm(norm):
        return lambda s: _assign(norm.weight, norm.weight.detach().float() / s)

    absorbers = {"attn.qkv_proj": (into_norm(layer.input_norm), None),
                 "attn.o_proj": (lambda s: _scale_rows(qkv, v_rows, per_kv_head(s)),
                                 lambda x: tie_heads(x, repeats, head_dim))}
    if hasattr(layer, "mlp"):                              # an MoE layer's experts: _fold_expert_awq
        gate_up = layer.mlp.gate_up_proj
        up_rows = slice(gate_up.weight.shape[0] // 2, None)
        absorbers.update({"mlp.gate_up_proj": (into_norm(layer.post_attn_norm), None),
                          "mlp.down_proj": (lambda s: _scale_rows(gate_up, up_rows, s), None)})
    for name, (absorb, tie) in absorbers.items():
        if name not in stats:
            continue
        module, (h, x_mean) = layer.get_submodule(name), stats[name]
        w = module.weight.detach().float()
        s = search_scales(w, h, x_mean, lambda m: fake_quantize(m, group, zero_point), group,
                          tie or (lambda x: x))
        _assign(module.weight, w * s)
        absorb(s)
        stats[name] = (h / s[:, None] / s[None, :], x_mean / s)


@dataclass
class ExpertMatrix:
    """One expert's (out, in) matrix, read and replaced by _quantize_linear as a module's weight."""
    weight: torch.Tensor


def _quantize_experts(moe, x: torch.Tensor, quant_config: QuantConfig) -> dict[str, dict[str, torch.Tensor]]:
    """{projection: its tensors stacked over experts} of an MoE layer whose experts are quantized one at a time as
    dense layers are, each on the calibration tokens x that the float router sends it (experts.py); W4A16_AWQ first
    folds each expert's down-projection scales into its up rows. The float experts take their quantized values."""
    inputs = routed_inputs(moe, x)
    names = [n for n in EXPERT_PROJECTIONS if quant_config.quantizes(n)]
    if quant_config.quant_algo == "W4A16_AWQ" and len(names) == len(EXPERT_PROJECTIONS):
        _fold_expert_awq(moe, inputs, quant_config)
    results = {}
    for name in names:
        param = getattr(moe, name.removeprefix("moe."))
        tensors, values = [], []
        for expert, seen in enumerate(inputs):
            matrix = ExpertMatrix(param[expert].detach().float())
            tensors.append(_quantize_linear(matrix, hessian(seen.of(name)), quant_config, None)[0])
            values.append(matrix.weight)
        _assign(param, torch.stack(values))
        results[name] = {key: torch.stack([t[key] for t in tensors]) for key in tensors[0]}
    return results


def _fold_expert_awq(moe, inputs: list[ExpertInputs], quant_config: QuantConfig) -> None:
    """AWQ scales for each expert's down projection (searched on its own tokens), absorbed by its up rows as a
    dense MLP's are; the gate/up inputs also feed the router and every expert, and keep their scale."""
    group, zero_point = quant_config.group_size, quant_config.has_zero_point
    gate_up, down = moe.gate_up_proj.detach().float().clone(), moe.down_proj.detach().float().clone()
    inter = down.shape[2]
    for expert, seen in enumerate(inputs):
        if seen.act.shape[0] == 0:
            continue
        s = search_scales(down[expert], hessian(seen.act), seen.act.abs().mean(dim=0),
                          lambda m: fake_quantize(m, group, zero_point), group)
        down[expert] *= s
        gate_up[expert, inter:] /= s[:, None]
        seen.act = seen.act / s
    _assign(moe.down_proj, down)
    _assign(moe.gate_up_proj, gate_up)
