"""Engines on disk: config.json (version, configs, hash) + rank{N}.safetensors (runtime layout) + tokenizer."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kiln.config import BuildConfig, PretrainedConfig
from kiln.tokenizer import read_tokenizer_files, write_tokenizer_files
from kiln.utils.fs import atomic_dir, read_json_object, require_dir
from kiln.version import __version__

ENGINE_FORMAT = "kiln-engine"
KERNEL_CACHE = "triton_cache"


def engine_hash(pretrained_config: PretrainedConfig, build_config: BuildConfig, version: str = __version__) -> str:
    """sha256 over the Kiln version and every config field that shapes the engine (the same for every rank)."""
    pretrained_config = dataclasses.replace(pretrained_config, mapping=pretrained_config.mapping.for_rank(0))
    payload = {"version": version, "pretrained_config": pretrained_config.to_dict(),
               "build_config": build_config.engine_fields()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass
class Engine:
    """A built engine: its configs, each rank's weights in the runtime layout, and tokenizer files."""

    pretrained_config: PretrainedConfig
    build_config: BuildConfig
    weights: dict[int, dict[str, torch.Tensor]]
    tokenizer_files: dict[str, bytes] = field(default_factory=dict)
    network_text: str | None = None
    kernel_cache: dict[str, bytes] = field(default_factory=dict)   # compiled GPU kernels (triton_cache/)
    # how another process gets rank r's engine on its device: rank_loader(r, device) (picklable), None when
    # the other ranks' weights exist only in this process
    rank_loader: Callable[[int, torch.device], "Engine"] | None = field(default=None, repr=False, compare=False)

    @property
    def hash(self) -> str:
        return engine_hash(self.pretrained_config, self.build_config)

    def manifest(self) -> dict:
        config = dataclasses.replace(self.pretrained_config, mapping=self.pretrained_config.mapping.for_rank(0))
        return {"kiln_format": ENGINE_FORMAT, "version": __version__, "pretrained_config": config.to_dict(),
                "build_config": self.build_config.to_dict(), "hash": self.hash}

    def save(self, engine_dir: str | Path) -> Path | None:
        """Write the engine directory atomically (a dry-run build writes nothing and says so)."""
        from safetensors.torch import save_file

        if self.build_config.dry_run:
            print(f"dry run: not writing {engine_dir}")
            return None
        with atomic_dir(engine_dir) as tmp:
            (tmp / "config.json").write_text(json.dumps(self.manifest(), indent=2) + "\n")
            for rank, weights in self.weights.items():
                save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / f"rank{rank}.safetensors"),
                          metadata={"kiln_engine_hash": self.hash, "rank": str(rank)})
            write_tokenizer_files(self.tokenizer_files, tmp)
            if self.network_text:
                (tmp / "network.txt").write_text(self.network_text)
            for name, data in self.kernel_cache.items():
                (tmp / KERNEL_CACHE / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / KERNEL_CACHE / name).write_bytes(data)
        return Path(engine_dir)

    @classmethod
    def from_dir(cls, engine_dir: str | Path, rank: int = 0, device: str | torch.device = "cpu") -> "Engine":
        """Load and verify an engine: format, Kiln version, config hash and weights file are all checked."""
        engine_dir = require_dir(engine_dir, "engine directory")
        manifest = read_manifest(engine_dir)
        pretrained = PretrainedConfig.from_dict(manifest["pretrained_config"])
        build = BuildConfig.from_dict(manifest["build_config"], where=f"{engine_dir}/config.json build_config")
        if engine_hash(pretrained, build) != manifest.get("hash"):
            raise ValueError(f"{engine_dir}/config.json does not match the engine it describes (hash mismatch: "
                             "the file was edited after the build); rebuild the engine")
        if not 0 <= rank < pretrained.mapping.world_size:
            raise ValueError(f"{engine_dir} has ranks 0..{pretrained.mapping.world_size - 1}; rank {rank} asked")
        pretrained = dataclasses.replace(pretrained, mapping=pretrained.mapping.for_rank(rank))
        weights = _load_rank(engine_dir / f"rank{rank}.safetensors", manifest["hash"], device)
        kernels = {str(p.relative_to(engine_dir / KERNEL_CACHE)): p.read_bytes()
                   for p in (engine_dir / KERNEL_CACHE).rglob("*") if p.is_file()}
        return cls(pretrained, build, {rank: weights}, read_tokenizer_files(engine_dir), kernel_cache=kernels,
                   rank_loader=functools.partial(load_engine_rank, str(engine_dir)))


def load_engine_rank(engine_dir: str, rank: int, device: str | torch.device) -> Engine:
    return Engine.from_dir(engine_dir, rank=rank, device=device)


def is_engine_dir(path: Path) -> bool:
    config = path / "config.json"
    return config.is_file() and read_json_object(config, "engine config").get("kiln_format") == ENGINE_FORMAT


def read_manifest(engine_dir: Path) -> dict:
    path = engine_dir / "config.json"
    manifest = read_json_object(path, "engine config")
    if manifest.get("kiln_format") != ENGINE_FORMAT:
        raise ValueError(f"{engine_dir} is not a Kiln engine (config.json lacks kiln_format={ENGINE_FORMAT!r})")
    if manifest.get("version") != __version__:
        raise ValueError(f"{engine_dir} was built by Kiln {manifest.get('version')}, this is Kiln {__version__}; "
                         "rebuild the engine with this version")
    for key in ("pretrained_config", "build_config", "hash"):
        if key not in manifest:
            raise ValueError(f"{path}: engine config lacks {key!r}")
    return manifest


def _load_rank(path: Path, expected_hash: str, device) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise FileNotFoundError(f"engine weights {path} are missing")
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            if (f.metadata() or {}).get("kiln_engine_hash") != expected_hash:
                raise ValueError(f"{path} belongs to another engine (its hash differs from config.json's)")
            return {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as err:
        raise ValueError(f"{path}: corrupt or truncated engine weights ({err})") from None
