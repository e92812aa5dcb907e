"""PretrainedModel: a model's config and checkpoint-layout weights, with the load/save entry points."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from kiln.checkpoint import (LazyWeights, check_weights, is_hf_dir, load_checkpoint, materialize, read_source_config,
                             read_source_weights, save_checkpoint, source_weights)
from kiln.checkpoint.hf import config_from_hf_dict, state_dict_weights
from kiln.checkpoint.io import save_sharded_checkpoint
from kiln.config import Mapping, PretrainedConfig
from kiln.utils.steps import StepLog, progress


class PretrainedModel:
    """A model ready to be saved as a checkpoint or built into an engine.

    `weights` holds this rank's tensors in the checkpoint layout (kiln.checkpoint.layout): a dict, or LazyWeights
    (kiln.checkpoint.lazy) made a unit at a time when they are used (loaded with lazy=True: read from their files
    each time, never held); `tokenizer_files` the tokenizer files that travel with checkpoints and engines."""

    network_class: type = None  # the torch module that runs the engine layout

    def __init__(self, config: PretrainedConfig, weights: dict[str, torch.Tensor] | LazyWeights,
                 tokenizer_files: dict[str, bytes] | None = None, source: str = "model"):
        check_weights(weights, config, source)
        self.config = config
        self.weights = weights
        self.tokenizer_files = dict(tokenizer_files or {})

    @classmethod
    def from_hugging_face(cls, model_dir: str | Path, dtype: str = "auto", mapping: Mapping | None = None,
                          quiet: bool = False,
                          prepare_config: Callable[[PretrainedConfig], PretrainedConfig] | None = None,
                          lazy: bool = False):
        """Load an HF model directory (safetensors or .bin, sharded or not; or a Hugging Face model id, org/name,
        through the hub's cache), a GGUF file (dequantised), or an in-memory transformers model (its tensors are used as they are, on their device), as it is (kiln.convert
        loads and quantizes). Files are read a tensor at a time; with lazy=True nothing is read until a tensor is
        used (the names and shapes are checked now, each tensor when it is read). With a `mapping` of several
        ranks only that rank's share of an HF directory is read (load_by_shard). `prepare_config` is called with
        the model's config before any weight is read and returns the config to load with (kiln.convert checks a
        ConvertConfig's shape fields there and sets its parallel fields)."""
        from kiln.checkpoint import hub

        model_dir = hub.resolve(model_dir)                  # a Hugging Face model id → its cached snapshot
        prepare_config = prepare_config or (lambda config: config)
        if mapping is not None and mapping.world_size > 1:
            return cls._load_rank(model_dir, dtype, mapping, prepare_config, quiet, lazy)
        return cls._load_hugging_face(model_dir, dtype, prepare_config, quiet, lazy)

    @classmethod
    def _load_rank(cls, model_dir, dtype: str, mapping: Mapping, prepare_config, quiet: bool, lazy: bool):
        """Only `mapping.rank`'s share of an HF directory, read a tensor at a time (load_by_shard)."""
        import dataclasses

        from kiln.checkpoint import hf
        from kiln.tokenizer import read_tokenizer_files

        if hasattr(model_dir, "state_dict") or not (Path(model_dir).is_dir() and is_hf_dir(Path(model_dir))):
            raise ValueError(f"loading one rank's share (load_by_shard) needs a Hugging Face directory, got {model_dir!r}")
        config = prepare_config(read_source_config(model_dir, dtype))
        weights = hf.read_hf_rank_weights(model_dir, config, mapping)
        weights = weights if lazy else _read(weights, "Loading weights", quiet)
        return cls(dataclasses.replace(config, mapping=mapping), weights, read_tokenizer_files(Path(model_dir)),
                   source=f"{model_dir} (rank {mapping.rank})")

    @classmethod
    def _load_hugging_face(cls, model_dir, dtype: str, prepare_config, quiet: bool, lazy: bool):
        if hasattr(model_dir, "state_dict") and hasattr(model_dir, "config"):
            return cls._from_transformers_model(model_dir, dtype, prepare_config)
        log = StepLog("Load", 2, quiet)
        with log.step(f"Read the model config of {model_dir}"):
            config = prepare_config(read_source_config(model_dir, dtype))
        what = "Index" if lazy else "Load"
        with log.step(f"{what} {config.architecture} weights ({config.dtype}) into the Kiln layout"):
            if lazy:
                weights, tokenizer_files = source_weights(model_dir, config)
            else:
                weights, tokenizer_files = read_source_weights(
                    model_dir, config, lambda it, desc, total: progress(it, desc, total, quiet=quiet))
            model = cls(config, weights, tokenizer_files, source=str(model_dir))
        log.done()
        return model

    from_pretrained = from_hugging_face

    @classmethod
    def _from_transformers_model(cls, hf_model, dtype: str, prepare_config):
        raw = hf_model.config.to_dict()
        raw["architectures"] = raw.get("architectures") or [type(hf_model).__name__]
        if dtype == "auto":
            dtype = str(next(hf_model.parameters()).dtype).removeprefix("torch.")
        config = prepare_config(config_from_hf_dict(raw, dtype, f"{type(hf_model).__name__} config"))
        weights = materialize(state_dict_weights(hf_model.state_dict(), config, type(hf_model).__name__))
        return cls(config, weights, source=type(hf_model).__name__)

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path, rank: int = 0, verify: bool = True, lazy: bool = False):
        """Rank `rank` of a Kiln checkpoint, its files checked against their checksums (verify=False skips that);
        with lazy=True each tensor is read from the file when it is used."""
        config, weights, tokenizer_files = load_checkpoint(ckpt_dir, rank, verify, lazy)
        return cls(config, weights, tokenizer_files, source=str(ckpt_dir))

    @classmethod
    def random(cls, config: PretrainedConfig, seed: int = 0, device: str | torch.device = "cpu", std: float = 0.02,
               lazy: bool = False):
        """Random weights of the right shapes (for benchmarks and tests): N(0, std) matrices, unit norms; with
        lazy=True each is made on `device` when it is used (the same values)."""
        from kiln.checkpoint.random_weights import random_weights

        weights = random_weights(config, seed, device, std)
        return cls(config, weights if lazy else materialize(weights), source="random weights")

    @property
    def is_lazy(self) -> bool:
        return isinstance(self.weights, LazyWeights)

    def save_checkpoint(self, out_dir: str | Path, save_config_only: bool = False, mapping: Mapping | None = None,
                        workers: int = 1, overwrite: bool = False) -> Path:
        """Write config.json + rank{N}.safetensors (+ tokenizer files), a tensor at a time; atomic. With a `mapping`
        of several ranks the (unsharded) model is sharded and every rank written in one pass over the weights,
        `workers` threads writing the ranks' parts. An existing `out_dir` is replaced only when it is empty or a
        checkpoint, or with overwrite=True."""
        if mapping is None or mapping.world_size == 1:
            return save_checkpoint(out_dir, self.config, {self.config.mapping.rank: self.weights},
                                   self.tokenizer_files, config_only=save_config_only, overwrite=overwrite)
        self._check_unsharded()
        return save_sharded_checkpoint(out_dir, self.config, self.weights, mapping, self.tokenizer_files,
                                       config_only=save_config_only, workers=workers, overwrite=overwrite)

    def shard(self, mapping: Mapping):
        """This rank's share of an unsharded model (kiln.checkpoint.sharding); of a lazy model, lazy."""
        import dataclasses

        from kiln.checkpoint.sharding import shard_view, shard_weights

        self._check_unsharded()
        if self.is_lazy:
            config, weights = dataclasses.replace(self.config, mapping=mapping), shard_view(self.config, self.weights,
                                                                                            mapping)
        else:
            config, weights = shard_weights(self.config, self.weights, mapping)
        return type(self)(config, weights, self.tokenizer_files, source=f"rank {mapping.rank} of a sharded model")

    def _check_unsharded(self) -> None:
        if self.config.mapping.world_size > 1:
            raise ValueError("the model is already sharded; load the unsharded model to shard it differently")


def _read(weights: LazyWeights, desc: str, quiet: bool) -> dict[str, torch.Tensor]:
    """Every tensor of `weights` read, unit by unit, under a progress bar."""
    units = progress(weights.units(), desc, len(weights.unit_names()), quiet=quiet)
    return {name: tensor for unit in units for name, tensor in unit.items()}
