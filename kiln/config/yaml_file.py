"""The seed's one-file build description: `model:`, `checkpoint:` and `build:` sections."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .build import BuildConfig
from .convert import ConvertConfig
from .fields import from_dict, require


@dataclass
class ModelSection:
    """The `model:` section."""

    model_dir: str | None = None
    """Hugging Face model directory (or GGUF file); None builds a random-weight model from `checkpoint:`."""
    output_dir: str | None = None
    """Where the engine is written."""
    dtype: str = "auto"
    """float32, bfloat16, float16, or auto (the model's own dtype)."""


@dataclass
class BuildFile:
    """A whole build YAML: which model, how it is converted, how the engine is built."""

    model: ModelSection = field(default_factory=ModelSection)
    """The `model:` section."""
    checkpoint: ConvertConfig = field(default_factory=ConvertConfig)
    """The `checkpoint:` section: kiln convert's settings, applied on the way to the engine."""
    build: BuildConfig = field(default_factory=BuildConfig)
    """The `build:` section."""


def load_build_file(path: str | Path) -> BuildFile:
    """Read and validate a build YAML; unknown sections or keys are errors naming the key."""
    import yaml

    path = Path(path)
    require(path.is_file(), f"build config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from None
    require(isinstance(data, dict), f"{path}: expected a mapping with model:, checkpoint: and build: sections")
    unknown = sorted(set(data) - {"model", "checkpoint", "build"})
    if unknown:
        raise ValueError(f"{path}: unknown section {unknown[0]!r}; known sections: build, checkpoint, model")
    return BuildFile(model=from_dict(ModelSection, data.get("model"), f"{path}: model"),
                     checkpoint=from_dict(ConvertConfig, data.get("checkpoint"), f"{path}: checkpoint"),
                     build=from_dict(BuildConfig, data.get("build"), f"{path}: build"))
