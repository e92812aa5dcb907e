"""Kiln checkpoints on disk: config.json (with the checksums of the other files) + rank{N}.safetensors + tokenizer
files, written atomically."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from kiln.config import Mapping, PretrainedConfig
from kiln.tokenizer import read_tokenizer_files, write_tokenizer_files
from kiln.utils.checksum import directory_checksums, verify_checksums
from kiln.utils.fs import atomic_dir, check_output_dir, read_json_object, require_dir
from kiln.version import __version__

from .lazy import materialize
from .safetensors_file import TensorWriter, file_weights, write_tensors

CHECKPOINT_FORMAT = "kiln-checkpoint"


def is_checkpoint_dir(path: Path) -> bool:
    config = path / "config.json"
    return config.is_file() and read_json_object(config, "checkpoint config").get("kiln_format") == CHECKPOINT_FORMAT


RANK_METADATA = {"format": "pt"}


def save_checkpoint(out_dir: str | Path, config: PretrainedConfig, rank_weights: dict, tokenizer_files: dict[str, bytes],
                    config_only: bool = False, workers: int = 1, overwrite: bool = False) -> Path:
    """Write a checkpoint; `rank_weights` maps each rank to its tensors (a dict, or LazyWeights written a unit at a
    time), or to a function making them, so that ranks are produced one at a time, `workers` in parallel. Nothing
    is left behind on failure. An existing directory is replaced only when it is empty or a checkpoint, or with
    overwrite=True."""
    from concurrent.futures import ThreadPoolExecutor

    def write(item):
        rank, weights = item
        weights = weights() if callable(weights) else weights
        return f"rank{rank}.safetensors", write_tensors(tmp / f"rank{rank}.safetensors", weights, RANK_METADATA)

    check_output_dir(out_dir, CHECKPOINT_FORMAT, overwrite)
    with atomic_dir(out_dir) as tmp:
        digests = {}
        if not config_only:
            with ThreadPoolExecutor(max(1, workers)) as pool:
                digests = dict(pool.map(write, rank_weights.items()))
        _finish(tmp, config, tokenizer_files, digests)
    return Path(out_dir)


def save_sharded_checkpoint(out_dir: str | Path, config: PretrainedConfig, weights, mapping: Mapping,
                            tokenizer_files: dict[str, bytes], config_only: bool = False, workers: int = 1,
                            overwrite: bool = False) -> Path:
    """Write every rank of `mapping` from the weights of an unsharded model (a dict, or LazyWeights made a unit at
    a time) in one pass: each tensor is cut into the ranks' parts, which `workers` threads write into the rank files
    at once; host memory holds one unit and its parts."""
    from concurrent.futures import ThreadPoolExecutor

    from .sharding import rank_parts

    check_output_dir(out_dir, CHECKPOINT_FORMAT, overwrite)
    specs, parts = rank_parts(config, weights, mapping)
    with atomic_dir(out_dir) as tmp:
        digests = {}
        if not config_only:
            writers = {rank: TensorWriter(tmp / f"rank{rank}.safetensors", rank_specs, RANK_METADATA)
                       for rank, rank_specs in specs.items()}
            try:
                with ThreadPoolExecutor(max(1, workers)) as pool:
                    for tensor_parts in parts:
                        list(pool.map(lambda item: writers[item[0]].write(*item[1:]), tensor_parts))
            except BaseException:
                for writer in writers.values():
                    writer.abort()
                raise
            digests = {writer.path.name: writer.close() for writer in writers.values()}
        _finish(tmp, dataclasses.replace(config, mapping=mapping), tokenizer_files, digests)
    return Path(out_dir)


def _finish(tmp: Path, config: PretrainedConfig, tokenizer_files: dict[str, bytes], digests: dict[str, str]) -> None:
    """Tokenizer files and config.json (with every file's checksum; the rank files' were taken as they were
    written)."""
    write_tokenizer_files(tokenizer_files, tmp)
    config = dataclasses.replace(config, mapping=config.mapping.for_rank(0))
    meta = {"kiln_format": CHECKPOINT_FORMAT, "kiln_version": __version__, **config.to_dict(),
            "checksums": directory_checksums(tmp, known=digests)}
    (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n")


def load_checkpoint_config(ckpt_dir: str | Path, rank: int = 0) -> PretrainedConfig:
    return _read_config(ckpt_dir, rank)[0]


def _read_config(ckpt_dir: str | Path, rank: int) -> tuple[PretrainedConfig, dict | None]:
    """(config of `rank`, the checksums config.json records: None in checkpoints written before them)."""
    ckpt_dir = require_dir(ckpt_dir, "checkpoint directory")
    data = read_json_object(ckpt_dir / "config.json", "checkpoint config")
    if data.pop("kiln_format", None) != CHECKPOINT_FORMAT:
        raise ValueError(f"{ckpt_dir}: not a Kiln checkpoint (config.json has no kiln_format={CHECKPOINT_FORMAT!r})")
    data.pop("kiln_version", None)
    checksums = data.pop("checksums", None)
    config = PretrainedConfig.from_dict(data)
    if not 0 <= rank < config.mapping.world_size:
        raise ValueError(f"{ckpt_dir} has ranks 0..{config.mapping.world_size - 1}; rank {rank} asked")
    return dataclasses.replace(config, mapping=config.mapping.for_rank(rank)), checksums


def load_checkpoint(ckpt_dir: str | Path, rank: int = 0, verify: bool = True,
                    lazy: bool = False) -> tuple[PretrainedConfig, dict[str, torch.Tensor], dict[str, bytes]]:
    """(config, tensors of `rank`, tokenizer files) of a checkpoint directory; the files' checksums are verified
    first (verify=False skips them). Each tensor is read into its own buffer; with lazy=True the tensors are
    LazyWeights, each read when it is used (their names, shapes and dtypes are checked now)."""
    from kiln.checkpoint.layout import check_weights

    config, checksums = _read_config(ckpt_dir, rank)
    path = Path(ckpt_dir) / f"rank{rank}.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt_dir}: no weights file {path.name} (a config-only checkpoint?)")
    if verify:
        verify_checksums(Path(ckpt_dir), checksums, "checkpoint", path.name)
    weights = file_weights(path)
    check_weights(weights, config, str(path))
    return config, weights if lazy else materialize(weights), read_tokenizer_files(ckpt_dir)
