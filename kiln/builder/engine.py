"""Engines on disk: config.json (version, configs, hash, checksums of the other files) + rank{N}.safetensors
(runtime layout) + tokenizer."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kiln.checkpoint.lazy import LazyWeights
from kiln.checkpoint.lora import adapter_files
from kiln.checkpoint.safetensors_file import TensorReader, write_tensors
from kiln.config import BuildConfig, PretrainedConfig
from kiln.tokenizer import read_tokenizer_files, write_tokenizer_files
from kiln.utils.checksum import check_digest, directory_checksums, verify_checksums
from kiln.utils.fs import atomic_dir, check_output_dir, read_json_object, require_dir
from kiln.version import __version__

from .refit import check_refittable, refit_source

ENGINE_FORMAT = "kiln-engine"
KERNEL_CACHE = "triton_cache"
ADAPTERS = "lora"          # the LoRA adapters stored with the engine: lora/<name>/ (LoraConfig.lora_dir)


def engine_hash(pretrained_config: PretrainedConfig, build_config: BuildConfig, version: str = __version__) -> str:
    """sha256 over the Kiln version and every config field that shapes the engine (the same for every rank)."""
    pretrained_config = dataclasses.replace(pretrained_config, mapping=pretrained_config.mapping.for_rank(0))
    payload = {"version": version, "pretrained_config": pretrained_config.to_dict(),
               "build_config": build_config.engine_fields()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass
class Engine:
    """A built engine: its configs, each rank's weights in the runtime layout (a dict of tensors, or LazyWeights
    made a layer at a time when they are saved or loaded), and tokenizer files."""

    pretrained_config: PretrainedConfig
    build_config: BuildConfig
    weights: dict[int, dict[str, torch.Tensor]]
    tokenizer_files: dict[str, bytes] = field(default_factory=dict)
    network_text: str | None = None
    kernel_cache: dict[str, bytes] = field(default_factory=dict)   # compiled GPU kernels (triton_cache/)
    adapters: dict[str, str] = field(default_factory=dict)   # LoRA adapter name → the directory of its files
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

    def save(self, engine_dir: str | Path, overwrite: bool = False) -> Path | None:
        """Write the engine directory atomically (a dry-run build writes nothing and says so). An existing directory
        is replaced only when it is empty or an engine, or with overwrite=True."""
        if self.build_config.dry_run:
            print(f"dry run: not writing {engine_dir}")
            return None
        check_output_dir(engine_dir, ENGINE_FORMAT, overwrite)
        with atomic_dir(engine_dir) as tmp:
            digests = {f"rank{rank}.safetensors": write_tensors(tmp / f"rank{rank}.safetensors", weights,
                                                                {"kiln_engine_hash": self.hash, "rank": str(rank)})
                       for rank, weights in self.weights.items()}
            write_tokenizer_files(self.tokenizer_files, tmp)
            if self.network_text:
                (tmp / "network.txt").write_text(self.network_text)
            for name, data in self.kernel_cache.items():
                (tmp / KERNEL_CACHE / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / KERNEL_CACHE / name).write_bytes(data)
            for name, source in self.adapters.items():
                (tmp / ADAPTERS / name).mkdir(parents=True)
                for file in adapter_files(source):
                    shutil.copyfile(file, tmp / ADAPTERS / name / file.name)
            manifest = {**self.manifest(), "checksums": directory_checksums(tmp, known=digests)}
            (tmp / "config.json").write_text(json.dumps(manifest, indent=2) + "\n")
        return Path(engine_dir)

    def refit(self, source) -> None:
        """Replace the weights of every rank held here with those of `source` (a Kiln checkpoint directory, a
        Hugging Face directory or a state dict of the same architecture and shapes, each rank cutting its share;
        quantized as the engine is), copied into the engine's tensors a layer at a time. Everything is checked first
        (refit_source, every rank): if anything differs, nothing changes. For an engine being served,
        LLM.update_weights."""
        sources = {rank: self.refit_source(source, rank) for rank in self.weights}
        for rank, weights in sources.items():
            for _ in self.refit_units(weights, rank):
                pass

    def refit_source(self, source, rank: int | None = None) -> LazyWeights:
        """`source`'s weights in the layout of this engine's rank `rank` (by default its own), checked against it
        (names, shapes, dtypes, model config), nothing read yet; only a refittable engine (BuildConfig.use_refit)
        takes them."""
        check_refittable(self.build_config)
        if isinstance(source, (str, Path)) and Path(source).is_dir() and is_engine_dir(Path(source)):
            raise ValueError(f"{source} is a Kiln engine; refit takes the checkpoint or Hugging Face model it was "
                             "built from (or a state dict)")
        config = self.pretrained_config
        if rank is not None:
            config = dataclasses.replace(config, mapping=config.mapping.for_rank(rank))
        return refit_source(source, config)

    def refit_units(self, weights: LazyWeights, rank: int | None = None):
        """Copy `weights` (refit_source's) into the tensors of rank `rank` (by default this engine's own) a unit (a
        layer) at a time, yielding each unit after it is copied (for a running network to copy it too). Weights that
        are themselves lazy (read from their files when used) are replaced by `weights` once every unit went by."""
        rank = self.pretrained_config.mapping.rank if rank is None else rank
        held = self.weights[rank]
        for unit in weights.units():
            if not isinstance(held, LazyWeights):
                with torch.no_grad():
                    for name, tensor in unit.items():
                        held[name].copy_(tensor)
            yield unit
        if isinstance(held, LazyWeights):
            self.weights[rank] = weights

    @classmethod
    def from_dir(cls, engine_dir: str | Path, rank: int = 0, device: str | torch.device = "cpu",
                 verify: bool = True) -> "Engine":
        """Load and verify an engine: format, Kiln version, config hash, the files' checksums (verify=False skips
        them), and every tensor's name, shape and dtype against the config (from the file's header, before any is
        read); then the weights file is read once onto `device`, in parallel chunks hashed as they arrive."""
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
        weights_file = engine_dir / f"rank{rank}.safetensors"
        _check_rank_file(weights_file, manifest["hash"])
        recorded = verify_checksums(engine_dir, manifest.get("checksums"), "engine", weights_file.name,
                                    digest_own_weights=False) if verify else None
        weights = _read_rank(weights_file, pretrained, device, recorded)
        check_sequence_fits(pretrained, build, torch.device(device))
        kernels = {str(p.relative_to(engine_dir / KERNEL_CACHE)): p.read_bytes()
                   for p in (engine_dir / KERNEL_CACHE).rglob("*") if p.is_file()}
        adapters = {p.name: str(p) for p in sorted((engine_dir / ADAPTERS).glob("*")) if p.is_dir()}
        return cls(pretrained, build, {rank: weights}, read_tokenizer_files(engine_dir), kernel_cache=kernels,
                   adapters=adapters, rank_loader=functools.partial(load_engine_rank, str(engine_dir), verify=verify))


def check_engine_weights(weights: dict[str, torch.Tensor], config: PretrainedConfig, source: str) -> None:
    """The engine-layout tensors of `config` (one rank), each with its shape and dtype, and nothing else: the
    checkpoint layout's, fused as the model fuses them (on the meta device: no memory)."""
    from kiln.checkpoint.layout import check_layer_count, check_tensors, checkpoint_shapes, tensor_dtypes
    from kiln.models import model_class

    check_layer_count(weights, config, source)
    shapes = checkpoint_shapes(config)
    dtypes = tensor_dtypes(config, shapes)
    meta = {name: torch.empty(shape, dtype=dtypes[name], device="meta") for name, shape in shapes.items()}
    fused = model_class(config.architecture)(config, meta, source=source).engine_weights()
    check_tensors(weights, {name: (tuple(t.shape), t.dtype) for name, t in fused.items()}, source)


