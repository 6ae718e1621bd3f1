"""The engine step's scheduler: which requests run, and on which rows.

* queue      requests arrive from any thread (:meth:`Scheduler.add`, refused past ``max_waiting``) and wait; aborts
             arrive the same way; both take effect at the next step
* admission  waiting requests join while running slots (``max_running``) and KV memory (``kv_budget_tokens``)
             allow, first come first served
* layout     the target's rows in the order [SSD groups | SD chains | SD trees | AR] (``RoundPlan.group``), the
             draft's rows its first rows (the requests that draft this round); the engines' caches are
             rearranged (``Engine.select_rows``) only when the set or its grouping changed, and within a group as
             few rows move as possible
* results    finished requests leave the rows and wait for :meth:`Scheduler.take_result`
"""
from __future__ import annotations

import itertools
import threading
from collections import deque

from ssd_trt.decoding import saguaro
from ssd_trt.decoding.draft_lane import DraftLane
from ssd_trt.decoding.round import RoundPlan
from ssd_trt.decoding.sequence import SequenceState, held_tokens
from ssd_trt.engines.base import Engine
from ssd_trt.errors import RequestError


class CapacityError(RequestError):
    """The engine's waiting queue is full: retry later (or raise ``max_waiting``)."""


class Scheduler:
    def __init__(self, max_running: int, max_waiting: int, kv_budget_tokens: int) -> None:
        self.max_running, self.max_waiting, self.kv_budget_tokens = max_running, max_waiting, kv_budget_tokens
        self._lock = threading.Lock()
        self._incoming: list[SequenceState] = []
        self._aborts: set[str] = set()
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self._results: dict[str, SequenceState] = {}
        self._ids = itertools.count()
        self.target_rows: list[SequenceState] = []      # the target engine's rows, in order
        self.draft_rows: list[SequenceState] = []       # the draft's: the target's first rows

    # -- the queue (any thread) ---------------------------------------------------------------------------------
    def new_id(self) -> str:
        """A request id not in use."""
        known = self._known()
        return next(str(n) for n in self._ids if str(n) not in known)

    def add(self, seq: SequenceState) -> None:
        """Queue a request; refused when its id is in use or the queue is full."""
        with self._lock:
            if seq.request_id in self._known_locked():
                raise RequestError(f"request id {seq.request_id!r} is already in use (running, waiting or not yet "
                                   f"collected with take_result)")
            queued = len(self.waiting) + len(self._incoming)
            if queued >= self.max_waiting:
                raise CapacityError(f"{queued} requests are already waiting for one of {self.max_running} running "
                                    f"slots (max_waiting {self.max_waiting}); retry later")
            self._incoming.append(seq)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(str(request_id))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.running or self.waiting or self._incoming)

    def take_result(self, request_id: str) -> SequenceState:
        if str(request_id) not in self._results:
            raise KeyError(f"request {request_id!r} has not finished (or its result was already taken)")
        return self._results.pop(str(request_id))

    def _known(self) -> set[str]:
        with self._lock:
            return self._known_locked()

    def _known_locked(self) -> set[str]:
        return {s.request_id for s in [*self._incoming, *self.waiting, *self.running]} | set(self._results)

    # -- the step (the step's thread) ---------------------------------------------------------------------------
    def schedule(self) -> list[SequenceState]:
        """Take new requests and aborts, admit what fits; the requests aborted now (finished, their results kept)."""
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
            aborts, self._aborts = self._aborts, set()
        aborted = [s for s in [*self.waiting, *self.running] if s.request_id in aborts and not s.finished]
        for seq in aborted:
            seq.finish("abort")
            (self.waiting if seq in self.waiting else self.running).remove(seq)
            self._results[seq.request_id] = seq
        while self.waiting and len(self.running) < self.max_running and self._fits(self.waiting[0]):
            self.running.append(self.waiting.popleft())
        return aborted

    def _fits(self, seq: SequenceState) -> bool:
        """KV memory: the caches are dense (rows x the longest row), so one more request fits while (rows + 1) x the
        longest request's need (prompt + max new tokens + the mode's headroom) stays within the budget."""
        return self._reserved(self.running + [seq]) <= self.kv_budget_tokens

    @staticmethod
    def _reserved(rows: list[SequenceState]) -> int:
        """The KV slots ``rows`` reserve: rows x the longest one's need (the caches are dense)."""
        return len(rows) * max((len(s.prompt) + s.params.max_new_tokens + s.resolved.settings.headroom
                                for s in rows), default=0)

    def kv_usage(self) -> float:
        """The fraction (0..1) of the KV budget the running requests reserve: what admission checks, so at 1 the next
        request waits (vLLM's kv_cache_usage_perc, for a dense cache)."""
        return min(1.0, self._reserved(self.running) / self.kv_budget_tokens)

    def lay_out(self, plans: dict[int, RoundPlan], target: Engine, lane: DraftLane) -> None:
        """Order the rows by their plans' groups; rearrange the caches only when that order changed. A request that
        leaves the draft's rows drops its speculation; one that joins them starts with the draft knowing nothing of
        it (its history pending)."""
        def group(seq: SequenceState) -> tuple:
            return plans[id(seq)].group
        previous = {id(s): i for i, s in enumerate(self.target_rows)}
        ordered = least_moves(sorted(self.running, key=lambda s: (group(s), previous.get(id(s), len(previous)))),
                              group, previous)
        if [id(s) for s in ordered] != [id(s) for s in self.target_rows]:
            target.select_rows([previous.get(id(s)) for s in ordered])
        drafted = [s for s in ordered if plans[id(s)].drafts]
        before = {id(s): i for i, s in enumerate(self.draft_rows)}
        kept = {id(s) for s in drafted}
        for seq in self.draft_rows:
            if id(seq) not in kept:
                seq.speculation = None
        released: dict[int, int] = {}           # new draft row -> the slots its dropped speculation held
        for index, seq in enumerate(drafted):
            if id(seq) not in before:           # a new draft row: the draft has seen nothing of it
                seq.draft_pending = seq.history[:-1] if seq.tokens else list(seq.prompt)
                seq.speculation = None
            plan = plans[id(seq)]
            if seq.speculation is not None and (plan.kind != "ssd" or plan.settings is None
                                                or len(seq.speculation.tokens) != plan.settings.draft_len):
                if held_tokens(seq.speculation):
                    released[index] = held_tokens(seq.speculation)
                seq.speculation = None
        self.target_rows = ordered
        if drafted and [id(s) for s in drafted] != [id(s) for s in self.draft_rows]:
            order = [before.get(id(s)) for s in drafted]
            lane.run(lambda: lane.engine.select_rows(order))
        saguaro.release_held(lane, released)
        self.draft_rows = [] if lane.failed else drafted

    def retire_finished(self) -> None:
        """Finished requests leave (their rows at the next layout); with none live, the next starts on fresh rows."""
        for seq in [s for s in self.running if s.finished]:
            self.running.remove(seq)
            self._results[seq.request_id] = seq
        if not self.running:
            self.target_rows, self.draft_rows = [], []


def least_moves(ordered: list[SequenceState], group, previous: dict[int, int]) -> list[SequenceState]:
    """``ordered`` (grouped) rearranged within each group so that as many rows as possible keep their index: a row
    that stays in its group's range stays put, the others fill the gaps. A request that leaves then moves one row
    (the group's last) into its place, not every row after it."""
    out: list[SequenceState] = []
    start = 0
    while start < len(ordered):
        stop = start
        while stop < len(ordered) and group(ordered[stop]) == group(ordered[start]):
            stop += 1
        members = ordered[start:stop]
        slots: list[SequenceState | None] = [None] * len(members)
        movers = []
        for seq in members:
            index = previous.get(id(seq))
            if index is not None and start <= index < stop and slots[index - start] is None:
                slots[index - start] = seq
            else:
                movers.append(seq)
        for i in range(len(slots)):
            if slots[i] is None:
                slots[i] = movers.pop(0)
        out += slots
        start = stop
    return out
