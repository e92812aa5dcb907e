"""Run-time settings of an engine (not part of the engine itself)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from .fields import require, require_positive


@dataclass
class KvCacheConfig:
    """How big the paged KV cache is and how blocks are shared."""

    max_tokens: int | None = None
    """Most tokens the cache holds (over all requests); None sizes it from memory and the engine's limits."""
    free_gpu_memory_fraction: float = 0.9
    """On a GPU: share of the memory free after loading the weights that the cache may take (LLM refuses another
    value on the CPU, where host_cache_bytes sizes the cache)."""
    host_cache_bytes: int = 2 << 30
    """On the CPU: bytes the cache may take (LLM refuses another value on a GPU, where free_gpu_memory_fraction
    sizes the cache)."""
    enable_block_reuse: bool = False
    """Share cached blocks between requests with a common prefix."""

    def __post_init__(self):
        require_positive("KvCacheConfig", max_tokens=self.max_tokens, host_cache_bytes=self.host_cache_bytes)
        require(0 < self.free_gpu_memory_fraction <= 1,
                f"KvCacheConfig.free_gpu_memory_fraction={self.free_gpu_memory_fraction} must be in (0, 1]")


@dataclass
class LoraCacheConfig:
    """How many LoRA adapters the runtime keeps loaded (LLM(..., lora_cache_config=...))."""

    max_loras: int = 4
    """Adapters resident on the device at once, each in a slot (the least recently used one not in the current
    step is evicted for a new one); a step serves requests of at most this many adapters, the others wait."""
    max_cpu_loras: int | None = None
    """Adapters kept in host memory, read and checked once (the least recently used is dropped and read from disk
    again when asked for); None: as many as max_loras. At least max_loras."""

    def __post_init__(self):
        require_positive("LoraCacheConfig", max_loras=self.max_loras, max_cpu_loras=self.max_cpu_loras)
        require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                f"LoraCacheConfig.max_cpu_loras={self.max_cpu_loras} must be at least max_loras={self.max_loras} "
                "(an adapter on the device is also kept on the host)")

    @property
    def host_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


class SchedulerPolicy(enum.Enum):
    """How requests are admitted when the KV cache is short."""

    GUARANTEED_NO_EVICT = "guaranteed_no_evict"
    """Admit a request only when blocks for its whole output are free, so none is ever preempted."""
    MAX_UTILIZATION = "max_utilization"
    """Admit greedily; when blocks run out, preempt the newest request and recompute it later."""


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (LLM(..., speculative_config=...)): a drafter proposes up to max_draft_len tokens per
    generating sequence and step, the model verifies them all in one forward pass and keeps the longest prefix it
    agrees with plus one token of its own. Lossless: greedy output is the output without speculation, sampled
    output follows the model's distribution (rejection sampling). Requests with repetition/presence/frequency
    penalties, beam search or n > 1 decode without speculation, in the same batch."""

    method: str = "ngram"
    """"ngram": prompt lookup, the tokens that followed the latest earlier occurrence of the sequence's last
    n-gram (no extra model); "draft_model": a smaller model sharing the tokenizer (speculative_model) drafts
    autoregressively; "eagle": an EAGLE head (speculative_model: its directory, the public EAGLE layout) drafts from
    the model's own hidden states."""
    max_draft_len: int = 4
    """Draft tokens verified per sequence and step (at most the engine's BuildConfig.max_draft_len)."""
    max_matching_ngram_size: int = 4
    """ngram: the longest suffix n-gram looked up (longer matches are tried first)."""
    min_matching_ngram_size: int = 1
    """ngram: the shortest suffix n-gram looked up."""
    speculative_model: str | None = None
    """draft_model: the draft model — an engine directory, Kiln checkpoint, HF directory or GGUF file (or a loaded
    Engine); its vocabulary must be the target's. eagle: the EAGLE head's directory."""

    def __post_init__(self):
        require(self.method in SPECULATIVE_METHODS,
                f"SpeculativeConfig.method={self.method!r}: choose one of {', '.join(SPECULATIVE_METHODS)}")
        require_positive("SpeculativeConfig", max_draft_len=self.max_draft_len,
                         max_matching_ngram_size=self.max_matching_ngram_size,
                         min_matching_ngram_size=self.min_matching_ngram_size)
        require(self.min_matching_ngram_size <= self.max_matching_ngram_size,
                f"SpeculativeConfig: min_matching_ngram_size={self.min_matching_ngram_size} exceeds "
                f"max_matching_ngram_size={self.max_matching_ngram_size}")
        require((self.speculative_model is not None) == (self.method != "ngram"),
                "SpeculativeConfig.speculative_model is the draft model (method='draft_model') or the EAGLE head "
                "(method='eagle'): give it there and only there")
