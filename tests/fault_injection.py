"""A fake fault injector for the serving loop's tests: an engine step (``batching.engine.LLMEngine``) that fails on
purpose. Test-only: it reads the scheduler's private result table to tell what the engine still holds."""
from __future__ import annotations

import random
import threading
import time
from typing import Any

from ssd_trt.batching.engine import LLMEngine, RequestOutput
from ssd_trt.errors import EngineError


class InjectedFault(EngineError):
    """A step failed on purpose."""


class StepThreadKilled(BaseException):
    """Ends the step thread: what no ``except Exception`` catches (as a KeyboardInterrupt or SystemExit would)."""


class FaultInjector:
    """An LLMEngine whose steps raise at random (``fail_rate``, seeded): half before the real step (nothing ran),
    half after it (it ran, its outputs are lost: the hard case, finished requests wait in the scheduler unseen).
    :meth:`kill` makes the next step end the step thread; :meth:`hang` makes the next step block until released."""

    def __init__(self, llm: LLMEngine, fail_rate: float = 0.0, seed: int = 0) -> None:
        self.llm, self.fail_rate = llm, fail_rate
        self.random = random.Random(seed)
        self.failures = 0
        self._kill = threading.Event()
        self._hang = threading.Event()
        self.released = threading.Event()

    def __getattr__(self, name: str) -> Any:         # everything else is the real engine's
        return getattr(self.llm, name)

    def kill(self) -> None:
        self._kill.set()

    def hang(self) -> None:
        self.released.clear()
        self._hang.set()

    def step(self) -> list[RequestOutput]:
        if self._kill.is_set():
            self._kill.clear()
            raise StepThreadKilled("the step thread was killed by the fault injector")
        if self._hang.is_set():
            self._hang.clear()
            self.released.wait(60)
        draw = self.random.random()
        if draw < self.fail_rate / 2:
            self.failures += 1
            raise InjectedFault("injected before the step")
        outputs = self.llm.step()
        if draw < self.fail_rate:
            self.failures += 1
            raise InjectedFault(f"injected after the step ({len(outputs)} outputs lost)")
        return outputs

    def held(self) -> dict[str, int]:
        """What the engine holds: requests queued, waiting, running, results not taken, rows laid out."""
        scheduler = self.llm.scheduler
        return {"unfinished": int(scheduler.has_unfinished()), "waiting": len(scheduler.waiting),
                "running": len(scheduler.running), "results": len(scheduler._results),   # noqa: SLF001
                "target_rows": len(scheduler.target_rows), "draft_rows": len(scheduler.draft_rows)}


def nothing_held(injector: FaultInjector, timeout: float = 10.0) -> dict[str, int]:
    """The engine's holdings once they are all gone (or as they are at ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        held = injector.held()
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.05)
