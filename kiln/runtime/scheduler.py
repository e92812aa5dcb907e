"""The scheduler: one rule for every request — compute tokens [num_computed_tokens, num_tokens) — under the
max_num_tokens and max_batch_size budgets. Plain Python, no torch."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache import KVCacheManager
from .request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """The work of one step: each request with the number of new tokens it computes."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    """FCFS. A request is admitted only when blocks for its whole output are free, so none is ever evicted."""

    def __init__(self, kv: KVCacheManager, max_batch_size: int, max_num_tokens: int):
        self.kv, self.max_batch_size, self.max_num_tokens = kv, max_batch_size, max_num_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([(r, r.num_tokens - r.num_computed_tokens) for r in self.running])
        budget = self.max_num_tokens - out.num_tokens
        while self.waiting and len(self.running) < self.max_batch_size:
            request = self.waiting[0]
            n = request.num_tokens - request.num_computed_tokens
            if n > budget or not self.kv.allocate(request, request.max_tokens):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, n))
            budget -= n
        return out

    def update(self, out: SchedulerOutput, sampled: list[int]) -> list[Request]:
        """Advance each scheduled request by its computed tokens and sampled token; return those that finished."""
        finished = []
        for (request, n), token in zip(out.scheduled, sampled):
            request.num_computed_tokens += n
            request.append_token(token)
            if request.finished:
                self.kv.free(request)
                self.running.remove(request)
                finished.append(request)
        return finished
