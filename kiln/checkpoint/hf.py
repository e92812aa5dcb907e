"""Hugging Face model directories → PretrainedConfig and tensors in the Kiln checkpoint layout."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterator

import torch

from kiln.config import PretrainedConfig
from kiln.config.pretrained import check_architecture

from .hf_tensors import HFTensor, hf_units, unit_specs, convert_unit
from .lazy import LazyWeights
from .prequantized import quant_config_from_hf
from .safetensors_file import TensorReader

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def is_hf_dir(path: Path) -> bool:
    if not (path / "config.json").is_file():
        return False
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return "architectures" in raw or "model_type" in raw


def read_hf_config(model_dir: str | Path, dtype: str = "auto") -> PretrainedConfig:
    """Map an HF config.json (transformers 4 or 5 style) onto a PretrainedConfig."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot read the model config: {err}") from None
    return config_from_hf_dict(raw, dtype, path)


def config_from_hf_dict(raw: dict, dtype: str = "auto", path: Path | str = "config") -> PretrainedConfig:
    """PretrainedConfig from the dict of an HF config (config.json, or a transformers config's to_dict())."""
    path = Path(path)
    architecture = (raw.get("architectures") or [None])[0]
    check_architecture(architecture)
    moe = ("num_local_experts", "num_experts_per_tok") if architecture == "MixtralForCausalLM" else ()
    missing = [key for key in _REQUIRED + moe if key not in raw]
    if missing:
        raise ValueError(f"{path}: the model config lacks {missing[0]!r}")
    if dtype == "auto":
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    rotary_base, rope_scaling = _rope(raw, path)
    fields: dict[str, Any] = dict(
        architecture=architecture, dtype=dtype, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads"), head_dim=raw.get("head_dim"),
        intermediate_size=raw["intermediate_size"], hidden_act=raw.get("hidden_act", "silu"),
        norm_epsilon=raw.get("rms_norm_eps", 1e-6), rotary_base=rotary_base, rope_scaling=rope_scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)))
    if architecture == "LlamaForCausalLM":
        fields.update(attention_bias=bool(raw.get("attention_bias")), dense_bias=bool(raw.get("attention_bias")),
                      mlp_bias=bool(raw.get("mlp_bias")))
    elif architecture == "Qwen2ForCausalLM":
        fields.update(attention_bias=True)
        if raw.get("use_sliding_window"):
            raise ValueError(f"{path}: Qwen2 use_sliding_window=true is not supported by Kiln")
    else:  # Mistral, Mixtral
        fields.update(sliding_window=raw.get("sliding_window"))
    if architecture == "MixtralForCausalLM":
        fields.update(moe_num_experts=raw["num_local_experts"], moe_top_k=raw["num_experts_per_tok"], moe_renorm_mode=1)
    quantization = quant_config_from_hf(raw)
    if quantization is not None:
        fields.update(quantization=quantization, dtype="float16" if fields["dtype"] == "float32" else fields["dtype"])
    return PretrainedConfig(**fields)


def _rope(raw: dict, path: Path) -> tuple[float, dict | None]:
    params = dict(raw.get("rope_parameters") or {})   # transformers 5
    scaling = raw.get("rope_scaling") or params          # transformers 4 keeps scaling separately
    base = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return base, None
    keep = {"linear": ["factor"],
            "llama3": ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]}
    if kind not in keep:
        raise ValueError(f"{path}: rope scaling type {kind!r} is not supported; supported: default, linear, llama3")
    return base, {"type": kind, **{k: scaling[k] for k in keep[kind] if k in scaling}}


def weight_files(model_dir: str | Path) -> list[Path]:
    """The weight files of an HF directory: safetensors preferred, sharded or not, else PyTorch .bin."""
    model_dir = Path(model_dir)
    for index_name, pattern in (("model.safetensors.index.json", "*.safetensors"),
                                ("pytorch_model.bin.index.json", "*.bin")):
        index = model_dir / index_name
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError) as err:
                raise ValueError(f"{index}: corrupt shard index: {err}") from None
            files = [model_dir / n for n in names]
            for f in files:
                if not f.is_file():
                    raise FileNotFoundError(f"{index} names shard {f.name!r}, which does not exist")
            return files
        files = sorted(p for p in model_dir.glob(pattern) if not p.name.startswith("training_args"))
        if files:
            return files
    raise FileNotFoundError(f"no model weights (*.safetensors or *.bin) in {str(model_dir)!r}")


