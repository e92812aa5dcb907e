"""Quantization settings carried by a checkpoint and an engine (TensorRT-LLM's `quantization` section)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .fields import require, require_choice

QUANT_ALGOS = (None, "W8A16", "W4A16", "W4A16_GPTQ", "W4A16_AWQ", "W8A8_SQ_PER_CHANNEL",
               "W8A8_SQ_PER_CHANNEL_PER_TOKEN", "FP8", "FP8_PER_CHANNEL_PER_TOKEN")
GROUP_ALGOS = ("W4A16_GPTQ", "W4A16_AWQ")
KV_CACHE_QUANT_ALGOS = (None, "INT8", "FP8")


def excluded_modules(quantize_lm_head: bool = False) -> list[str]:
    """QuantConfig.exclude_modules as quantize_lm_head says: the LM head stays in the model's dtype unless it is
    quantized too (the default)."""
    return [] if quantize_lm_head else ["lm_head"]


@dataclass
class QuantConfig:
    """How weights, activations and the KV cache are quantized (all None: the model's own dtype)."""

    quant_algo: str | None = None
    """W8A16: weight-only int8 per output channel, rounded by GPTQ layer by layer; W4A16: int4 per output channel
    (round to nearest); W4A16_GPTQ / W4A16_AWQ: int4 per group of group_size input columns, calibrated layer by
    layer (GPTQ: act-order error compensation on clip-searched static groups; AWQ: activation-aware scales folded
    into the preceding op, clipping search, zero points); W8A8_SQ_PER_CHANNEL[_PER_TOKEN]: SmoothQuant int8 weights
    and activations (static per-tensor or dynamic per-token activation scales); FP8[_PER_CHANNEL_PER_TOKEN]: e4m3
    weights per channel (rounded by GPTQ), activations with a static or per-token scale; None: no weight
    quantization."""
    kv_cache_quant_algo: str | None = None
    """KV cache storage: INT8 or FP8 with calibrated per-layer scales; None keeps the model's dtype."""
    group_size: int | None = 128
    """Input columns per scale for the per-group int4 schemes (32, 64 or 128)."""
    has_zero_point: bool = False
    """The int4 groups carry zero points (AWQ); set automatically for W4A16_AWQ."""
    smoothquant_val: float = 0.5
    """SmoothQuant's migration strength alpha, in [0, 1]."""
    exclude_modules: list[str] = field(default_factory=excluded_modules)
    """Modules left unquantized (by name suffix: lm_head, o_proj, ...)."""
    learned_rounding_steps: int = 0
    """W4A16_GPTQ / W4A16_AWQ: after the grids and levels are chosen, this many steps of signed gradient descent
    re-choose each weight's rounding, up or down, so that every decoder layer's output comes closer to the float
    network's (AutoRound-style; kiln/quantization/tune.py; ~100 is usual, a few times slower to quantize); 0 keeps
    GPTQ's or AWQ's levels."""

    def __post_init__(self):
        require_choice("QuantConfig", "quant_algo", self.quant_algo, QUANT_ALGOS)
        require_choice("QuantConfig", "kv_cache_quant_algo", self.kv_cache_quant_algo, KV_CACHE_QUANT_ALGOS)
        require(0.0 <= self.smoothquant_val <= 1.0, f"QuantConfig.smoothquant_val={self.smoothquant_val} must be in [0, 1]")
        if self.quant_algo in GROUP_ALGOS:
            require(self.group_size in (32, 64, 128), f"QuantConfig: {self.quant_algo} needs group_size 32, 64 or 128, "
                                                      f"got {self.group_size!r}")
        if self.quant_algo == "W4A16_AWQ":
            self.has_zero_point = True
        require(isinstance(self.learned_rounding_steps, int) and self.learned_rounding_steps >= 0,
                f"QuantConfig.learned_rounding_steps={self.learned_rounding_steps!r} must be an integer >= 0")
        require(not self.learned_rounding_steps or self.quant_algo in GROUP_ALGOS,
                f"QuantConfig: learned_rounding_steps applies to the per-group int4 modes {', '.join(GROUP_ALGOS)}, "
                f"not to {self.quant_algo}")

    @property
    def enabled(self) -> bool:
        return self.quant_algo is not None or self.kv_cache_quant_algo is not None

    def quantizes(self, module_name: str) -> bool:
        """Whether the linear layer `module_name` (e.g. layers.3.attn.qkv_proj) gets quant_algo."""
        return self.quant_algo is not None and not any(module_name.endswith(e) for e in self.exclude_modules)

    @property
    def static_activations(self) -> bool:
        return self.quant_algo in ("W8A8_SQ_PER_CHANNEL", "FP8")

    @property
    def needs_calibration(self) -> bool:
        return self.static_activations or self.kv_cache_quant_algo is not None or \
            (self.quant_algo or "").startswith("W8A8")
