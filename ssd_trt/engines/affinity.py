"""Run a block of work on given CPU cores (a "device" on this CPU), then restore the thread's cores."""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Sequence


def pin(cores: Sequence[int] | None) -> None:
    """Pin the calling thread to ``cores`` for good (a worker thread that is one model's device)."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))


@contextmanager
def pinned(cores: Sequence[int] | None) -> Iterator[None]:
    """Linux: sched_setaffinity(0) affects only the calling thread; elsewhere a no-op."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)