def check_sequence_fits(config: PretrainedConfig, build: BuildConfig, device: torch.device) -> None:
    """One max_seq_len sequence's rotary table (float32) and KV cache (at least a byte a value) must fit the
    device's memory: checked before the runtime allocates them, so that an absurd max_seq_len is an error naming
    it rather than a failure inside the allocator."""
    from kiln.checkpoint.sharding import local_dims

    memory = device_memory(device)
    dims = local_dims(config)
    need = build.max_seq_len * config.head_dim * (4 + 2 * len(dims.layers) * dims.kv_heads)
    if memory is not None and need > memory:
        raise ValueError(f"BuildConfig.max_seq_len={build.max_seq_len}: one sequence of that length needs "
                         f"{need / 2**30:.1f} GiB (rotary table and KV cache), more than the {memory / 2**30:.1f} "
                         f"GiB of memory of {device}")


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory of `device`: a GPU's total, or the host's RAM (less, under an address-space limit)."""
    import os

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type != "cpu":
        return None
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError):
        return memory
    return memory if limit == resource.RLIM_INFINITY else min(memory, limit)


def load_engine_rank(engine_dir: str, rank: int, device: str | torch.device, verify: bool = True) -> Engine:
    return Engine.from_dir(engine_dir, rank=rank, device=device, verify=verify)


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


def _check_rank_file(path: Path, expected_hash: str) -> None:
    """The weights file is there, readable, and written with this engine (its metadata carries the same hash)."""
    if not path.is_file():
        raise FileNotFoundError(f"engine weights {path} are missing")
    try:
        with TensorReader(path) as f:
            written_with = f.metadata.get("kiln_engine_hash")
    except ValueError as err:
        raise ValueError(f"{path}: corrupt or truncated engine weights ({err})") from None
    if written_with != expected_hash:
        raise ValueError(f"{path} belongs to another engine (its hash differs from config.json's)")


def _read_rank(path: Path, config: PretrainedConfig, device, recorded_digest: str | None) -> dict:
    """The rank file's tensors on `device`, checked against `config` from the header before any is read, the file
    read once (its digest checked against `recorded_digest` as it is read, where given). _check_rank_file has
    checked the header."""
    with TensorReader(path) as reader:
        specs = {name: torch.empty(shape, dtype=dtype, device="meta")
                 for name in reader.keys() for shape, dtype in [reader.spec(name)]}
        check_engine_weights(specs, config, str(path))
        weights, digest = reader.read_all(device, hash_file=recorded_digest is not None)
    if recorded_digest is not None:
        check_digest(path, digest, recorded_digest, "engine")
    return weights
