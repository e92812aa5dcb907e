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

from .layout import check_finite
from .prequantized import SUFFIXES, convert_layer, quant_config_from_hf

# HF name (after removing a leading "model.") → Kiln checkpoint name.
_NAME_RULES = [
    (re.compile(r"embed_tokens\.weight"), "embed_tokens.weight"),
    (re.compile(r"norm\.weight"), "norm.weight"),
    (re.compile(r"lm_head\.weight"), "lm_head.weight"),
    (re.compile(r"layers\.(\d+)\.self_attn\.([qkvo]_proj)\.(weight|bias)"), r"layers.\1.attn.\2.\3"),
    (re.compile(r"layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.(weight|bias)"), r"layers.\1.mlp.\2.\3"),
    (re.compile(r"layers\.(\d+)\.input_layernorm\.weight"), r"layers.\1.input_norm.weight"),
    (re.compile(r"layers\.(\d+)\.post_attention_layernorm\.weight"), r"layers.\1.post_attn_norm.weight"),
    (re.compile(r"layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight"), r"layers.\1.moe.router.weight"),
]
_EXPERT = re.compile(r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_FUSED_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    """(name, tensor) of one weights file (only names `wanted(name)` accepts, the others are never read);
    a truncated or corrupt file is a ValueError naming it."""
    wanted = wanted or (lambda name: True)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if wanted(name):
                        yield name, f.get_tensor(name)
        except SafetensorError as err:
            raise ValueError(f"{path}: corrupt or truncated safetensors file ({err})") from None
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


def read_hf_weights(model_dir: str | Path, config: PretrainedConfig, progress=None) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory, renamed to the Kiln layout and cast to config.dtype."""
    files = weight_files(model_dir)
    files = progress(files, "Loading weights") if progress else files
    return convert_hf_tensors(((name, tensor, path) for path in files for name, tensor in iter_file_tensors(path)),
                              config)


def read_hf_rank_weights(model_dir: str | Path, config: PretrainedConfig, mapping, progress=None):
    """One rank's share of an HF directory, read a tensor at a time (load_by_shard): tensors of other pipeline
    stages are never read, and each tensor is cut to this rank's part as soon as it is converted, so host memory
    holds this rank's weights plus one tensor (one layer's experts for MoE)."""
    from .sharding import local_dims, shard_weights

    dims = local_dims(dataclasses.replace(config, mapping=mapping))
    layer = re.compile(r"(?:model\.)?layers\.(\d+)\.")
    keep_embedding = dims.first_stage or (config.tie_word_embeddings and dims.last_stage)

    def wanted(name: str) -> bool:
        if m := layer.match(name):
            return int(m[1]) in dims.layers
        if "embed_tokens" in name:
            return keep_embedding
        return dims.last_stage or not name.endswith(("lm_head.weight", "norm.weight"))

    def cut(name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        return shard_weights(config, {name: tensor}, mapping)[1].get(name)

    files = weight_files(model_dir)
    files = progress(files, "Loading weights") if progress else files
    return convert_hf_tensors(((n, t, p) for p in files for n, t in iter_file_tensors(p, wanted)), config, cut)


def convert_hf_tensors(tensors, config: PretrainedConfig, cut=None) -> dict[str, torch.Tensor]:
    """(HF name, tensor, source) triples → tensors in the Kiln layout, cast to config.dtype; `cut(name, tensor)`,
    when given, replaces each finished tensor by the part to keep (None: drop it)."""
    dtype = _DTYPES[config.dtype]
    weights: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    packed: dict[str, dict[str, torch.Tensor]] = {}       # AWQ/GPTQ layers: base name → their tensors
    for hf_name, tensor, path in tensors:
        name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
        if _IGNORED.fullmatch(name):
            continue
        base, _, suffix = name.rpartition(".")
        if suffix in SUFFIXES and config.quantization.quant_algo:
            check_finite(hf_name, tensor, path)
            packed.setdefault(_rename(base + ".weight", hf_name, path)[:-len(".weight")], {})[suffix] = tensor
            continue
        tensor = tensor.to(dtype)
        check_finite(hf_name, tensor, path)       # after the cast: float32 values beyond float16's range are Inf
        if m := _EXPERT.fullmatch(name):
            key = (int(m[1]), _EXPERT_NAMES[m[3]])
            experts.setdefault(key, {})[int(m[2])] = tensor
            if len(experts[key]) == config.moe_num_experts:        # the layer's experts are complete: stack them
                per_expert = experts.pop(key)
                _keep(weights, f"layers.{key[0]}.moe.{key[1]}", torch.stack([per_expert[e] for e in sorted(per_expert)]),
                      cut)
        elif m := _FUSED_EXPERTS.fullmatch(name):
            for kiln_name, part in _split_fused_experts(int(m[1]), m[2], tensor).items():
                _keep(weights, kiln_name, part, cut)
        else:
            _keep(weights, _rename(name, hf_name, path), tensor, cut)
    for (layer, kind), per_expert in experts.items():
        _keep(weights, f"layers.{layer}.moe.{kind}", torch.stack([per_expert[e] for e in sorted(per_expert)]), cut)
    for base, layer in packed.items():
        for k, v in convert_layer(layer, config.quantization).items():
            _keep(weights, f"{base}.{k}", v, cut)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights


def _keep(weights: dict, name: str, tensor: torch.Tensor, cut) -> None:
    if cut is not None:
        tensor = cut(name, tensor)
    if tensor is not None:
        weights[name] = tensor


def _rename(name: str, hf_name: str, path: Path) -> str:
    for pattern, replacement in _NAME_RULES:
        if pattern.fullmatch(name):
            return pattern.sub(replacement, name)
    raise ValueError(f"{path}: unexpected tensor {hf_name!r} for this architecture")


def _split_fused_experts(layer: int, kind: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    if kind == "down_proj":
        return {f"layers.{layer}.moe.down_proj": tensor}
    gate, up = tensor.chunk(2, dim=1)   # (E, 2I, H): gate rows first
    return {f"layers.{layer}.moe.gate_proj": gate.contiguous(), f"layers.{layer}.moe.up_proj": up.contiguous()}
