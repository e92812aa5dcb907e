"""Compiled GPU kernels that travel with an engine (the seed's timing cache), so loading compiles nothing.

`kiln build` on a GPU runs the engine once (every CUDA-graph bucket and a prompt step) with Triton's on-disk
cache pointed at an empty directory, and stores what Triton wrote in the engine (`triton_cache/`). Loading an
engine that carries it points Triton's cache there first; `count_compiled()` tells how many kernels were
compiled anyway.
"""
from __future__ import annotations

import atexit
import io
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

import torch

from kiln.builder import Engine
from kiln.kernels import AttentionMetadata


def _set_cache_dir(path: Path) -> None:
    os.environ["TRITON_CACHE_DIR"] = str(path)
    try:
        import triton

        triton.knobs.cache.dir = str(path)
    except (ImportError, AttributeError):
        pass


def count_entries(path: Path) -> int:
    """Kernels in a Triton cache directory (one sub-directory per compiled kernel)."""
    return sum(1 for p in Path(path).iterdir() if p.is_dir()) if Path(path).is_dir() else 0


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in Path(path).rglob("*") if p.is_file()
            and not p.name.endswith(".lock") and ".tmp" not in p.name}


def install(files: dict[str, bytes]) -> Path:
    """Write a carried cache to a private directory and make Triton use it; returns the directory."""
    root = Path(tempfile.mkdtemp(prefix="kiln-triton-"))
    atexit.register(shutil.rmtree, root, True)
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    _set_cache_dir(root)
    return root


def compile_kernels(engine: Engine, device: torch.device | str = "cuda") -> int:
    """Compile every kernel the engine's steps use and keep them in `engine.kernel_cache`; returns the count."""
    from .model_runner import ModelRunner

    build = engine.build_config
    root = Path(tempfile.mkdtemp(prefix="kiln-compile-"))
    try:
        if build.input_timing_cache:
            with tarfile.open(build.input_timing_cache) as tar:
                tar.extractall(root, filter="data")
        _set_cache_dir(root)
        runner = ModelRunner(engine, torch.device(device))
        blocks = runner.max_blocks_per_seq
        runner.allocate_kv(blocks + 1)
        runner.capture_graphs()
        _prompt_step(runner, min(build.max_input_len, 64))
        del runner
        engine.kernel_cache = _files(root)
        if build.output_timing_cache:
            _write_tar(root, build.output_timing_cache)
        return count_entries(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        torch.cuda.empty_cache()


def _prompt_step(runner, tokens: int) -> None:
    """One eager prompt step, so the context-attention kernels are compiled too."""
    device, bs = runner.device, runner.tokens_per_block
    t = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
    table = list(range(-(-tokens // bs)))
    meta = AttentionMetadata(t(list(range(tokens))), t([0, tokens]), t([tokens]), t([table]), tokens, tokens, bs)
    with torch.inference_mode():
        runner.net.compute_logits(runner.net(t([1] * tokens), t(list(range(tokens))), meta, runner.kv_caches)[-1:])
    torch.cuda.synchronize()


def _write_tar(root: Path, path: str) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(root, arcname=".")
    Path(path).write_bytes(buffer.getvalue())
