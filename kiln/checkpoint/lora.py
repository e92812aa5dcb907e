"""Hugging Face PEFT LoRA adapters, read, checked against the base model and laid out for Kiln's engine.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` (or `adapter_model.bin`, read
with weights_only). Each target projection p gets A (r, in) and B (out, r); its output becomes
x·Wᵀ + scale·(x·Aᵀ)·Bᵀ with scale = lora_alpha / r (rsLoRA: lora_alpha / √r). The engine fuses q/k/v into
qkv_proj and gate/up into gate_up_proj, so each target keeps its own A and B and the rows of the fused output it
writes (`LoraPart.offset`): an adapter on q alone adds nothing to the k/v rows. Tensor parallelism cuts A and B as
their base layer is cut (checkpoint/sharding.py::shard_lora).

Whatever the engine cannot apply is refused, never ignored: a missing file, a tensor whose shape does not fit the
base model (named, with both shapes), a rank over the engine's max_lora_rank, a projection outside the seven (or
outside the engine's lora_target_modules), MoE experts, and PEFT features that change the product (DoRA, biases,
modules_to_save, per-module alphas, ...).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.config import LORA_TARGET_MODULES, PretrainedConfig

from .hf import iter_file_tensors
from .sharding import local_dims, shard_lora

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
# target projection → the engine layer it is part of, and its block in Hugging Face names
ENGINE_MODULE = {"q_proj": "attn.qkv_proj", "k_proj": "attn.qkv_proj", "v_proj": "attn.qkv_proj",
                  "o_proj": "attn.o_proj", "gate_proj": "mlp.gate_up_proj", "up_proj": "mlp.gate_up_proj",
                  "down_proj": "mlp.down_proj"}
HF_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# adapter_config.json keys that describe training or where the adapter came from: no effect on the product
_TRAINING_KEYS = {"base_model_name_or_path", "revision", "task_type", "inference_mode", "auto_mapping", "peft_version",
                  "lora_dropout", "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern",
                  "rank_pattern", "megatron_config", "megatron_core", "loftq_config", "eva_config", "corda_config",
                  "qalora_group_size", "ensure_weight_tying", "r", "lora_alpha", "use_rslora", "init_lora_weights"}
# initialisations that change the base model's weights too: the adapter alone is not the fine-tuned model
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")


class AdapterNotFound(FileNotFoundError, ValueError):
    """An adapter directory, or a file it needs, is missing (also a ValueError: a bad argument)."""


@dataclass
class LoraPart:
    """One target projection of an adapter in an engine layer: out[:, offset:offset + rows] += scale·(x·Aᵀ)·Bᵀ."""

    offset: int            # first output row of the engine layer this target writes
    a: torch.Tensor        # (r, in): this rank's share
    b: torch.Tensor        # (rows, r)
    scale: float
    layer: str             # the checkpoint layer it adapts (layers.3.attn.q_proj)


@dataclass
class LoraAdapter:
    """An adapter in the engine layout of one rank: engine layer name (layers.0.attn.qkv_proj) → its parts."""

    name: str
    rank: int
    modules: dict[str, list[LoraPart]]


def load_adapter(path: str | Path, config: PretrainedConfig, max_rank: int,
                 target_modules: tuple[str, ...] = LORA_TARGET_MODULES, name: str | None = None) -> LoraAdapter:
    """Read the PEFT adapter at `path`, check it against the base model of `config` (its unsharded shapes), the
    engine's `max_rank` and `target_modules`, and lay out `config.mapping.rank`'s share of it in `config.dtype`."""
    path = Path(path)
    where = f"LoRA adapter {name!r} ({path})" if name else f"LoRA adapter {path}"
    peft = _read_config(path, where)
    pairs = _read_pairs(_weights_file(path, where), where)
    check_pairs(pairs, peft, config, max_rank, target_modules, where)
    dtype, dims = getattr(torch, config.dtype), local_dims(config)
    modules: dict[str, list[LoraPart]] = {}
    for (layer, target), (a, b) in sorted(pairs.items()):
        rank = a.shape[0]
        scale = peft["lora_alpha"] / (math.sqrt(rank) if peft.get("use_rslora") else rank)
        block = "attn" if HF_BLOCK[target] == "self_attn" else "mlp"
        checkpoint_layer = f"layers.{layer}.{block}.{target}"
        shard = shard_lora(config, checkpoint_layer, a, b)
        if shard is None:                           # a layer of another pipeline stage
            continue
        a, b = (t.to(dtype) for t in shard)
        modules.setdefault(f"layers.{layer}.{ENGINE_MODULE[target]}", []).append(
            LoraPart(_row_offset(target, dims, config.head_dim), a, b, scale, checkpoint_layer))
    return LoraAdapter(name or path.name, max((a.shape[0] for a, _ in pairs.values()), default=0), modules)


def _read_config(path: Path, where: str) -> dict:
    if not path.is_dir():
        raise AdapterNotFound(f"{where}: no such directory")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterNotFound(f"{where}: {CONFIG_FILE} is missing (a Hugging Face PEFT adapter directory has it)")
    try:
        peft = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: {CONFIG_FILE} is not valid JSON ({err})") from None
    if not isinstance(peft, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} is not a JSON object")
    check_features(peft, where)
    return peft


def check_features(peft: dict, where: str) -> None:
    """Refuse what Kiln's product x·Wᵀ + scale·(x·Aᵀ)·Bᵀ would not apply: another PEFT method, DoRA, biases, modules
    saved whole, per-module alphas, initialisations that changed the base weights, and any option Kiln does not
    know that is switched on."""
    if peft.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type={peft.get('peft_type')!r}; Kiln serves LoRA adapters only")
    for key in ("r", "lora_alpha"):
        if not isinstance(peft.get(key), (int, float)) or isinstance(peft.get(key), bool) or peft[key] <= 0:
            raise ValueError(f"{where}: {CONFIG_FILE} needs a positive {key}, got {peft.get(key)!r}")
    init = peft.get("init_lora_weights")
    if isinstance(init, str) and init.startswith(_BASE_CHANGING_INITS):
        raise ValueError(f"{where}: init_lora_weights={init!r} also changes the base model's weights, which Kiln "
                         "serves unchanged; convert the adapter to a plain LoRA (PEFT's "
                         "path_initial_model_for_weight_conversion) first")
    if peft.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={peft['bias']!r} trains biases of the base model; Kiln supports "
                         "bias='none' only")
    for key, value in peft.items():
        if key in _TRAINING_KEYS or key in ("peft_type", "bias") or value in (None, False, [], {}, ""):
            continue
        what = {"use_dora": "DoRA (weight-decomposed LoRA)", "modules_to_save": "modules saved whole",
                "alpha_pattern": "per-module lora_alpha", "lora_bias": "a bias on lora_B",
                "fan_in_fan_out": "Conv1D weights (GPT-2)", "target_parameters": "LoRA on parameters (MoE experts)",
                "layer_replication": "replicated layers"}.get(key, "a PEFT feature Kiln does not implement")
        raise ValueError(f"{where}: {CONFIG_FILE} sets {key}={value!r} ({what}); Kiln refuses the adapter rather "
                         "than serve it without")
    targets = peft.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t.rpartition(".")[2] not in LORA_TARGET_MODULES]
        if unknown:
            raise ValueError(f"{where}: target_modules {unknown} are not LoRA targets Kiln serves (any of "
                             f"{', '.join(LORA_TARGET_MODULES)})")


def adapter_files(path: str | Path) -> list[Path]:
    """The files of the adapter directory `path` that Kiln reads (its config and weights), to store it elsewhere."""
    path = Path(path)
    _read_config(path, f"LoRA adapter {path}")
    return [path / CONFIG_FILE, _weights_file(path, f"LoRA adapter {path}")]


def _weights_file(path: Path, where: str) -> Path:
    for file in WEIGHT_FILES:
        if (path / file).is_file():
            return path / file
    raise AdapterNotFound(f"{where}: no weights ({' or '.join(WEIGHT_FILES)})")


def _read_pairs(file: Path, where: str) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, target projection) → (A, B) of the adapter's weights file; any other tensor is refused."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in iter_file_tensors(file):
        match = _KEY.match(key)
        if match is None or match.group(3) not in LORA_TARGET_MODULES or match.group(2) != HF_BLOCK[match.group(3)]:
            raise ValueError(f"{where}: tensor {key!r} {_unknown_target(key)}")
        if tensor.dim() != 2:
            raise ValueError(f"{where}: tensor {key!r} has shape {tuple(tensor.shape)}; a LoRA matrix has two "
                             "dimensions")
        halves.setdefault((int(match.group(1)), match.group(3)), {})[match.group(4)] = tensor
    pairs = {}
    for (layer, target), half in halves.items():
        missing = {"A", "B"} - set(half)
        if missing:
            raise ValueError(f"{where}: layer {layer} {target} has no lora_{missing.pop()} tensor")
        pairs[(layer, target)] = (half["A"], half["B"])
    if not pairs:
        raise ValueError(f"{where}: {file.name} holds no LoRA weights")
    return pairs


def _unknown_target(key: str) -> str:
    if ".experts." in key or ".block_sparse_moe." in key or ".mlp.gate." in key:
        return "is on a mixture-of-experts layer (experts or router); Kiln serves LoRA on attention and dense MLPs only"
    if "lora_magnitude_vector" in key:
        return "is a DoRA magnitude; Kiln does not serve DoRA adapters"
    return f"is not a LoRA weight of a projection Kiln serves (any of {', '.join(LORA_TARGET_MODULES)})"


def base_shape(target: str, config: PretrainedConfig) -> tuple[int, int]:
    """(out, in) of the unsharded base projection `target`."""
    h, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim
    i = config.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}[target]


def check_pairs(pairs: dict, peft: dict, config: PretrainedConfig, max_rank: int, target_modules: tuple[str, ...],
                where: str) -> None:
    """Every pair fits the base model's layer and the engine's limits; a ValueError names the tensor otherwise."""
    for (layer, target), (a, b) in sorted(pairs.items()):
        key = f"layers.{layer}.{HF_BLOCK[target]}.{target}"
        if layer >= config.num_hidden_layers:
            raise ValueError(f"{where}: {key} is past the base model's {config.num_hidden_layers} layers")
        if config.is_moe and HF_BLOCK[target] == "mlp":
            raise ValueError(f"{where}: {key}: the base model's MLP is a mixture of experts; Kiln serves LoRA on "
                             "its attention projections only")
        if target not in target_modules:
            raise ValueError(f"{where}: it targets {target}, which the engine's lora_target_modules "
                             f"({', '.join(target_modules)}) leave out; rebuild the engine with it")
        out, inp = base_shape(target, config)
        rank = a.shape[0]
        if rank > max_rank:
            raise ValueError(f"{where}: {key} has rank {rank}, over the engine's max_lora_rank={max_rank}; rebuild "
                             f"the engine with max_lora_rank >= {rank}")
        for half, tensor, want in (("A", a, (rank, inp)), ("B", b, (out, rank))):
            if tuple(tensor.shape) != want:
                raise ValueError(f"{where}: tensor {key}.lora_{half}.weight has shape {tuple(tensor.shape)}, but the "
                                 f"base model's {target} is {(out, inp)} (out, in), so it needs {want}: the adapter "
                                 "was trained on another model")


def _row_offset(target: str, dims, head_dim: int) -> int:
    """The first row this rank's part of `target` has in the engine's fused layer output."""
    return {"k_proj": dims.heads * head_dim, "v_proj": (dims.heads + dims.kv_heads) * head_dim,
            "up_proj": dims.intermediate}.get(target, 0)


def layer_geometry(module: str, config: PretrainedConfig) -> tuple[int, tuple[int, ...]]:
    """(input features, first output row of each target projection and the end) of the engine layer `module`
    (layers.3.attn.qkv_proj) on `config.mapping.rank`: the shape the stacked adapter slots of that layer take."""
    dims, hd = local_dims(config), config.head_dim
    q, kv, inter = dims.heads * hd, dims.kv_heads * hd, dims.intermediate
    kind = module.rpartition(".")[2]
    geometry = {"qkv_proj": (config.hidden_size, (0, q, q + kv, q + 2 * kv)), "o_proj": (q, (0, config.hidden_size)),
                "gate_up_proj": (config.hidden_size, (0, inter, 2 * inter)),
                "down_proj": (inter, (0, config.hidden_size))}
    if kind not in geometry:
        raise ValueError(f"{module} is not a layer LoRA adapters target")
    return geometry[kind]

