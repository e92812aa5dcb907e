"""Compiled GPU kernels that travel with an engine (`triton_cache/`, the seed's timing cache), so loading
compiles nothing: `install` points Triton's on-disk cache at the engine's copy before the first kernel runs;
`count_entries` before and after tells how many kernels were compiled anyway. Filling the cache at build time is
kiln.runtime.precompile."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path


def use_cache_dir(path: Path) -> None:
    os.environ["TRITON_CACHE_DIR"] = str(path)
    try:
        import triton

        triton.knobs.cache.dir = str(path)
    except (ImportError, AttributeError):
        pass


def count_entries(path: Path) -> int:
    """Kernels in a Triton cache directory (one sub-directory per compiled kernel)."""
    return sum(1 for p in Path(path).iterdir() if p.is_dir()) if Path(path).is_dir() else 0


def cache_files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in Path(path).rglob("*") if p.is_file()
            and not p.name.endswith(".lock") and ".tmp" not in p.name}


def install(files: dict[str, bytes]) -> Path:
    """Write a carried cache to a private directory and make Triton use it; returns the directory."""
    root = Path(tempfile.mkdtemp(prefix="kiln-triton-"))
    atexit.register(shutil.rmtree, root, True)
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    use_cache_dir(root)
    return root

