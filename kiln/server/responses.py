"""What completions and chat answers share: ids and headers of response bodies, usage, and the per-choice
deltas of a streamed generation (choice index = prompt index × n + sample index)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request

from kiln.runtime.outputs import CompletionOutput, GenerationOutput
from kiln.runtime.request import TokenLogprob

from .generation import Generation
from .logprobs import text_logprobs


class Reply:
    """Identity of one response (id, created, the model asked for, the engine's fingerprint) and where its usage
    is noted for the log line."""

    def __init__(self, request: Request, server, prefix: str, model: str):
        self.state = request.state
        self.id = f"{prefix}-{self.state.request_id}"
        self.created, self.model, self.fingerprint = int(time.time()), model, server.fingerprint

    def body(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices, **extra}

    def usage(self, outputs: list[GenerationOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        self.state.usage = (prompt, completion)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def choices(outputs: list[GenerationOutput], n: int):
    """(choice index, prompt index, completion) of every completion, in order."""
    for i, output in enumerate(outputs):
        for completion in output.outputs:
            yield i * n + completion.index, i, completion


@dataclass
class Delta:
    """What one streamed choice gained: text, logprobs of its new tokens, its finish reason (once)."""

    index: int
    prompt_index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    first: bool


@dataclass
class _Sent:
    tokens: int = 0
    finished: bool = False


@dataclass
class DeltaStream:
    """Deltas of a streamed Generation; `finals` holds each prompt's final output once the stream ends."""

    generation: Generation
    n: int
    finals: dict[int, GenerationOutput] = field(default_factory=dict)

    async def __aiter__(self) -> AsyncIterator[Delta]:
        sent: dict[int, _Sent] = {}
        async for prompt_index, snapshot in self.generation.snapshots():
            for completion in snapshot.outputs:
                delta = _delta(prompt_index * self.n + completion.index, prompt_index, completion, sent)
                if delta is not None:
                    yield delta
            if snapshot.finished:
                self.finals[prompt_index] = snapshot

    def outputs(self) -> list[GenerationOutput]:
        return [self.finals[i] for i in sorted(self.finals)]


def _delta(index: int, prompt_index: int, completion: CompletionOutput, sent: dict[int, _Sent]) -> Delta | None:
    first = index not in sent
    state = sent.setdefault(index, _Sent())
    if state.finished:
        return None
    logprobs = text_logprobs(completion)[state.tokens:]
    state.tokens += len(logprobs)
    state.finished = completion.finish_reason is not None
    if not (first or completion.text_diff or logprobs or state.finished):
        return None
    return Delta(index, prompt_index, completion.text_diff, logprobs, completion.finish_reason, first)
