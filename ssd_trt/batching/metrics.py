"""What the engine step reports: each request's new tokens per step (:class:`RequestOutput`), and the totals over every
round it ran (:class:`EngineMetrics`: what Triton's metrics and ``generate``'s statistics read)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ssd_trt.decoding.logprobs import TokenLogprob
from ssd_trt.decoding.round import RoundPlan, RoundReport
from ssd_trt.decoding.sequence import SequenceState

TIMELINE_ROUNDS = 200      # SSD rounds whose timeline is kept (bench/plots.py draws the first ones)


@dataclass
class RequestOutput:
    """What one step did for one request."""
    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None
    new_logprobs: list[TokenLogprob] = field(default_factory=list)   # the new tokens', when the request asked


class Outputs:
    """One step's outputs, a request's tokens in the order they were committed."""

    def __init__(self) -> None:
        self._by_request: dict[str, RequestOutput] = {}

    def emit(self, seq: SequenceState, tokens: list[int]) -> None:
        out = self._by_request.setdefault(seq.request_id, RequestOutput(seq.request_id, [], False, None))
        out.new_tokens += tokens
        if seq.params.logprobs is not None and tokens:      # (commit kept them alongside the tokens)
            out.new_logprobs += seq.logprobs[len(seq.logprobs) - len(tokens):]
        out.finished, out.finish_reason = seq.finished, seq.finish_reason

    def list(self) -> list[RequestOutput]:
        return list(self._by_request.values())

    @property
    def tokens(self) -> int:
        return sum(len(out.new_tokens) for out in self._by_request.values())


@dataclass
class EngineMetrics:
    """Totals over every round this engine ran."""
    steps: int = 0
    generated_tokens: int = 0
    speculative_rounds: int = 0          # row-rounds that verified drafted tokens
    drafted: int = 0
    accepted: int = 0
    lookups: int = 0
    hits: int = 0
    active_batch: int = 0                # rows in the last round
    running: int = 0                     # requests admitted and not finished
    waiting: int = 0
    kv_cache_usage: float = 0.0          # the fraction of the KV budget the running requests reserve (0..1)
    aborted: int = 0                     # requests stopped by abort()
    accepted_per_pos: Counter = field(default_factory=Counter)   # position i: drafts whose i-th token was accepted
    backup_rounds: Counter = field(default_factory=Counter)      # SSD cache misses, by what proposed instead
    adaptive_rounds: Counter = field(default_factory=Counter)    # adaptive SSD row-rounds by the kind the policy chose
    last_choice: dict = field(default_factory=dict)
    verify_s: float = 0.0                # the target's forwards
    draft_s: float = 0.0                 # the draft's work: drafting in turn, and speculation beside the verification
    wait_s: float = 0.0                  # the target waiting for the draft after its forward
    timeline: list = field(default_factory=list)   # SSD rounds (capped): what overlapped what

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted(self) -> float | None:
        return self.accepted / self.speculative_rounds if self.speculative_rounds else None

    @property
    def cache_hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None

    def record(self, rows: list[SequenceState], report: RoundReport, origin: float) -> None:
        """One round's results and times (``origin``: the engine's creation, where its timeline starts); each row's
        own statistics too."""
        self.steps += 1
        self.active_batch = len(rows)
        for seq, result in zip(rows, report.rows):
            if result is None or result.proposal is None:
                continue
            seq.stats.record_round(result.accepted)
            self.speculative_rounds += 1
            self.drafted += result.drafted
            self.accepted += result.accepted
            for position in range(result.accepted):     # accepted tokens are a prefix of the draft
                self.accepted_per_pos[position] += 1
            if result.lookup is not None:
                seq.stats.record_lookup(result.accepted, result.lookup.hit)
                self.lookups += 1
                self.hits += result.lookup.hit
                if result.lookup.backup is not None:
                    seq.stats.backup_rounds[result.lookup.backup] += 1
                    self.backup_rounds[result.lookup.backup] += 1
        verify_started, verified = report.verify
        self.verify_s += verified - verify_started
        self.wait_s += max(0.0, report.collected - verified)
        # the draft's time: what the round waited for before verifying, and its speculation beside the verification
        self.draft_s += verify_started - report.started + sum(c.finished - c.started for c in report.speculations)
        # a round whose speculating rows had all finished before it (None results) has nothing to plot
        speculated = any(report.rows[i] is not None for i in report.ssd_rows)
        if report.speculations and speculated and len(self.timeline) < TIMELINE_ROUNDS:
            self.timeline.append(timeline_entry(len(self.timeline), report, origin))

    def record_choices(self, plans: list[RoundPlan]) -> None:
        """What the load policy chose for each adaptive SSD row this round: ar (speculation paused), sd or ssd."""
        for plan in plans:
            if plan.family is not None:
                self.adaptive_rounds["ar" if plan.settings is None else plan.kind] += 1


def timeline_entry(index: int, report: RoundReport, origin: float) -> dict:
    """One SSD round for the overlap plot: when the target verified and the draft speculated, the hits and backups."""
    lookups = [report.rows[i].lookup for i in report.ssd_rows if report.rows[i] is not None]
    verify_started, verified = report.verify
    return {"round": index, "submitted": verify_started - origin, "verify": [verify_started - origin, verified - origin],
            "draft": [min(c.started for c in report.speculations) - origin,
                      max(c.finished for c in report.speculations) - origin],
            "hits": sum(lookup is not None and lookup.hit for lookup in lookups),
            "backup": sum(lookup is not None and lookup.backup is not None for lookup in lookups),
            "backup_s": report.settled - report.collected, "rows": len(report.rows),
            "accepted": [report.rows[i].accepted for i in report.ssd_rows if report.rows[i] is not None],
            "source": [report.rows[i].proposal for i in report.ssd_rows if report.rows[i] is not None]}
