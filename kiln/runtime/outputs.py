"""What a request gives back: one CompletionOutput per sample or beam, inside a GenerationOutput."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .request import TokenLogprob


@dataclass
class RequestMetrics:
    """Times (time.monotonic seconds) of a request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_generated_tokens: int = 0
    num_draft_tokens: int = 0
    """Speculative decoding: draft tokens verified for the request,"""
    num_accepted_draft_tokens: int = 0
    """of them accepted,"""
    num_speculative_steps: int = 0
    """in this many steps."""

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted draft tokens over verified ones (None: nothing was drafted)."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a speculative step emitted on average: accepted drafts + the model's own token."""
        steps = self.num_speculative_steps
        return 1 + self.num_accepted_draft_tokens / steps if steps else None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between generated tokens after the first."""
        if self.finish_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    """Which sample (or beam rank, best first) this is."""
    text: str
    """Generated text: special tokens skipped, cut before a stop string."""
    token_ids: list[int]
    """Generated tokens, including the end/stop token when one ended the sequence."""
    finish_reason: str | None = None
    """None while running; "stop" (end token, stop token or stop string), "length", or "abort"."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the sequence."""
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprob] | None = None
    """Per generated token, when the request asked for logprobs."""
    text_diff: str = ""
    """Text added since the previous streamed output of this request."""
    token_ids_diff: list[int] = field(default_factory=list)
    """Tokens added since the previous streamed output of this request."""
    padded_token_ids: list[int] | None = None
    """token_ids padded to max_new_tokens with pad_id (end_id when pad_id is None), as in a batch tensor."""
    generation_logits: torch.Tensor | None = None
    """(len(token_ids), vocab) float32 when the engine was built with gather_generation_logits."""


@dataclass
class GenerationOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_prompt_tokens: int = 0
    """Prompt tokens whose KV cache came from the prefix cache instead of being computed."""
    context_logits: torch.Tensor | None = None
    """(prompt_len, vocab) float32 when the engine was built with gather_context_logits."""
    runtime_dict: dict | None = None
    """With SamplingConfig(return_dict=True): output_ids (and sequence_lengths), read as output[key]."""

    def __getitem__(self, key: str):
        if self.runtime_dict is None:
            raise KeyError(f"{key!r}: a GenerationOutput answers as a dict only for SamplingConfig(return_dict=True); "
                           "read its attributes (text, token_ids, outputs)")
        return self.runtime_dict[key]

    def keys(self):
        return (self.runtime_dict or {}).keys()

    # The first (or only) completion, for the common n = 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def text_diff(self) -> str:
        return self.outputs[0].text_diff

    @property
    def token_ids_diff(self) -> list[int]:
        return self.outputs[0].token_ids_diff

    @property
    def cumulative_logprob(self) -> float | None:
        return self.outputs[0].cumulative_logprob

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @property
    def padded_token_ids(self) -> list[int] | None:
        return self.outputs[0].padded_token_ids

    @property
    def generation_logits(self) -> torch.Tensor | None:
        return self.outputs[0].generation_logits
