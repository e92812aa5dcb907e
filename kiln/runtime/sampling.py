"""SamplingConfig: how one request is decoded. Plain Python, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingConfig:
    """Decoding settings of a request. With no temperature/top_k/top_p given, decoding is greedy."""

    max_new_tokens: int = 32
    """Most tokens to generate."""
    end_id: int | None = None
    """Token that ends generation; None uses the tokenizer's end-of-sequence token(s); -1 never stops early."""
    pad_id: int | None = None
    """Token used to pad outputs of unequal length; None uses end_id."""
    temperature: float | None = None
    """Softmax temperature; 0 means greedy. Setting it (or top_k/top_p) turns sampling on (default 1.0)."""
    top_k: int | None = None
    """Sample among the k most likely tokens; 0 or None means no limit, 1 means greedy."""
    top_p: float | None = None
    """Sample among the smallest set of tokens whose probability reaches p, in (0, 1]."""
    random_seed: int | None = None
    """Seed of this request's random generator; None draws one."""
    num_beams: int = 1
    """Beams for beam search (1: no beam search)."""

    def __post_init__(self):
        def bad(name, rule):
            raise ValueError(f"SamplingConfig.{name}={getattr(self, name)!r} is invalid: {rule}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            bad("max_new_tokens", "must be an integer ≥ 1")
        if self.temperature is not None and not self.temperature >= 0:
            bad("temperature", "must be ≥ 0")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            bad("top_k", "must be an integer ≥ 0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.num_beams, int) or self.num_beams < 1:
            bad("num_beams", "must be an integer ≥ 1")

    @property
    def greedy(self) -> bool:
        if self.temperature == 0 or self.top_k == 1:
            return True
        return self.temperature is None and self.top_k is None and self.top_p is None
