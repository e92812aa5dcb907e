"""The bounded queue: at most max_batch_size running plus max_queue waiting requests; refuses the rest."""
from __future__ import annotations

from .errors import APIError


class Admission:
    def __init__(self, capacity: int):
        self.capacity, self.active, self.draining = capacity, 0, False

    def acquire(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", "server_shutting_down")
        if self.active >= self.capacity:
            raise APIError(429, f"the server's queue is full ({self.capacity} requests in flight); retry later",
                           "queue_full")
        self.active += 1

    def release(self) -> None:
        self.active -= 1
