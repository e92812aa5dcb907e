"""Visible build steps: each prints its number, name and time, like the seed's ModelLoader."""
from __future__ import annotations

import contextlib
import sys
import time


class StepLog:
    """Announce numbered steps on stderr: `[2/4] Fuse weights ... 0.41 s`."""

    def __init__(self, title: str, total: int, quiet: bool = False):
        self.title, self.total, self.quiet = title, total, quiet
        self.index = 0
        self.start = time.perf_counter()

    def say(self, message: str) -> None:
        if not self.quiet:
            print(message, file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def step(self, name: str):
        self.index += 1
        self.say(f"{self.title} [{self.index}/{self.total}] {name}")
        t0 = time.perf_counter()
        yield
        self.say(f"{self.title} [{self.index}/{self.total}] done in {time.perf_counter() - t0:.2f} s")

    def done(self) -> float:
        elapsed = time.perf_counter() - self.start
        self.say(f"{self.title} done in {elapsed:.2f} s")
        return elapsed


def progress(iterable, desc: str, total: int | None = None, quiet: bool = False):
    """A tqdm progress bar on stderr (silent when quiet)."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=quiet, leave=False, file=sys.stderr)
