"""The bounded queue: at most max_batch_size running plus max_queue waiting requests; refuses the rest. It knows
who holds each slot, so that a slot is given back once at most, and so that a shutdown can end them all."""
from __future__ import annotations

from typing import Protocol

from .errors import APIError


class Holder(Protocol):
    def stop(self) -> None:
        """End now: the server is stopping."""


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", "server_shutting_down")


class Admission:
    def __init__(self, capacity: int):
        self.capacity, self.draining = capacity, False
        self.holders: set[Holder] = set()

    @property
    def active(self) -> int:
        return len(self.holders)

    def acquire(self, holder: Holder) -> None:
        if self.draining:
            raise shutting_down()
        if self.active >= self.capacity:
            raise APIError(429, f"the server's queue is full ({self.capacity} requests in flight); retry later",
                           "queue_full")
        self.holders.add(holder)

    def release(self, holder: Holder) -> None:
        self.holders.discard(holder)

    def stop_all(self) -> None:
        """The shutdown deadline has passed: every admitted request ends now (each answers 503 itself)."""
        for holder in list(self.holders):
            holder.stop()
