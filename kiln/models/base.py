"""PretrainedModel: a model's config and checkpoint-layout weights, with the load/save entry points."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from kiln.checkpoint import (check_weights, checkpoint_shapes, is_hf_dir, load_checkpoint, read_source_config,
                             read_source_weights, save_checkpoint)
from kiln.checkpoint.hf import config_from_hf_dict, convert_hf_tensors
from kiln.config import Mapping, PretrainedConfig
from kiln.utils.steps import StepLog, progress


class PretrainedModel:
    """A model ready to be saved as a checkpoint or built into an engine.

    `weights` holds this rank's tensors in the checkpoint layout (kiln.checkpoint.layout);
    `tokenizer_files` the tokenizer files that travel with checkpoints and engines."""

    network_class: type = None  # the torch module that runs the engine layout

    def __init__(self, config: PretrainedConfig, weights: dict[str, torch.Tensor],
                 tokenizer_files: dict[str, bytes] | None = None, source: str = "model"):
        check_weights(weights, config, source)
        self.config = config
        self.weights = weights
        self.tokenizer_files = dict(tokenizer_files or {})

    @classmethod
    def from_hugging_face(cls, model_dir: str | Path, dtype: str = "auto", mapping: Mapping | None = None,
                          quiet: bool = False,
                          prepare_config: Callable[[PretrainedConfig], PretrainedConfig] | None = None):
        """Load an HF model directory (safetensors or .bin, sharded or not), a GGUF file (dequantised), or an
        in-memory transformers model (its tensors are used as they are, on their device), as it is (kiln.convert
        loads and quantizes). With a `mapping` of several ranks only that rank's share of an HF directory is read,
        a tensor at a time (the load_by_shard path: host memory stays at one rank's weights). `prepare_config`
        is called with the model's config before any weight is read and returns the config to load with
        (kiln.convert checks a ConvertConfig's shape fields there and sets its parallel fields)."""
        prepare_config = prepare_config or (lambda config: config)
        if mapping is not None and mapping.world_size > 1:
            return cls._load_rank(model_dir, dtype, mapping, prepare_config, quiet)
        return cls._load_hugging_face(model_dir, dtype, prepare_config, quiet)

    @classmethod
    def _load_rank(cls, model_dir, dtype: str, mapping: Mapping, prepare_config, quiet: bool):
        """Only `mapping.rank`'s share of an HF directory, read a tensor at a time (load_by_shard)."""
        import dataclasses

        from kiln.checkpoint.hf import read_hf_rank_weights
        from kiln.tokenizer import read_tokenizer_files

        if hasattr(model_dir, "state_dict") or not (Path(model_dir).is_dir() and is_hf_dir(Path(model_dir))):
            raise ValueError(f"loading one rank's share (load_by_shard) needs a Hugging Face directory, got {model_dir!r}")
        config = prepare_config(read_source_config(model_dir, dtype))
        weights = read_hf_rank_weights(model_dir, config, mapping, lambda it, desc: progress(it, desc, quiet=quiet))
        return cls(dataclasses.replace(config, mapping=mapping), weights, read_tokenizer_files(Path(model_dir)),
                   source=f"{model_dir} (rank {mapping.rank})")

    @classmethod
    def _load_hugging_face(cls, model_dir, dtype: str, prepare_config, quiet: bool):
        if hasattr(model_dir, "state_dict") and hasattr(model_dir, "config"):
            return cls._from_transformers_model(model_dir, dtype, prepare_config)
        log = StepLog("Load", 2, quiet)
        with log.step(f"Read the model config of {model_dir}"):
            config = prepare_config(read_source_config(model_dir, dtype))
        with log.step(f"Load {config.architecture} weights ({config.dtype}) into the Kiln layout"):
            weights, tokenizer_files = read_source_weights(
                model_dir, config, lambda it, desc: progress(it, desc, quiet=quiet))
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
        state = hf_model.state_dict()
        weights = convert_hf_tensors(((name, t, "state_dict") for name, t in state.items()), config)
        return cls(config, weights, source=type(hf_model).__name__)

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path, rank: int = 0, verify: bool = True):
        """Rank `rank` of a Kiln checkpoint, its files checked against their checksums (verify=False skips that)."""
        config, weights, tokenizer_files = load_checkpoint(ckpt_dir, rank, verify)
        return cls(config, weights, tokenizer_files, source=str(ckpt_dir))

    @classmethod
    def random(cls, config: PretrainedConfig, seed: int = 0, device: str | torch.device = "cpu", std: float = 0.02):
        """Random weights of the right shapes (for benchmarks and tests): N(0, std) matrices, unit norms."""
        generator = torch.Generator(device=device).manual_seed(seed)
        dtype = getattr(torch, config.dtype)
        weights = {}
        for name, shape in checkpoint_shapes(config).items():
            if name.endswith("norm.weight"):
                weights[name] = torch.ones(shape, dtype=dtype, device=device)
            else:
                weights[name] = (torch.randn(shape, generator=generator, device=device) * std).to(dtype)
        return cls(config, weights, source="random weights")

    def save_checkpoint(self, out_dir: str | Path, save_config_only: bool = False, mapping: Mapping | None = None,
                        workers: int = 1, overwrite: bool = False) -> Path:
        """Write config.json + rank{N}.safetensors (+ tokenizer files); atomic. With a `mapping` of several ranks
        the (unsharded) model is sharded and every rank written, `workers` ranks at a time. An existing `out_dir`
        is replaced only when it is empty or a checkpoint, or with overwrite=True."""
        if mapping is None or mapping.world_size == 1:
            return save_checkpoint(out_dir, self.config, {self.config.mapping.rank: self.weights},
                                   self.tokenizer_files, config_only=save_config_only, overwrite=overwrite)
        config = self.shard(mapping.for_rank(0)).config
        ranks = {r: (lambda r=r: self.shard(mapping.for_rank(r)).weights) for r in range(mapping.world_size)}
        return save_checkpoint(out_dir, config, ranks, self.tokenizer_files, config_only=save_config_only,
                               workers=workers, overwrite=overwrite)

    def shard(self, mapping: Mapping):
        """This rank's share of an unsharded model (kiln.checkpoint.sharding)."""
        from kiln.checkpoint.sharding import shard_weights

        if self.config.mapping.world_size > 1:
            raise ValueError("the model is already sharded; load the unsharded model to shard it differently")
        config, weights = shard_weights(self.config, self.weights, mapping)
        return type(self)(config, weights, self.tokenizer_files, source=f"rank {mapping.rank} of a sharded model")
