"""Quantization settings carried by a checkpoint and an engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from .fields import reject_unsupported, require_choice, require_positive

QUANT_ALGOS = (None, "W8A16", "W4A16", "W4A16_AWQ", "W4A16_GPTQ", "W8A8_SQ_PER_CHANNEL", "FP8")
KV_CACHE_QUANT_ALGOS = (None, "INT8", "FP8")


@dataclass
class QuantConfig:
    """How weights, activations and the KV cache are quantized (all None: the model's own dtype)."""

    quant_algo: str | None = None
    """Weight/activation scheme: W8A16 and W4A16 (weight-only INT8/INT4), W4A16_AWQ / W4A16_GPTQ (per-group
    INT4), W8A8_SQ_PER_CHANNEL (SmoothQuant), FP8; None for no quantization."""
    kv_cache_quant_algo: str | None = None
    """KV cache storage: INT8 or FP8; None keeps the model's dtype."""
    group_size: int = 128
    """Columns per scale for the per-group schemes."""
    smoothquant_val: float = 0.5
    """SmoothQuant's migration strength alpha."""
    exclude_modules: list[str] = field(default_factory=list)
    """Module name patterns left unquantized (the LM head by default)."""

    def __post_init__(self):
        require_choice("QuantConfig", "quant_algo", self.quant_algo, QUANT_ALGOS)
        require_choice("QuantConfig", "kv_cache_quant_algo", self.kv_cache_quant_algo, KV_CACHE_QUANT_ALGOS)
        require_positive("QuantConfig", group_size=self.group_size, smoothquant_val=self.smoothquant_val)
        reject_unsupported(self, ["quant_algo", "kv_cache_quant_algo"], "quantization is not implemented yet")

    @property
    def enabled(self) -> bool:
        return self.quant_algo is not None or self.kv_cache_quant_algo is not None
