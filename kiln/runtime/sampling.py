"""SamplingConfig: how one request is decoded. Plain Python, validated on construction."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this decode greedily (as vLLM's): dividing logits by less overflows float32."""
FLOAT32_TINY = 2.0 ** -126
"""The smallest normal float32: a nonzero setting below it is a denormal in float32 arithmetic."""
MAX_LENGTH_PENALTY = 10.0
"""|length_penalty| beyond this makes generated_length ** length_penalty overflow a float."""
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                "length_penalty")


class DecodingMode(enum.Enum):
    """Which decoding algorithms an LLM accepts (the seed's values); `none` accepts every request as it is."""

    none = 0
    top_k = 1
    top_p = 2
    top_k_top_p = 3
    beam_search = 4


@dataclass
class SamplingConfig:
    """Decoding settings of a request. With no temperature/top_k/top_p/min_p given, decoding is greedy."""

    max_new_tokens: int = 32
    """Most tokens to generate per sequence."""
    min_tokens: int = 0
    """End and stop tokens are suppressed until this many tokens have been generated."""
    end_id: int | None = None
    """Token that ends generation; None uses the tokenizer's end-of-sequence token(s); -1 never stops on one."""
    pad_id: int | None = None
    """Token that pads padded_token_ids to max_new_tokens; None uses end_id."""
    stop_token_ids: list[int] = field(default_factory=list)
    """More tokens that end generation (kept in token_ids, like end_id)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; the text is cut just before the first one."""
    temperature: float | None = None
    """Softmax temperature; 0 (or below 1e-5) means greedy. Setting it (or top_k/top_p/min_p) turns sampling on
    (default 1.0)."""
    top_k: int | None = None
    """Sample among the k most likely tokens; 0 or None means no limit, 1 means greedy."""
    top_p: float | None = None
    """Sample among the smallest set of tokens whose probability reaches p, in (0, 1]."""
    min_p: float | None = None
    """Drop tokens less likely than min_p times the most likely one, in [0, 1]."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens already in the prompt or output; 1 disables it."""
    presence_penalty: float = 0.0
    """Subtracted from the logits of tokens already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted once per earlier occurrence of a token in the output, in [-2, 2]."""
    random_seed: int | None = None
    """Seed of this request's random generators (sample i uses random_seed + i); None draws one."""
    n: int = 1
    """Independent samples to generate for the prompt."""
    num_beams: int = 1
    """Beam width for beam search (1: no beam search); the best beam is returned."""
    length_penalty: float = 1.0
    """Beam search: a finished beam scores cumulative log-prob / (generated length ** length_penalty), in
    [-10, 10]."""
    early_stopping: bool | str = False
    """Beam search: True stops once num_beams beams finished; False stops when no running beam can beat the
    finished ones (scored at the current length); "never" also considers the longest possible length."""
    logprobs: int | None = None
    """Return the log-probability of each chosen token and of the this-many most likely tokens (0: chosen only)."""
    return_dict: bool = False
    """The output also answers as TensorRT-LLM's runtime dict: output["output_ids"], one list per sample or beam of
    the prompt and generated tokens padded with pad_id to prompt + max_new_tokens."""
    output_sequence_lengths: bool = False
    """With return_dict: output["sequence_lengths"] too, the prompt + generated length of each sample or beam."""

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = list(self.stop_token_ids)
        self._check_counts()
        self._check_floats()
        self._check_ranges()

    def _bad(self, name: str, rule: str):
        raise ValueError(f"SamplingConfig.{name}={getattr(self, name)!r} is invalid: {rule}")

    def _check_counts(self):
        for name, low in (("max_new_tokens", 1), ("min_tokens", 0), ("n", 1), ("num_beams", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                self._bad(name, f"must be an integer ≥ {low}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            self._bad("top_k", "must be an integer ≥ 0")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            self._bad("logprobs", "must be an integer ≥ 0")
        if self.min_tokens > self.max_new_tokens:
            self._bad("min_tokens", f"must not exceed max_new_tokens={self.max_new_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop):
            self._bad("stop", "must be non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            self._bad("stop_token_ids", "must be token ids ≥ 0")
        if self.num_beams > 1 and self.n > 1:
            self._bad("n", "must be 1 with beam search (num_beams > 1)")
        if self.output_sequence_lengths and not self.return_dict:
            self._bad("output_sequence_lengths", "adds sequence_lengths to the dict form of the output: set "
                      "return_dict=True too")

    def _check_floats(self):
        """Every float setting is a finite number, and not a float32 denormal (arithmetic with one overflows)."""
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                self._bad(name, "must be a finite number")
            if 0 < abs(value) < FLOAT32_TINY:
                self._bad(name, f"is too small to compute with (below {FLOAT32_TINY:.3g}, a float32 denormal)")

    def _check_ranges(self):
        if self.temperature is not None and not self.temperature >= 0:
            self._bad("temperature", "must be ≥ 0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            self._bad("top_p", "must be in (0, 1]")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            self._bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0:
            self._bad("repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                self._bad(name, "must be in [-2, 2]")
        if not abs(self.length_penalty) <= MAX_LENGTH_PENALTY:
            self._bad("length_penalty", f"must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]")
        if self.early_stopping not in (True, False, "never"):
            self._bad("early_stopping", 'must be True, False or "never"')
        if self.num_beams > 1 and not self.greedy:
            self._bad("num_beams", "beam search does not combine with temperature/top_k/top_p/min_p sampling")

    @property
    def greedy(self) -> bool:
        if (self.temperature is not None and self.temperature < GREEDY_TEMPERATURE) or self.top_k == 1:
            return True
        return self.temperature is None and self.top_k is None and self.top_p is None and self.min_p is None

    @property
    def use_beam_search(self) -> bool:
        return self.num_beams > 1

    @property
    def num_sequences(self) -> int:
        """Sequences this request runs at once: its beams or its samples."""
        return max(self.n, self.num_beams)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
