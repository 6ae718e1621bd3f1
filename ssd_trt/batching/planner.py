"""How each running request runs the next round, and what the rounds teach the load policy.

* An AR request runs autoregressive rounds, an SD request SD rounds with its settings; once the draft failed, every
  request runs autoregressive rounds.
* An SSD request that set K runs it every round; a miss backup it left to the engine (``backup="auto"``) is the one
  the load policy's model scores higher at the live batch (``policy.miss_backup``).
* An adaptive SSD request (K and budget left to the build) runs what its family's load policy chooses at the live
  batch: an autoregressive round (speculation paused), SD rounds with K', or SSD with K' and a backup
  (``policy.LoadPolicy``). The choice needs the engines' step times at the shapes the options are scored by
  (``policy.step_shapes``): they are timed while the engines hold no live rows, for the batch sizes the requests
  known then can reach; a batch that outgrows them while rows are live runs as set until the engines are idle
  again.

After the round, :meth:`RoundPlanner.observe` files what it measured: the target step's time, each SSD request's
yield (accepted tokens by source, lookups), and the seconds of the round each policy chose.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ssd_trt.batching.costs import TARGET_ALONE, timing_alone
from ssd_trt.batching.policy import Choice, Learned, LoadPolicy, miss_backup, step_shapes
from ssd_trt.decoding.draft_lane import DraftLane
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.round import RoundPlan, RoundReport
from ssd_trt.decoding.sequence import SequenceState
from ssd_trt.decoding.settings import SD, SSD
from ssd_trt.engines.base import Engine
from ssd_trt.engines.cuda_graphs import doubling_sizes

AR_ROUND = RoundPlan("ar", None)


@dataclass
class Plan:
    """The next round: each request's plan (by ``id(seq)``), the policies that chose and what they chose."""
    rounds: dict[int, RoundPlan] = field(default_factory=dict)
    chosen: list[tuple[LoadPolicy, Choice]] = field(default_factory=list)


class RoundPlanner:
    def __init__(self, learned: Learned, max_running: int) -> None:
        self.learned, self.max_running = learned, max_running
        self.last_choice: dict = {}         # the last policy choice: batch, option, every option's score

    def plan(self, running: list[SequenceState], waiting: int, lane: DraftLane, target: Engine, idle: bool,
             draft_rows: set[int]) -> Plan:
        """Each of the ``running`` requests' next round (``waiting``: requests queued behind them; ``idle``: the
        engines hold no live rows, so their steps may be timed; ``draft_rows``: ids of the requests the draft holds
        a row for)."""
        batch, plan, families = len(running), Plan(), {}
        for seq in running:
            mode, settings = seq.resolved, seq.resolved.settings
            if mode.name == "ar" or lane.failed:
                plan.rounds[id(seq)] = AR_ROUND
            elif mode.name == "sd":
                plan.rounds[id(seq)] = RoundPlan("sd", settings)
            elif not mode.adaptive:
                rows = sum(s.resolved.settings == settings for s in running)
                backup = miss_backup(settings, batch, self.learned.costs, self.learned.yield_of(settings), rows)
                plan.rounds[id(seq)] = RoundPlan("ssd", settings.speculating(settings.draft_len, backup))
            else:
                if settings not in families:
                    if idle:      # every request known now may run at once: time the batch sizes up to theirs
                        self.calibrate([settings], batch + waiting, target, lane)
                    families[settings] = self._choose(settings, running, draft_rows)
                chosen = families[settings].settings          # None: speculation paused
                plan.rounds[id(seq)] = RoundPlan("sd" if isinstance(chosen, SD) else "ssd", chosen, settings)
        plan.chosen = [(self.learned.policy(family), choice) for family, choice in families.items()]
        return plan

    def _choose(self, family: SSD, running: list[SequenceState], draft_rows: set[int]) -> Choice:
        batch, members = len(running), [s for s in running if s.resolved.adaptive and s.resolved.settings == family]
        if self.learned.timed_up_to.get(timing_key(family), 0) < batch:
            # not timed at this batch size (it grew while rows were live): as set, until the engines are idle again
            choice = Choice("as set", family.speculating(family.draft_len, miss_backup(
                family, batch, self.learned.costs, self.learned.yield_of(family), len(members))), {})
        else:
            # tokens the draft must feed before these requests can speculate: what their draft rows missed, and the
            # whole history of those it holds no row for
            backlog = sum(len(s.draft_pending) if id(s) in draft_rows else len(s.prompt) + len(s.tokens)
                          for s in members)
            choice = self.learned.policy(family).choose(family, batch, self.learned.costs,
                                                        self.learned.yield_of(family), backlog, len(members))
        self.last_choice = {"batch": batch, "chose": choice.name, **choice.scores}
        return choice

    def calibrate(self, families: list[SSD], rows: int, target: Engine, lane: DraftLane) -> None:
        """Time the engines (which must hold no live rows) at the step shapes the policy scores ``families``' options
        by (``policy.step_shapes``), for the batch sizes up to ``rows`` (doubling, up to max_running). A one-prompt
        ``generate`` so times one row, not sixteen (~16 s of steps on a 2-core CPU); a server calibrates every size
        at load."""
        all_sizes = doubling_sizes(1, self.max_running)
        top = next(size for size in all_sizes if size >= min(max(rows, 1), self.max_running))
        sizes = [size for size in all_sizes if size <= top]
        costs = self.learned.costs
        for family in families:
            key = timing_key(family)
            if self.learned.timed_up_to.get(key, 0) >= top or lane.failed:
                continue
            shapes = step_shapes(family)
            with timing_alone():
                costs.calibrate(target, "target", sizes, shapes.get("target", []))
                with target.alone():
                    costs.calibrate(target, TARGET_ALONE, sizes, shapes.get(TARGET_ALONE, []))
                costs.calibrate(lane.engine, "draft", sizes, shapes.get("draft", []))
            self.learned.timed_up_to[key] = top

    def observe(self, rows: list[SequenceState], report: RoundReport, plan: Plan) -> None:
        """What the round measured: the target step's seconds, each SSD request's yield, each policy's round."""
        verify_s = report.verify[1] - report.verify[0]
        self.learned.costs.observe(TARGET_ALONE if report.alone else "target", len(rows), report.width, verify_s)
        for seq, result in zip(rows, report.rows):
            round_plan = plan.rounds[id(seq)]
            if result is None or result.proposal is None or seq.resolved.name != "ssd":
                continue
            measured = self.learned.yield_of(seq.resolved.settings)
            measured.observe_round(round_plan.settings.draft_len, result.proposal, result.accepted)
            if result.lookup is not None:
                measured.observe_lookup(result.lookup.hit)
        for policy, choice in plan.chosen:     # how long the round the policy chose took (prefill excluded)
            policy.observe(choice, report.settled - report.started)


def timing_key(family: SSD) -> tuple[int, int]:
    """Families whose options are scored at the same step shapes share their timings."""
    return family.draft_len, family.fan_out_budget


def server_families(defaults_for) -> list[SSD]:
    """The adaptive SSD families a server sees first: the build's defaults for greedy and for sampled requests (their
    K and budget may differ)."""
    return [SSD().resolved(defaults_for(params)) for params in (SamplingParams(), SamplingParams(temperature=1.0))]
