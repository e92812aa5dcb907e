"""Offline quantization of a model in the checkpoint layout: calibration, SmoothQuant, AWQ, GPTQ, weight packing.

    quantized = quantize_model(model, QuantConfig(quant_algo="W4A16_AWQ", group_size=128), calib_size=16)

Calibration runs the float model (reference kernels) over Kiln's own calibration text
(kiln/data/calibration.txt, then Python's bundled documentation for more) and records, per linear layer, each
input channel's largest magnitude, and per layer the largest cached key and value. From those: SmoothQuant
factors, static activation scales and KV scales. AWQ, GPTQ and the FP8 weights are quantized layer by layer
instead (sequential.py), which also measures the keys and values that the quantized layers produce.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import random

import torch

from kiln.config import QuantConfig
from kiln.config.quant import GROUP_ALGOS
from kiln.kernels import AttentionMetadata, ReferenceOps, quant
from kiln.models.base import PretrainedModel
from kiln.models.llama import MoE

from kiln.utils.steps import progress

from .experts import PROJECTIONS as EXPERT_PROJECTIONS, input_peaks
from .sequential import ALGOS as SEQUENTIAL_ALGOS, quantize_layers

CALIBRATION_SEQ_LEN = 256
INT8_MAX, FP8_MAX = 127.0, quant.FP8_MAX


def calibration_tokens(model: PretrainedModel, calib_size: int, seq_len: int = CALIBRATION_SEQ_LEN) -> list[list[int]]:
    """`calib_size` token sequences: Kiln's calibration text first, then passages spread over Python's own
    reference documentation (the standard library's pydoc_data: present wherever Python is, nothing to download),
    so that larger sizes bring new tokens rather than repeats (GPTQ overfits a few hundred tokens). Random
    tokens when the model has no tokenizer."""
    from kiln.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model.tokenizer_files)
    if tokenizer is None:
        rng = random.Random(0)
        return [[rng.randrange(model.config.vocab_size) for _ in range(seq_len)] for _ in range(calib_size)]
    own = tokenizer.encode(importlib.resources.files("kiln.data").joinpath("calibration.txt").read_text())
    chunks = [own[i:i + seq_len] for i in range(0, len(own), seq_len)][:calib_size]
    if len(chunks) < calib_size:
        from pydoc_data.topics import topics

        docs = tokenizer.encode("\n\n".join(topics[name] for name in sorted(topics)))
        wanted = calib_size - len(chunks)
        stride = max(seq_len, (len(docs) - seq_len) // wanted)
        chunks += [docs[i * stride:i * stride + seq_len] for i in range(wanted)]
    return chunks


@dataclasses.dataclass
class CalibrationStats:
    inputs: dict[str, torch.Tensor]      # engine module name → (in_features,) largest |input| per channel
    kv: list[tuple[float, float]]        # per layer: largest |key|, largest |value|


@torch.inference_mode()
def calibrate(model: PretrainedModel, sequences: list[list[int]], quiet: bool = False) -> CalibrationStats:
    float_config = dataclasses.replace(model.config, quantization=QuantConfig())
    device = next(iter(model.weights.values())).device
    max_len = max(len(s) for s in sequences)
    net = model.network_class.load(float_config, model.engine_weights(), max_len, device, ops=ReferenceOps())
    inputs: dict[str, torch.Tensor] = {}

    def keep(name, peak):
        inputs[name] = torch.maximum(inputs[name], peak) if name in inputs else peak

    def record(name):
        def hook(_module, args):
            keep(name, args[0].detach().float().abs().amax(dim=0))
        return hook

    def record_experts(name):                   # layers.3.moe → layers.3.moe.gate_up_proj, layers.3.moe.down_proj
        def hook(module, args):
            for projection, peak in input_peaks(module, args[0].detach()).items():
                keep(f"{name}.{projection.removeprefix('moe.')}", peak)
        return hook

    for name, module in net.named_modules():
        if type(module).__name__ == "Linear":
            module.register_forward_pre_hook(record(name))
        elif isinstance(module, MoE):
            module.register_forward_pre_hook(record_experts(name))
    c = float_config
    blocks = -(-max_len // 16)
    caches = [torch.zeros((2, blocks, 16, c.num_key_value_heads, c.head_dim), dtype=getattr(torch, c.dtype),
                          device=device) for _ in range(c.num_hidden_layers)]
    kv = [(0.0, 0.0)] * c.num_hidden_layers
    for seq in progress(sequences, "Calibrating", quiet=quiet):
        n = len(seq)
        t = lambda values: torch.tensor(values, device=device)  # noqa: E731
        meta = AttentionMetadata(t(list(range(n))), t([0, n]), t([n]), t([list(range(-(-n // 16)))]), n, n, 16)
        net.compute_logits(net(t(seq), t(list(range(n))), meta, caches))
        kv = [(max(k, float(cache[0].abs().max())), max(v, float(cache[1].abs().max())))
              for (k, v), cache in zip(kv, caches)]
        for cache in caches:
            cache.zero_()
    return CalibrationStats(inputs, kv)


# (fused engine module, its checkpoint parts, the norm before it that can absorb SmoothQuant factors)
def _linear_groups(config) -> list[tuple[str, list[str], str | None]]:
    groups = []
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        groups += [(p + "attn.qkv_proj", [p + "attn.q_proj", p + "attn.k_proj", p + "attn.v_proj"], p + "input_norm"),
                   (p + "attn.o_proj", [p + "attn.o_proj"], None)]
        if not config.is_moe:
            groups += [(p + "mlp.gate_up_proj", [p + "mlp.gate_proj", p + "mlp.up_proj"], p + "post_attn_norm"),
                       (p + "mlp.down_proj", [p + "mlp.down_proj"], None)]
    if not config.tie_word_embeddings:
        groups.append(("lm_head", ["lm_head"], None))
    return groups


def quantize_model(model: PretrainedModel, quant_config: QuantConfig, calib_size: int = 16,
                   quiet: bool = False, round_to_nearest: bool = False) -> PretrainedModel:
    """A copy of `model` with its weights (and KV-cache scales) quantized as `quant_config` says.
    `round_to_nearest` skips AWQ's and GPTQ's searches (same layout and scales format, worse accuracy): for
    random-weight benchmark models, where there is nothing to calibrate for."""
    if model.config.quantization.enabled:
        raise ValueError("the model is already quantized")
    if round_to_nearest and quant_config.learned_rounding_steps:
        raise ValueError("round_to_nearest skips the calibrated searches, learned rounding among them: set "
                         "learned_rounding_steps=0")
    config = dataclasses.replace(model.config, quantization=quant_config)     # validates (e.g. MoE)
    sequences = calibration_tokens(model, calib_size)
    algo = quant_config.quant_algo
    sequential = algo in SEQUENTIAL_ALGOS and not round_to_nearest
    stats = None
    if quant_config.needs_calibration and (quant_config.static_activations or not sequential):
        stats = calibrate(model, sequences, quiet)
    weights = dict(model.weights)
    layered: dict[str, dict] = {}
    kv = stats.kv if stats is not None else []
    if sequential:                      # AWQ rescales v_proj's rows: the cache scales follow the quantized layers
        layered, changed, kv = quantize_layers(model, quant_config, sequences, quiet)
        weights.update(_checkpoint_floats(config, weights, changed))
    for fused, parts, norm in _linear_groups(config):
        if fused in layered:
            _store_rows(weights, parts, layered[fused])
            if quant_config.static_activations:
                for part in parts:
                    weights[part + ".input_scale"] = _input_scale(stats.inputs[fused], FP8_MAX)
        elif quant_config.quantizes(fused):
            _quantize_group(weights, quant_config, algo, fused, parts, norm, stats)
    for fused, parts in _expert_groups(config):
        if quant_config.quantizes(fused):
            _quantize_experts(weights, quant_config, fused, parts, layered.get(fused), stats)
    if quant_config.kv_cache_quant_algo:
        limit = INT8_MAX if quant_config.kv_cache_quant_algo == "INT8" else FP8_MAX
        for i, (k, v) in enumerate(kv):
            weights[f"layers.{i}.attn.kv_scale"] = torch.tensor([max(k, 1e-6) / limit, max(v, 1e-6) / limit])
    return type(model)(config, weights, model.tokenizer_files, source="quantized model")


def _expert_groups(config) -> list[tuple[str, list[str]]]:
    """(engine expert projection, its checkpoint parts) of every MoE layer."""
    if not config.is_moe:
        return []
    parts = {"moe.gate_up_proj": ["moe.gate_proj", "moe.up_proj"], "moe.down_proj": ["moe.down_proj"]}
    return [(f"layers.{i}.{name}", [f"layers.{i}.{part}" for part in parts[name]])
            for i in range(config.num_hidden_layers) for name in EXPERT_PROJECTIONS]


def _store_rows(weights, parts: list[str], tensors: dict[str, torch.Tensor], sizes: list[int] | None = None,
                dim: int = 0) -> None:
    """A fused module's quantized tensors (one row per output along `dim`), split by rows into its checkpoint parts
    (of `sizes` rows; by default their weights'); int4 levels packed two to a byte."""
    sizes = sizes or [weights[p + ".weight"].shape[0] for p in parts]
    for name, tensor in tensors.items():
        for part, rows in zip(parts, tensor.split(sizes, dim=dim)):
            rows = rows.contiguous()
            if rows.dtype == torch.uint8:
                rows = quant.pack_int4(rows.flatten(0, -2)).view(*rows.shape[:-1], -1)
            weights[f"{part}.{name}"] = rows


def _quantize_experts(weights, quant_config: QuantConfig, fused: str, parts: list[str], calibrated: dict | None,
                      stats: CalibrationStats | None) -> None:
    """An MoE layer's stacked experts (checkpoint layout, (E, out, in) per part) replaced by their quantized tensors,
    each with a leading expert dimension: the layer-by-layer results where there are some, else each expert's
    matrices rounded to nearest; with static activations one input scale for all experts."""
    if calibrated is not None:
        _store_rows(weights, parts, calibrated, [weights[p].shape[1] for p in parts], dim=1)
    for part in parts:
        stacked = weights.pop(part)
        if calibrated is None:
            weights.update({f"{part}.{name}": t for name, t in round_experts(stacked, quant_config).items()})
        if quant_config.static_activations:
            weights[part + ".input_scale"] = _input_scale(stats.inputs[fused], FP8_MAX)


def _input_scale(x_max: torch.Tensor, limit: float) -> torch.Tensor:
    """A static per-tensor activation scale from the calibrated largest |input| per channel."""
    return torch.tensor([max(float(x_max.max()), 1e-6) / limit])


def _checkpoint_floats(config, weights, changed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Engine-layout float weights (norms, biases; fused q/k/v and gate/up biases split) → checkpoint ones."""
    out = {}
    for fused, parts, _ in _linear_groups(config):
        bias = changed.pop(fused + ".bias", None)
        if bias is not None:
            sizes = [weights[p + ".bias"].shape[0] for p in parts]
            out.update({p + ".bias": b.contiguous() for p, b in zip(parts, bias.split(sizes))})
    out.update(changed)
    return {name: value.to(weights[name].dtype) for name, value in out.items()}


def _quantize_group(weights, quant_config: QuantConfig, algo: str, fused: str, parts: list[str], norm: str | None,
                    stats: CalibrationStats | None) -> None:
    mats = [weights.pop(p + ".weight").float() for p in parts]
    smoother = None
    if algo.startswith("W8A8"):                           # SmoothQuant: move activation outliers into the weights
        x_max = stats.inputs[fused].to(mats[0].device).clamp_min(1e-5)
        w_max = torch.stack([m.abs().amax(dim=0) for m in mats]).amax(dim=0).clamp_min(1e-5)
        alpha = quant_config.smoothquant_val
        smoother = (x_max.pow(alpha) / w_max.pow(1 - alpha)).clamp(1e-4, 1e4)
        mats = [m * smoother for m in mats]               # x W^T == (x / s) (W s)^T
        if norm is not None:                               # the norm feeding these layers absorbs 1/s
            weight = weights[norm + ".weight"]
            weights[norm + ".weight"] = (weight.float() / smoother).to(weight.dtype)
    input_scale = None
    if quant_config.static_activations:
        x_max = stats.inputs[fused].to(mats[0].device)
        if smoother is not None:
            x_max = x_max / smoother
        input_scale = _input_scale(x_max, INT8_MAX if algo.startswith("W8A8") else FP8_MAX)
    for part, mat in zip(parts, mats):
        weights.update({f"{part}.{name}": t for name, t in _quantize_matrix(mat, algo, quant_config).items()})
        if input_scale is not None:                        # one tensor per part: safetensors refuses shared memory
            weights[part + ".input_scale"] = input_scale.clone()
        if smoother is not None and norm is None:          # not absorbed: divided at run time
            weights[part + ".smoother"] = smoother.clone()


def _quantize_matrix(w: torch.Tensor, algo: str, quant_config: QuantConfig) -> dict[str, torch.Tensor]:
    """The format's tensors (weight, weight_scale[, weight_zero]) of w rounded to nearest."""
    if algo == "W8A16" or algo.startswith("W8A8"):
        q, scale = quant.quantize_int8(w)
        return {"weight": q, "weight_scale": scale}
    if algo.startswith("W4A16"):
        group = quant_config.group_size if algo in GROUP_ALGOS else None
        packed, scale, zero = quant.quantize_int4(w, group, quant_config.has_zero_point)
        return {"weight": packed, "weight_scale": scale, **({"weight_zero": zero} if zero is not None else {})}
    q, scale = quant.quantize_fp8(w)
    return {"weight": q, "weight_scale": scale}


def round_experts(stacked: torch.Tensor, quant_config: QuantConfig) -> dict[str, torch.Tensor]:
    """Stacked experts (E, out, in) rounded to nearest in quant_config's format: each of its tensors with a leading
    expert dimension (no input_scale)."""
    per_expert = [_quantize_matrix(w.float(), quant_config.quant_algo, quant_config) for w in stacked]
    return {name: torch.stack([t[name] for t in per_expert]) for name in per_expert[0]}
