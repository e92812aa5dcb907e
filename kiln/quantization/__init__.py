"""Offline quantization of a model in the checkpoint layout: calibration, SmoothQuant, AWQ, GPTQ, weight packing.

    quantized = quantize_model(model, QuantConfig(quant_algo="W4A16_AWQ", group_size=128), calib_size=16)

Calibration (calibration.py) runs the float model (reference kernels) over Kiln's own calibration text
(kiln/data/calibration.txt, then Python's bundled documentation for more) a layer at a time and records, per linear
layer, each input channel's largest magnitude, and per layer the largest cached key and value. From those:
SmoothQuant factors, static activation scales and KV scales (groups.py). AWQ, GPTQ and the FP8 and int8 weights are
quantized layer by layer instead (sequential.py), which also measures the keys and values that the quantized layers
produce; round_to_nearest skips those searches. Everything runs a layer at a time, reading each layer's float
weights when it is reached (quantized_weights), on the GPU when asked.
"""
from __future__ import annotations

import dataclasses

import torch

from kiln.checkpoint.layout import checkpoint_shapes, tensor_dtypes
from kiln.checkpoint.lazy import LazyWeights, TensorSpec, iter_take, layer_of, layer_units, materialize, weights_device
from kiln.config import QuantConfig
from kiln.models.base import PretrainedModel

from .calibration import CALIBRATION_SEQ_LEN, CalibrationStats, calibrate, calibration_tokens
from .groups import FP8_MAX, INT8_MAX, LayerResults, UnitTensors, quantize_unit, round_experts
from .sequential import ALGOS as SEQUENTIAL_ALGOS, quantize_layers

__all__ = ["CALIBRATION_SEQ_LEN", "CalibrationStats", "FP8_MAX", "INT8_MAX", "calibrate", "calibration_tokens",
           "quantize_model", "quantized_weights", "round_experts"]


def quantize_model(model: PretrainedModel, quant_config: QuantConfig, calib_size: int = 16,
                   quiet: bool = False, round_to_nearest: bool = False, device=None) -> PretrainedModel:
    """A copy of `model` with its weights (and KV-cache scales) quantized as `quant_config` says (a dict of
    tensors; quantized_weights makes them a layer at a time instead). `round_to_nearest` skips AWQ's and GPTQ's
    searches (same layout and scales format, worse accuracy, seconds instead of minutes). Calibration and the
    layer-by-layer searches run on `device` (default: where the weights are)."""
    config, weights = quantized_weights(model, quant_config, calib_size, quiet, round_to_nearest, device)
    return type(model)(config, materialize(weights), model.tokenizer_files, source="quantized model")


def quantized_weights(model: PretrainedModel, quant_config: QuantConfig, calib_size: int = 16,
                      quiet: bool = False, round_to_nearest: bool = False, device=None):
    """(config, weights): `model` quantized as `quant_config` says, as LazyWeights made a layer at a time from the
    model's float weights (each layer's read when it is made: with a lazy model, host memory holds one layer).
    Calibration (static activation, SmoothQuant and KV-cache scales) runs now, a layer at a time; the
    layer-by-layer searches (AWQ, GPTQ, the FP8 and W8A16 roundings) run as the layers are made, which must then be
    once each, in order (as writing them does; materialize them to read them again)."""
    if model.config.quantization.enabled:
        raise ValueError("the model is already quantized")
    if round_to_nearest and quant_config.learned_rounding_steps:
        raise ValueError("round_to_nearest skips the calibrated searches, learned rounding among them: set "
                         "learned_rounding_steps=0")
    config = dataclasses.replace(model.config, quantization=quant_config)     # validates (e.g. MoE)
    device = torch.device(device) if device is not None else weights_device(model.weights)
    sequential = quant_config.quant_algo in SEQUENTIAL_ALGOS and not round_to_nearest
    calibrated = quant_config.needs_calibration and (quant_config.static_activations or not sequential)
    sequences = calibration_tokens(model, calib_size) if calibrated or sequential else None
    stats = calibrate(model, sequences, quiet, device) if calibrated else None
    layers = quantize_layers(model, quant_config, sequences, quiet, device) if sequential else None
    shapes = checkpoint_shapes(config)
    dtypes = tensor_dtypes(config, shapes)
    specs = {name: TensorSpec(shape, dtypes[name]) for name, shape in shapes.items()}
    sources = _source_units(model.weights)

    def make(names: list[str]) -> dict[str, torch.Tensor]:
        unit = _unit_of(names[0])
        results = _next_layer(layers, unit) if layers is not None and isinstance(unit, int) else None
        weights = quantize_unit(UnitTensors(fetch, sources[unit]), config, quant_config, unit, stats, results)
        return {name: weights[name] for name in names}

    def fetch(names: list[str]) -> dict[str, torch.Tensor]:
        return {name: t.to(device) for name, t in iter_take(model.weights, names)}

    return config, LazyWeights(specs, layer_units(specs), make, "quantized model", device)


def _unit_of(name: str):
    """A layer's index, or the module of a tensor outside the layers (embed_tokens, norm, lm_head)."""
    layer = layer_of(name)
    return layer if layer is not None else name.split(".")[0]


def _source_units(weights) -> dict:
    units: dict = {}
    for name in weights:
        units.setdefault(_unit_of(name), []).append(name)
    return units


def _next_layer(layers, index: int) -> LayerResults:
    """The layer-by-layer results of layer `index`, which must be the next one."""
    found, tensors, changed, kv = next(layers, (None, None, None, None))
    if found != index:
        raise ValueError(f"layer {index} asked of a layer-by-layer quantization that makes the layers once, in "
                         f"order (next: {found}); materialize its weights to read them again")
    return LayerResults(index, tensors, changed, kv)
