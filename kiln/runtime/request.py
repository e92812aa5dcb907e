"""A request as the scheduler sees it: token ids, progress counters and blocks. No torch here."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .sampling import SamplingConfig


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request. Tokens [0, num_computed_tokens) are in the KV cache; the rest still need a forward."""

    request_id: int
    prompt_token_ids: list[int]
    sampling: SamplingConfig
    end_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    context_logits: object = None          # (prompt_len, vocab) tensor when the engine gathers them
    generation_logits: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        """Tokens this request holds when it has generated everything it may."""
        return self.num_prompt_tokens + self.sampling.max_new_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token: int) -> None:
        """Record a sampled token and finish the request when it hits an end id or its length limit."""
        self.output_token_ids.append(token)
        if token in self.end_ids:
            self.finish("stop")
        elif len(self.output_token_ids) >= self.sampling.max_new_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = RequestStatus.FINISHED, reason
