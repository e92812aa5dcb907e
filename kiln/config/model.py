"""ModelConfig: the seed's way of naming a model to LLM — LLM(ModelConfig(model_dir=...), ...) — beside Kiln's own
LLM(model, build_config=..., parallel_config=..., quant_config=...), which it maps onto."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .build import PluginConfig
from .fields import require
from .parallel import ParallelConfig
from .quant import QuantConfig


@dataclass
class ModelConfig:
    """A model for LLM, with how to split, quantize and build it (the build settings apply when LLM builds the
    engine; a built engine carries its own)."""

    model_dir: str | None = None
    """A model directory: an HF directory or GGUF file, a Kiln checkpoint or engine (or a Hugging Face model id)."""
    model: Any = None
    """Instead of model_dir: a model path or id, or an in-memory model (a PretrainedModel or Engine)."""
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor/pipeline parallelism of a model built here."""
    quant_config: QuantConfig = field(default_factory=QuantConfig)
    """How LLM quantizes a float model before building it (kiln.convert.quantize; none by default)."""
    multi_block_mode: bool = True
    """Split long sequences' decode attention over several programs (PluginConfig.multi_block_mode)."""
    max_beam_width: int = 1
    """The engine's largest beam search (BuildConfig.max_beam_width)."""
    plugin_config: PluginConfig | dict | None = None
    """Kernel choices of the engine built here (a PluginConfig or its fields); None: the defaults."""

    def __post_init__(self):
        require((self.model_dir is None) != (self.model is None),
                "ModelConfig: give the model as model_dir or as model (one of them)")
        if isinstance(self.plugin_config, dict):
            self.plugin_config = PluginConfig(**self.plugin_config)
        require(self.plugin_config is None or isinstance(self.plugin_config, PluginConfig),
                f"ModelConfig.plugin_config must be a PluginConfig or a dict of its fields, got "
                f"{type(self.plugin_config).__name__}")
        require(isinstance(self.max_beam_width, int) and self.max_beam_width >= 1,
                f"ModelConfig.max_beam_width must be a whole number >= 1, got {self.max_beam_width!r}")

    @property
    def source(self):
        """The model LLM loads: model_dir or model."""
        return self.model_dir if self.model_dir is not None else self.model

    @property
    def is_multi_gpu(self) -> bool:
        return self.world_size > 1

    @property
    def world_size(self) -> int:
        parallel = self.parallel_config
        return parallel.world_size if parallel.auto_parallel else parallel.tp_size * parallel.pp_size

    def build_fields(self) -> dict:
        """The build settings this config changes from the defaults: max_beam_width, plugin_config, and
        multi_block_mode (a PluginConfig field)."""
        fields = {}
        if self.max_beam_width != 1:
            fields["max_beam_width"] = self.max_beam_width
        if self.plugin_config is not None:
            fields["plugin_config"] = self.plugin_config
        if not self.multi_block_mode:
            fields["multi_block_mode"] = False
        return fields
