"""Quantization settings carried by a checkpoint and an engine (TensorRT-LLM's `quantization` section)."""
from __future__ import annotations

import enum
from dataclasses import InitVar, dataclass, field

from .fields import require, require_choice

QUANT_ALGOS = (None, "W8A16", "W4A16", "W4A16_GPTQ", "W4A16_AWQ", "W8A8_SQ_PER_CHANNEL",
               "W8A8_SQ_PER_CHANNEL_PER_TOKEN", "FP8", "FP8_PER_CHANNEL_PER_TOKEN")
GROUP_ALGOS = ("W4A16_GPTQ", "W4A16_AWQ")
KV_CACHE_QUANT_ALGOS = (None, "INT8", "FP8")


class QuantMode(enum.IntFlag):
    """The seed's (TensorRT-LLM's) quantization flags, mapped onto Kiln's quant_algo / kv_cache_quant_algo
    (QuantConfig(quant_mode=...), QuantConfig.quant_mode)."""

    INT4_WEIGHTS = 1
    INT8_WEIGHTS = 2
    ACTIVATIONS = 4          # int8 activations (SmoothQuant)
    PER_CHANNEL = 8
    PER_TOKEN = 16
    PER_GROUP = 32
    INT8_KV_CACHE = 64
    FP8_KV_CACHE = 128
    FP8_QDQ = 256

    @classmethod
    def from_description(cls, quantize_weights=False, quantize_activations=False, per_token=False,
                         per_channel=False, per_group=False, use_int4_weights=False, use_int8_kv_cache=False,
                         use_fp8_kv_cache=False, use_fp8_qdq=False) -> "QuantMode":
        mode = cls(0)
        if quantize_weights:
            mode |= cls.INT4_WEIGHTS if use_int4_weights else cls.INT8_WEIGHTS
        for wanted, flag in ((quantize_activations, cls.ACTIVATIONS), (per_token, cls.PER_TOKEN),
                             (per_channel, cls.PER_CHANNEL), (per_group, cls.PER_GROUP),
                             (use_int8_kv_cache, cls.INT8_KV_CACHE), (use_fp8_kv_cache, cls.FP8_KV_CACHE),
                             (use_fp8_qdq, cls.FP8_QDQ)):
            if wanted:
                mode |= flag
        return mode

    @classmethod
    def of(cls, quant_algo: str | None, kv_cache_quant_algo: str | None) -> "QuantMode":
        """The flags of Kiln's algorithm names."""
        weights = {None: 0, "W8A16": cls.INT8_WEIGHTS, "W4A16": cls.INT4_WEIGHTS,
                   "W4A16_GPTQ": cls.INT4_WEIGHTS | cls.PER_GROUP, "W4A16_AWQ": cls.INT4_WEIGHTS | cls.PER_GROUP,
                   "W8A8_SQ_PER_CHANNEL": cls.INT8_WEIGHTS | cls.ACTIVATIONS | cls.PER_CHANNEL,
                   "W8A8_SQ_PER_CHANNEL_PER_TOKEN": cls.INT8_WEIGHTS | cls.ACTIVATIONS | cls.PER_CHANNEL | cls.PER_TOKEN,
                   "FP8": cls.FP8_QDQ, "FP8_PER_CHANNEL_PER_TOKEN": cls.FP8_QDQ | cls.PER_CHANNEL | cls.PER_TOKEN}
        kv = {None: 0, "INT8": cls.INT8_KV_CACHE, "FP8": cls.FP8_KV_CACHE}
        return cls(weights[quant_algo] | kv[kv_cache_quant_algo])

    def algos(self) -> tuple[str | None, str | None]:
        """(quant_algo, kv_cache_quant_algo) of these flags; ValueError for a combination Kiln does not have."""
        kv = "FP8" if self & self.FP8_KV_CACHE else "INT8" if self & self.INT8_KV_CACHE else None
        if self & self.INT8_KV_CACHE and self & self.FP8_KV_CACHE:
            raise ValueError("QuantMode: an INT8 and an FP8 KV cache at once")
        if self & self.FP8_QDQ:
            per = self & (self.PER_CHANNEL | self.PER_TOKEN)
            algo = "FP8_PER_CHANNEL_PER_TOKEN" if per == self.PER_CHANNEL | self.PER_TOKEN else "FP8" if not per \
                else None
        elif self & self.ACTIVATIONS:
            algo = None if not (self & self.PER_CHANNEL and self & self.INT8_WEIGHTS) else \
                "W8A8_SQ_PER_CHANNEL_PER_TOKEN" if self & self.PER_TOKEN else "W8A8_SQ_PER_CHANNEL"
        elif self & self.INT4_WEIGHTS:
            algo = "W4A16_AWQ" if self & self.PER_GROUP else "W4A16"
        elif self & self.INT8_WEIGHTS:
            algo = None if self & self.PER_GROUP else "W8A16"
        else:
            algo = "" if self & (self.PER_GROUP | self.PER_CHANNEL | self.PER_TOKEN) else None
        if algo == "" or (algo is None and self & (self.INT4_WEIGHTS | self.INT8_WEIGHTS | self.ACTIVATIONS
                                                    | self.FP8_QDQ)):
            raise ValueError(f"QuantMode {self!r} has no Kiln quant_algo (see QUANT_ALGOS: per-tensor SmoothQuant "
                             "and per-group int8 are not implemented)")
        return algo, kv

    def has_int8_kv_cache(self) -> bool:
        return bool(self & self.INT8_KV_CACHE)

    def has_fp8_kv_cache(self) -> bool:
        return bool(self & self.FP8_KV_CACHE)

    def has_kv_cache_quant(self) -> bool:
        return bool(self & (self.INT8_KV_CACHE | self.FP8_KV_CACHE))

    def has_fp8_qdq(self) -> bool:
        return bool(self & self.FP8_QDQ)

    def has_act_and_weight_quant(self) -> bool:
        return bool(self & (self.ACTIVATIONS | self.FP8_QDQ))

    def is_weight_only(self) -> bool:
        return bool(self & (self.INT4_WEIGHTS | self.INT8_WEIGHTS)) and not self.has_act_and_weight_quant()

    def is_int4_weight_only(self) -> bool:
        return self.is_weight_only() and bool(self & self.INT4_WEIGHTS)

    def is_int8_weight_only(self) -> bool:
        return self.is_weight_only() and bool(self & self.INT8_WEIGHTS)

    def has_per_group_scaling(self) -> bool:
        return bool(self & self.PER_GROUP)

    def has_per_channel_scaling(self) -> bool:
        return bool(self & self.PER_CHANNEL)

    def has_per_token_dynamic_scaling(self) -> bool:
        return bool(self & self.PER_TOKEN)

    def has_any_quant(self) -> bool:
        return bool(self)


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
    quant_mode: InitVar["QuantMode | None"] = None
    """(the seed's form: QuantMode flags standing for quant_algo and kv_cache_quant_algo, which are then left out)"""
    quantize_lm_head: InitVar[bool | None] = None
    """(the seed's form: True quantizes the LM head too — exclude_modules without lm_head)"""
    learned_rounding_steps: int = 0
    """W4A16_GPTQ / W4A16_AWQ: after the grids and levels are chosen, this many steps of signed gradient descent
    re-choose each weight's rounding, up or down, so that every decoder layer's output comes closer to the float
    network's (AutoRound-style; kiln/quantization/tune.py; ~100 is usual, a few times slower to quantize); 0 keeps
    GPTQ's or AWQ's levels."""

    def __post_init__(self, quant_mode=None, quantize_lm_head=None):
        if quant_mode is not None:
            require(self.quant_algo is None and self.kv_cache_quant_algo is None,
                    "QuantConfig: give quant_mode or quant_algo/kv_cache_quant_algo, not both")
            self.quant_algo, self.kv_cache_quant_algo = QuantMode(quant_mode).algos()
        if quantize_lm_head is not None:
            self.exclude_modules = excluded_modules(quantize_lm_head)
        self._check()

    def _check(self):
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

    # --- the seed's QuantConfig methods: the mode as QuantMode flags (quant_mode, below), changed in place ---
    def _mode(self) -> QuantMode:
        return QuantMode.of(self.quant_algo, self.kv_cache_quant_algo)

    def _set_mode(self, mode: QuantMode) -> None:
        self.quant_algo, self.kv_cache_quant_algo = mode.algos()
        self._check()

    def set_int8_kv_cache(self) -> None:
        self._set_mode((self._mode() & ~QuantMode.FP8_KV_CACHE) | QuantMode.INT8_KV_CACHE)

    def set_fp8_kv_cache(self) -> None:
        self._set_mode((self._mode() & ~QuantMode.INT8_KV_CACHE) | QuantMode.FP8_KV_CACHE)

    def set_fp8_qdq(self) -> None:
        kv = self._mode() & (QuantMode.INT8_KV_CACHE | QuantMode.FP8_KV_CACHE)
        self._set_mode(kv | QuantMode.FP8_QDQ)

    def init_from_description(self, **description) -> None:
        """Set the mode from the seed's description flags (QuantMode.from_description's arguments)."""
        self._set_mode(QuantMode.from_description(**description))

    def __getattr__(self, name: str):
        """The seed's has_* / is_* questions, asked of the mode (QuantMode's methods)."""
        if name.startswith(("has_", "is_")) and hasattr(QuantMode, name):
            return getattr(self._mode(), name)
        raise AttributeError(f"'QuantConfig' object has no attribute {name!r}")

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


# The seed reads the mode as a property of the name its constructor takes (an InitVar there: set after the class is
# made, so the constructor's default stays None).
QuantConfig.quant_mode = property(QuantConfig._mode, doc="The mode as the seed's QuantMode flags.")
