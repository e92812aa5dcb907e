"""Converting a model into a Kiln checkpoint: load (kiln.models) → quantize (kiln.quantization) → save.

    model = convert("path/to/hf", "bfloat16", quant_config=QuantConfig("W4A16_AWQ", group_size=128))
    model.save_checkpoint("ckpt/")
    convert_checkpoint("path/to/hf", "ckpt/", convert_config=ConvertConfig(tp_size=2))   # what `kiln convert` does

Loading meets quantization here, above both, so that neither imports the other.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch

from kiln.checkpoint import save_checkpoint
from kiln.checkpoint.layout import SPARSE_TARGETS
from kiln.checkpoint.lazy import LazyWeights, with_progress
from kiln.checkpoint.lora import load_adapter
from kiln.config import ConvertConfig, Mapping, PretrainedConfig, QuantConfig
from kiln.kernels.sparse import prune_2_4
from kiln.models import LlamaForCausalLM, PretrainedModel
from kiln.quantization import quantize_model, quantized_weights
from kiln.utils.steps import StepLog


def quantize(model: PretrainedModel, quant_config: QuantConfig | None, calib_size: int = 16,
             quiet: bool = False, round_to_nearest: bool = False) -> PretrainedModel:
    """`model` quantized as `quant_config` asks, calibrated on calib_size sequences of Kiln's calibration text
    (round_to_nearest: without AWQ's and GPTQ's searches); the model itself when it asks for nothing."""
    if quant_config is None or not quant_config.enabled:
        return model
    return quantize_model(model, quant_config, calib_size, quiet, round_to_nearest)


def convert(model_dir, dtype: str = "auto", convert_config: ConvertConfig | None = None,
            quant_config: QuantConfig | None = None, calib_size: int | None = None, seed: int = 0,
            quiet: bool = False) -> PretrainedModel:
    """The whole model of an HF directory, GGUF file or in-memory transformers model, loaded and quantized as
    `quant_config` asks (calibrated on calib_size sequences, 16 by default), or as `convert_config`'s flags and
    calib_size ask; `convert_config`'s shape fields are checked against the model before its weights are read and
    its parallel fields are set. Without a model_dir: random weights (of `seed`) of the shape convert_config
    describes, quantized the same way."""
    if convert_config is not None:
        if quant_config is not None or calib_size is not None:
            raise ValueError("convert_config carries the quantization flags and calib_size: give it, or "
                             "quant_config and calib_size, not both")
        quant_config, calib_size = convert_config.quant_config(), convert_config.calib_size
    model = _load(model_dir, dtype, convert_config, seed, quiet, lazy=False)
    if convert_config is not None and convert_config.merge_lora:
        model = merge_lora(model, convert_config.merge_lora)
    if convert_config is not None and convert_config.prune_2_4:
        model = prune_2_4_model(model)
    return quantize(model, quant_config, 16 if calib_size is None else calib_size, quiet,
                    _round_to_nearest(convert_config))


def _load(model_dir, dtype: str, convert_config: ConvertConfig | None, seed: int, quiet: bool,
          lazy: bool) -> PretrainedModel:
    """The model of model_dir, or random weights of convert_config's shape; with lazy=True read (or drawn) as each
    tensor is used."""
    if model_dir is None:
        if convert_config is None:
            raise ValueError("without a model directory, a convert_config must describe the model's shape")
        config = _preparation(convert_config, "the random-weight model")(convert_config.random_model_config(dtype))
        return LlamaForCausalLM.random(config, seed=seed, lazy=lazy)
    return LlamaForCausalLM.from_hugging_face(model_dir, dtype, quiet=quiet, lazy=lazy,
                                              prepare_config=_preparation(convert_config, model_dir))


def _round_to_nearest(convert_config: ConvertConfig | None) -> bool:
    return convert_config is not None and convert_config.round_to_nearest


def rank_reader(model_dir, dtype: str, convert_config: ConvertConfig, quiet: bool = False, lazy: bool = False
                ) -> Callable[[int], PretrainedModel]:
    """rank → that rank's share of an HF directory under convert_config's tp_size × pp_size, read a tensor at a
    time (load_by_shard: only that rank's tensors are read; ConvertConfig refuses quantizing with it, which needs
    the whole model); with lazy=True each tensor is read when it is used."""
    mapping = _mapping(convert_config)

    def rank_model(rank: int) -> PretrainedModel:
        model = LlamaForCausalLM.from_hugging_face(model_dir, dtype, mapping.for_rank(rank), quiet=quiet or rank > 0,
                                                   prepare_config=_preparation(convert_config, model_dir), lazy=lazy)
        return prune_2_4_model(model) if convert_config.prune_2_4 else model

    return rank_model


def convert_checkpoint(model_dir, output_dir: str | Path, dtype: str = "auto",
                       convert_config: ConvertConfig | None = None, seed: int = 0, overwrite: bool = False,
                       quiet: bool = False) -> Path:
    """Load → quantize → save, a layer at a time: a Kiln checkpoint of convert_config's tp_size × pp_size ranks.
    Each tensor is read (a tensor at a time, into its own buffer), quantized (a layer at a time, on the GPU when
    there is one), cut into the ranks' parts and written into every rank file before the next is read, so host
    memory holds about one layer (plus calibration activations). With load_by_shard each rank is read on its own
    from the HF directory, `workers` ranks at a time. An existing output_dir is replaced only when it is empty or a
    checkpoint, or with overwrite=True."""
    convert_config = convert_config or ConvertConfig()
    mapping = _mapping(convert_config)
    log = StepLog("Convert", 2, quiet)
    config_only, workers = convert_config.save_config_only, convert_config.workers
    if convert_config.load_by_shard and mapping.world_size > 1 and model_dir is not None:
        rank_model = rank_reader(model_dir, dtype, convert_config, quiet, lazy=True)
        with log.step("Index the model's weights"):
            first = rank_model(0)
        with log.step(f"Read and write the {mapping.world_size} ranks, each read on its own"):
            ranks = {0: first.weights, **{r: (lambda r=r: rank_model(r).weights) for r in range(1, mapping.world_size)}}
            path = save_checkpoint(output_dir, first.config, ranks, first.tokenizer_files, config_only=config_only,
                                   workers=workers, overwrite=overwrite)
        log.done()
        return path
    calibrated = " and calibrate" if convert_config.quant_config().needs_calibration else ""
    with log.step(f"Index the model's weights{calibrated}"):
        model = _load(model_dir, dtype, convert_config, seed, quiet, lazy=True)
        if convert_config.merge_lora:
            model = merge_lora(model, convert_config.merge_lora)
        if convert_config.prune_2_4:
            model = prune_2_4_model(model)
        model = _quantized_lazily(model, convert_config, quiet)
    with log.step(f"Convert and write {mapping.world_size} rank file(s), a layer at a time"):
        model = type(model)(model.config, with_progress(model.weights, "Writing", quiet), model.tokenizer_files)
        path = model.save_checkpoint(output_dir, config_only, mapping, workers, overwrite)
    log.done()
    return path


def prune_2_4_model(model: PretrainedModel) -> PretrainedModel:
    """The model with its decoder projections magnitude-pruned to 2:4 sparsity (layout.SPARSE_TARGETS), each weight
    as it is made. A sharded model's ranks are pruned alike when each rank's share of an input dimension is a
    multiple of 4 (the groups of four are never cut)."""
    if model.config.quantization.quant_algo is not None:
        raise ValueError("2:4 pruning takes a float model; this one is quantized already (prune, then quantize)")
    return _transformed(model, lambda name, t: prune_2_4(t) if SPARSE_TARGETS.search(name) else t, "2:4-pruned model")


def _transformed(model: PretrainedModel, change: Callable[[str, torch.Tensor], torch.Tensor],
                 what: str) -> PretrainedModel:
    """The model with change(name, tensor) applied to each weight as it is made (lazy weights stay lazy)."""
    weights = model.weights
    if isinstance(weights, LazyWeights):
        weights = LazyWeights(weights.specs, weights.unit_names(),
                              lambda names: {n: change(n, t) for n, t in model.weights.iter_take(names)},
                              weights.source, weights.device)
    else:
        weights = {name: change(name, tensor) for name, tensor in weights.items()}
    return type(model)(model.config, weights, model.tokenizer_files, source=f"the {what}")


def merge_lora(model: PretrainedModel, adapter_dir) -> PretrainedModel:
    """The model with the Hugging Face PEFT adapter at adapter_dir merged into its weights: each target's rows of
    its engine layer become W + scale·B·A (in float32, then the weight's dtype), as each weight is made. The
    adapter is checked against the model first (kiln.checkpoint.lora: shapes, targets, PEFT features)."""
    config = dataclasses.replace(model.config, mapping=Mapping())
    adapter = load_adapter(adapter_dir, config, max_rank=1 << 20)
    deltas = {f"{part.layer}.weight": part for parts in adapter.modules.values() for part in parts}
    missing = sorted(set(deltas) - set(model.weights))
    if missing:
        raise ValueError(f"merge_lora {adapter_dir}: the model has no float weight {missing[0]} to merge into")

    def merged(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name not in deltas:
            return tensor
        part = deltas[name]
        out = tensor.float() + part.scale * (part.b.to(tensor.device).float() @ part.a.to(tensor.device).float())
        return out.to(tensor.dtype)

    return _transformed(model, merged, f"model merged with {adapter_dir}")


def _quantized_lazily(model: PretrainedModel, convert_config: ConvertConfig, quiet: bool) -> PretrainedModel:
    """The model quantized as convert_config asks, a layer at a time as its weights are used (on the GPU when
    there is one); the model itself when it asks for nothing."""
    quant_config = convert_config.quant_config()
    if not quant_config.enabled:
        return model
    device = "cuda" if torch.cuda.is_available() else None
    config, weights = quantized_weights(model, quant_config, convert_config.calib_size, quiet,
                                        convert_config.round_to_nearest, device)
    return type(model)(config, weights, model.tokenizer_files, source="quantized model")


def _mapping(convert_config: ConvertConfig) -> Mapping:
    return Mapping(convert_config.tp_size * convert_config.pp_size, 0, convert_config.tp_size, convert_config.pp_size)


def _preparation(convert_config: ConvertConfig | None, model_dir) -> Callable[[PretrainedConfig], PretrainedConfig]:
    """The config a model is loaded with under convert_config: its shape fields checked, its parallel fields set,
    its embedding sharing possible."""
    def prepare(config: PretrainedConfig) -> PretrainedConfig:
        if convert_config is None:
            return config
        convert_config.check_against(config, str(model_dir))
        if convert_config.use_embedding_sharing and not config.tie_word_embeddings:
            raise ValueError("--use_embedding_sharing needs a model whose LM head is tied to its embedding")
        return dataclasses.replace(config, **convert_config.parallel_fields())

    return prepare
