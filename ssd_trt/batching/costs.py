"""Seconds per engine step, by shape: timed on the idle engines, then refreshed by every step the engine step runs.
What the load policy's model prices its options with (``policy.py``)."""
from __future__ import annotations

import bisect
import fcntl
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

EMA = 0.2          # weight of the newest observation in the running averages of step and switch times
TARGET_ALONE = "target alone"     # the cost curve of target steps taken while the draft is idle (Engine.alone)


def running_average(old: float | None, new: float, weight: float = EMA) -> float:
    """The exponential running average after ``new`` (``new`` itself as the first value)."""
    return new if old is None else (1 - weight) * old + weight * new


def settling_average(old: float | None, count: int, new: float, memory: float) -> float:
    """The average after ``new``, the ``count + 1``-th observation: the plain mean of the first 1 / ``memory``
    observations, then an exponential running average with weight ``memory`` (a first observation counts once, not
    as the whole history, and the average still follows a drift)."""
    if old is None:
        return new
    return old + max(1.0 / (count + 1), memory) * (new - old)


@dataclass
class CostCurves:
    """Seconds per engine step, by (role, rows, tokens per row): timed on the idle engines (:func:`calibrate`),
    then refreshed by every step the engine step runs. Between measured row counts the cost is interpolated
    linearly; a token count never measured is scaled from the nearest one measured (step cost ~ tokens)."""
    seconds: dict[tuple[str, int, int], float] = field(default_factory=dict)
    # which (rows, tokens) were measured per role, rebuilt when a key is added (the policy asks every round, for
    # every option: a scan of every key per question cost ~10% of an SSD round at one client)
    _index: dict[str, tuple[dict[int, list[int]], int]] = field(default_factory=dict, init=False, repr=False,
                                                                 compare=False)
    _indexed_keys: int = field(default=-1, init=False, repr=False, compare=False)

    def _measured(self, role: str) -> tuple[dict[int, list[int]], int]:
        """For ``role``: the row counts measured per token count (ascending), and the most rows measured."""
        if self._indexed_keys != len(self.seconds):        # keys are only ever added
            by_role: dict[str, dict[int, list[int]]] = {}
            for name, rows, tokens in self.seconds:
                by_role.setdefault(name, {}).setdefault(tokens, []).append(rows)
            self._index = {name: ({t: sorted(r) for t, r in by_tokens.items()},
                                  max(max(r) for r in by_tokens.values())) for name, by_tokens in by_role.items()}
            self._indexed_keys = len(self.seconds)
        return self._index.get(role, ({}, 0))

    def covers(self, role: str, rows: int, tokens: int) -> bool:
        by_tokens, most_rows = self._measured(role)
        return tokens in by_tokens and most_rows >= rows

    def cost(self, role: str, rows: int, tokens: int) -> float:
        by_tokens, _ = self._measured(role)
        if not by_tokens:
            raise KeyError(f"no {role} step was timed")
        nearest = tokens if tokens in by_tokens else min(by_tokens, key=lambda t: (abs(t - tokens), -t))
        scale = 1.0 if nearest == tokens else tokens / nearest
        xs = by_tokens[nearest]
        ys = [self.seconds[(role, x, nearest)] for x in xs]
        if rows <= xs[0]:
            return ys[0] * scale
        if rows >= xs[-1]:
            return ys[-1] * scale
        i = bisect.bisect_right(xs, rows)
        return (ys[i - 1] + (ys[i] - ys[i - 1]) * (rows - xs[i - 1]) / (xs[i] - xs[i - 1])) * scale

    def observe(self, role: str, rows: int, tokens: int, seconds: float) -> None:
        key = (role, rows, tokens)
        self.seconds[key] = running_average(self.seconds.get(key), seconds)

    def calibrate(self, engine, role: str, rows: list[int], token_counts: list[int]) -> None:
        """Time ``engine`` (idle: it is reset) at every (rows, tokens) pair not measured yet."""
        for count in rows:
            wanted = [t for t in token_counts if (role, count, t) not in self.seconds]
            if wanted:
                for tokens, seconds in timed_steps(engine, count, wanted).items():
                    self.seconds[(role, count, tokens)] = seconds


@contextmanager
def timing_alone() -> Iterator[None]:
    """Time steps with no other ssd_trt process on this machine timing its own: Triton loads a model and its
    non-streaming twin at once, each in its own process, and two calibrations on the same cores would each time the
    other's steps into its costs (then every option scored from a shape never run since stays wrong: 1.8x too slow
    for AR at 8 rows, seen as a server speculating where AR was twice as fast). A file lock, released on exit."""
    with open(Path(tempfile.gettempdir()) / "ssd-trt-timing.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def timed_steps(engine, rows: int, token_counts: list[int], context: int = 32, repeats: int = 3
                ) -> dict[int, float]:
    """Seconds of one step of each token count on ``rows`` fresh rows holding ``context`` tokens (median of
    ``repeats``, after one untimed step); leaves the engine reset (it must hold no live rows)."""
    engine.reset(rows)
    engine.forward(np.zeros((rows, context), dtype=np.int64),
                   np.broadcast_to(np.arange(context), (rows, context)).copy())
    out = {}
    for tokens in token_counts:
        positions = np.broadcast_to(context + np.arange(tokens), (rows, tokens)).copy()
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            engine.forward(np.zeros((rows, tokens), dtype=np.int64), positions)
            times.append(time.perf_counter() - started)
            engine.rollback(np.full(rows, context, dtype=np.int32))
        out[tokens] = float(np.median(times[1:]))
    engine.reset(1)
    return out
