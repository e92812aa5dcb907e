"""From Hugging Face directories and GGUF files to Kiln checkpoints, and back from disk."""
from __future__ import annotations

from pathlib import Path

from .gguf_file import find_gguf, gguf_weights, has_tokenizer, read_gguf_config
from .hf import hf_weights, is_hf_dir, read_hf_config
from .io import is_checkpoint_dir, load_checkpoint, load_checkpoint_config, save_checkpoint
from .layout import check_weights, checkpoint_shapes
from .lazy import LazyWeights, TensorSpec, materialize, weight_specs

__all__ = ["LazyWeights", "TensorSpec", "check_weights", "checkpoint_shapes", "find_gguf", "is_checkpoint_dir",
           "is_hf_dir", "load_checkpoint", "load_checkpoint_config", "materialize", "read_source_config",
           "read_source_weights", "save_checkpoint", "source_weights", "weight_specs"]


def read_source_config(path: str | Path, dtype: str = "auto"):
    """PretrainedConfig of an HF directory or GGUF file; a clear error for anything else."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    gguf = find_gguf(path)
    if gguf is not None and not (path.is_dir() and is_hf_dir(path)):
        return read_gguf_config(gguf, dtype)
    if path.is_dir() and (path / "config.json").is_file():
        return read_hf_config(path, dtype)
    raise FileNotFoundError(f"{str(path)!r} is not a model: no config.json and no .gguf file in it")


def source_weights(path: str | Path, config) -> tuple[LazyWeights, dict[str, bytes]]:
    """(tensors in the Kiln layout, each read when it is used; tokenizer files) of an HF directory or GGUF file,
    their names and shapes checked against `config` before anything is read."""
    from kiln.tokenizer import read_tokenizer_files, tokenizer_files_from_gguf

    path = Path(path)
    gguf = find_gguf(path)
    if gguf is not None and not (path.is_dir() and is_hf_dir(path)):
        weights, tokenizer = gguf_weights(gguf, config), tokenizer_files_from_gguf(gguf, has_tokenizer(gguf))
    else:
        weights, tokenizer = hf_weights(path, config), read_tokenizer_files(path)
    check_weights(weights, config, str(path))
    return weights, tokenizer


def read_source_weights(path: str | Path, config, progress=None):
    """(tensors in the Kiln layout, tokenizer files) of an HF directory or GGUF file, read a tensor at a time."""
    weights, tokenizer = source_weights(path, config)
    units = progress(weights.units(), "Loading weights", len(weights.unit_names())) if progress else weights.units()
    return {name: tensor for unit in units for name, tensor in unit.items()}, tokenizer
