"""`kiln build` on a GPU compiles the engine's kernels and stores them in it: the engine runs once (every
CUDA-graph bucket and a prompt step) with Triton's on-disk cache pointed at an empty directory, and what Triton
wrote there travels in the engine (kiln.runtime.kernel_cache installs it at load)."""
from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
from pathlib import Path

import torch

from kiln.builder import Engine
from kiln.kernels import AttentionMetadata

from .kernel_cache import cache_files, count_entries, use_cache_dir
from .model_runner import ModelRunner


def compile_kernels(engine: Engine, device: torch.device | str = "cuda") -> int:
    """Compile every kernel the engine's steps use and keep them in `engine.kernel_cache`; returns the count."""
    build = engine.build_config
    root = Path(tempfile.mkdtemp(prefix="kiln-compile-"))
    try:
        if build.input_timing_cache:
            with tarfile.open(build.input_timing_cache) as tar:
                tar.extractall(root, filter="data")
        use_cache_dir(root)
        runner = ModelRunner(engine, torch.device(device))
        blocks = runner.max_blocks_per_seq
        runner.allocate_kv(blocks + 1)
        runner.capture_graphs()
        _prompt_step(runner, min(build.max_input_len, 64))
        runner.close()
        engine.kernel_cache = cache_files(root)
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
