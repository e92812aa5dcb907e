"""Visible long steps: numbered build and load steps with their time, tqdm progress bars, and a ticking clock for
steps that report no progress of their own."""
from __future__ import annotations

import contextlib
import sys
import threading
import time

from .memory import peak_memory_note

TICK_AFTER_S = 2.0
"""A step shows its running time once it has run this long (shorter steps print only their two lines)."""
TICK_LOG_S = 30.0
"""Seconds between two showings of a step's running time when stderr is not a terminal."""


class StepLog:
    """Announce numbered steps on stderr: `[2/4] Fuse weights ... done in 0.41 s (peak memory: host 1.20 GiB, GPU
    4.50 GiB)`, the process's peaks so far (a step that raised one shows it); a step still running after
    TICK_AFTER_S shows how long it has run."""

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
        label = f"{self.title} [{self.index}/{self.total}]"
        self.say(f"{label} {name}")
        t0 = time.perf_counter()
        with ticking(f"{label} running", self.quiet):
            yield
        memory = peak_memory_note()
        self.say(f"{label} done in {time.perf_counter() - t0:.2f} s" + (f" ({memory})" if memory else ""))

    def done(self) -> float:
        elapsed = time.perf_counter() - self.start
        self.say(f"{self.title} done in {elapsed:.2f} s")
        return elapsed


def progress(iterable, desc: str, total: int | None = None, quiet: bool = False):
    """A tqdm progress bar on stderr (silent when quiet)."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=quiet, leave=False, file=sys.stderr)


@contextlib.contextmanager
def ticking(desc: str, quiet: bool = False, after_s: float = TICK_AFTER_S, every_s: float | None = None):
    """While the block runs, a line on stderr showing how long it has run (`desc 00:12`), from `after_s` on, shown
    again every `every_s` (None: every second on a terminal, every TICK_LOG_S in a log, where each showing may
    become a line of its own); for work that cannot count its own progress (parsing a file, a library call)."""
    if quiet:
        yield
        return
    every_s = every_s or (1.0 if sys.stderr.isatty() else TICK_LOG_S)
    stop = threading.Event()
    thread = threading.Thread(target=_tick, args=(desc, after_s, every_s, stop), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _tick(desc: str, after_s: float, every_s: float, stop: threading.Event) -> None:
    """ticking's clock: from after_s on, a tqdm line refreshed every every_s until `stop` is set."""
    from tqdm import tqdm

    if stop.wait(after_s):
        return
    bar = tqdm(desc=desc, bar_format="{desc} {elapsed}", leave=False, file=sys.stderr, delay=after_s)
    bar.start_t -= after_s                                  # the clock counts from the start of the block
    bar.delay = 0                                           # shown from now on, and cleared when closed
    while True:
        bar.refresh()
        if stop.wait(every_s):
            break
    bar.close()