def iter_file_tensors(path: Path, wanted=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one weights file (only names `wanted(name)` accepts, the others are never read), each read
    into its own buffer; a truncated or corrupt file is a ValueError naming it."""
    wanted = wanted or (lambda name: True)
    if path.suffix == ".safetensors":
        with TensorReader(path) as f:
            for name in f.keys():
                if wanted(name):
                    yield name, f.read(name)
    else:
        yield from ((name, tensor) for name, tensor in _torch_file_tensors(path).items() if wanted(name))


def _torch_file_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a PyTorch .bin file, never unpickling anything but tensors (weights_only): memory-mapped
    when it is a zip archive (torch >= 1.6), read whole when it is the legacy format, which cannot be mapped."""
    import zipfile

    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as err:  # torch raises several types for a damaged zip/pickle
        raise ValueError(f"{path}: corrupt or truncated PyTorch weights file, or one holding more than tensors "
                         f"({err})") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ValueError(f"{path}: a PyTorch file that is not a state dict (a dict of tensors by name) but a "
                         f"{type(state).__name__}; save the model's state_dict() instead")
    return state


def hf_weights(model_dir: str | Path, config: PretrainedConfig, wanted=None) -> LazyWeights:
    """The tensors of an HF directory in the Kiln layout, cast to config.dtype, each unit read (a tensor at a time,
    only the HF names `wanted(name)` accepts) when it is used. Safetensors headers give every shape before anything
    is read; PyTorch .bin files are opened once (memory-mapped where they can be)."""
    wanted = wanted or (lambda name: True)
    tensors, states = {}, {}
    for path in weight_files(model_dir):
        if path.suffix == ".safetensors":
            with TensorReader(path) as f:
                tensors.update({n: HFTensor(f.spec(n)[0], path) for n in f.keys() if wanted(n)})
        else:
            states[path] = _torch_file_tensors(path)
            tensors.update({n: HFTensor(tuple(t.shape), path) for n, t in states[path].items() if wanted(n)})

    def read(names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        files: dict[Path, set[str]] = {}
        for name in names:
            files.setdefault(tensors[name].path, set()).add(name)
        for path, in_file in files.items():
            if path in states:
                yield from ((n, states[path][n]) for n in in_file)
            else:
                yield from iter_file_tensors(path, in_file.__contains__)

    return lazy_hf_weights(tensors, config, read, str(model_dir))


def state_dict_weights(state: dict[str, torch.Tensor], config: PretrainedConfig, source: str) -> LazyWeights:
    """An in-memory state dict with HF names (a transformers model's) in the Kiln layout."""
    tensors = {name: HFTensor(tuple(t.shape), source) for name, t in state.items()}
    return lazy_hf_weights(tensors, config, lambda names: ((n, state[n]) for n in names), source)


def lazy_hf_weights(tensors: dict[str, HFTensor], config: PretrainedConfig, read, source: str) -> LazyWeights:
    """LazyWeights over HF tensors whose names and shapes are known; `read(hf_names)` yields (name, tensor)."""
    units = hf_units(tensors, config)
    specs = {name: spec for unit in units for name, spec in unit_specs(unit, tensors, config).items()}
    by_first = {unit.outputs[0]: unit for unit in units}
    paths = {name: info.path for name, info in tensors.items()}

    def make(outputs: list[str]) -> dict[str, torch.Tensor]:
        unit = by_first[outputs[0]]
        return convert_unit(unit, read(unit.inputs), paths, config)

    return LazyWeights(specs, [unit.outputs for unit in units], make, source)


def read_hf_rank_weights(model_dir: str | Path, config: PretrainedConfig, mapping) -> LazyWeights:
    """One rank's share of an HF directory (load_by_shard): tensors of other pipeline stages are never read, and
    each tensor is cut to this rank's part as soon as it is converted, so host memory holds one tensor (one
    layer's experts for MoE) beyond what the caller keeps."""
    from .sharding import local_dims, shard_view

    dims = local_dims(dataclasses.replace(config, mapping=mapping))
    layer = re.compile(r"(?:model\.)?layers\.(\d+)\.")
    keep_embedding = dims.first_stage or (config.tie_word_embeddings and dims.last_stage)

    def wanted(name: str) -> bool:
        if m := layer.match(name):
            return int(m[1]) in dims.layers
        if "embed_tokens" in name:
            return keep_embedding
        return dims.last_stage or not name.endswith(("lm_head.weight", "norm.weight"))

    return shard_view(config, hf_weights(model_dir, config, wanted), mapping)
