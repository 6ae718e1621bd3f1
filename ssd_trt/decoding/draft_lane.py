"""The draft's lane: the draft engine, the one worker thread its jobs run on (pinned to the draft's cores), how long a
job may take, and what happens when the draft fails.

Every use of the draft engine is a job on this thread, in order: SD's chains and trees and SSD's backups the round
waits for (:meth:`DraftLane.run`), SSD's speculation that runs while the target verifies (:meth:`DraftLane.submit`,
collected with :meth:`DraftLane.result`). So one thread touches the draft engine, and one place decides what a
failure is: a job that raises, runs past the timeout, or returns what its own checks refuse (each job validates
its result on the thread before returning it). The lane then records the failure, retires the engine (a job that
hung may still be running on it, so it is never used again) and runs nothing more: every request goes on
without the draft, exactly, as autoregressive rounds. Once no request is live the engine step lets the lane
:meth:`recover`: the next job opens a fresh draft engine.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol

import numpy as np

from ssd_trt.engines.affinity import pin
from ssd_trt.engines.base import Engine


class EngineSource(Protocol):
    """Where the lane gets its engine (a build's ``EngineSet``): opened on first use, retired after a failure."""
    opened: dict[str, Engine]

    def get(self, role: str) -> Engine: ...

    def retire(self, role: str) -> None: ...


class DraftLane:
    def __init__(self, engines: EngineSource, cores: tuple[int, ...] | None, timeout_s: float) -> None:
        self._engines, self._cores, self.timeout_s = engines, cores, timeout_s
        self.failure: BaseException | None = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def failed(self) -> bool:
        return self.failure is not None

    @property
    def engine(self) -> Engine:
        """The draft engine: use it inside a job, or while no job runs."""
        return self._engines.get("draft")

    def rows(self, first: int, stop: int) -> Engine:
        """A view of draft rows ``first`` .. ``stop`` - 1 (``Engine.rows``)."""
        return self.engine.rows(first, stop)

    def run(self, job: Callable[..., Any], *args: Any) -> Any:
        """``job(*args)`` on the draft's thread, waited for (at most the timeout): its result, or None when the draft
        failed (in this job or before)."""
        return self.result(self.submit(job, *args))

    def submit(self, job: Callable[..., Any], *args: Any) -> Future | None:
        """Start ``job(*args)`` on the draft's thread; collect it with :meth:`result`. None once the draft failed."""
        if self.failed:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ssd-draft", initializer=pin,
                                            initargs=(self._cores,))
        return self._pool.submit(job, *args)

    def result(self, pending: Future | None) -> Any:
        """A submitted job's result, waited for at most the timeout; None when the draft failed (in it or before)."""
        if pending is None:
            return None
        try:
            return pending.result(timeout=self.timeout_s)
        except Exception as failure:  # noqa: BLE001 -- raised, hung or refused: the requests go on without the draft
            self.fail(failure)
            return None

    def fail(self, failure: BaseException) -> None:
        """Stop using the draft: its engine is retired (its KV slots given back when it still answers) and the
        jobs not started yet are cancelled."""
        if self.failed:
            return
        self.failure = failure
        engine = self._engines.opened.get("draft")
        self._engines.retire("draft")
        if engine is not None:
            try:
                engine.rollback(np.zeros_like(engine.lengths))
            except Exception:  # noqa: BLE001 -- a broken engine may refuse even that; it is never used again
                pass
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def recover(self) -> None:
        """No request is live: forget a failure; the next job opens a fresh draft engine."""
        self.failure = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=not self.failed)
            self._pool = None
