"""The engine step: requests join and leave between rounds; every round runs all of them together.

    llm = LLMEngine(ssd_trt.load("build/smollm2-135m"))
    rid = llm.add_request(ids, SamplingParams(max_new_tokens=64, temperature=0.7, seed=1), mode="ssd")
    while llm.has_unfinished():
        for output in llm.step():            # new tokens of every request that moved, and which finished
            ...
    result = llm.take_result(rid)

One :meth:`LLMEngine.step` (the shape of nano-vllm's ``LLMEngine.step``):
  1. schedule   take new requests and aborts, admit waiting requests while slots and KV memory allow
                (``scheduler.py``); decide how each runs this round (``planner.py``: adaptive SSD requests by the
                load policy, at the live batch)
  2. run        lay the rows out (``scheduler.py``), prefill the prompts of requests that just joined
                (``decoding/prefill.py``), and run one round over every row (``decoding/round.py``: the draft drafts
                or pre-speculates, the target verifies every row in one forward, each row commits by its own
                parameters and random stream)
  3. report     each request's new tokens and whether it finished (EOS, stop token or string, length, abort); the
                round's metrics, and what it measured for the load policy; finished requests leave

The model engines are the round's (the target, and the draft behind its lane, ``decoding/draft_lane.py``); this
module holds no model state of its own. Thread safety: ``add_request`` and ``abort`` may be called from any thread
while another thread runs ``step``; they take effect at the next step.
"""
from __future__ import annotations

import time
from typing import Protocol

from ssd_trt.batching.metrics import EngineMetrics, Outputs, RequestOutput
from ssd_trt.batching.planner import Plan, RoundPlanner, server_families
from ssd_trt.batching.policy import Learned
from ssd_trt.batching.scheduler import Scheduler
from ssd_trt.decoding.draft_lane import DraftLane, EngineSource
from ssd_trt.decoding.feature_relay import FeatureLog, relay_features
from ssd_trt.decoding.grammar import Grammars
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.prefill import prefill
from ssd_trt.decoding.round import RoundContext, RoundReport, run_round
from ssd_trt.decoding.sequence import SequenceState
from ssd_trt.decoding.settings import DEFAULT_MODE, ResolvedMode, Settings
from ssd_trt.engines.limits import EngineLimits
from ssd_trt.errors import ConfigError
from ssd_trt.options import RuntimeOptions

__all__ = ["LLMEngine", "RequestOutput"]


class LoadedBuild(Protocol):
    """What the engine step uses of a loaded build (``runtime.Generator``)."""
    limits: EngineLimits
    engines: EngineSource
    options: RuntimeOptions
    tokenizer: object
    eos_ids: frozenset[int]
    learned: Learned
    grammars: Grammars

    def decoding_defaults(self, params: SamplingParams | None = None): ...

    def resolve(self, mode: "str | Settings", params: SamplingParams | None = None) -> ResolvedMode: ...

    def check_prompts(self, prompt_ids: list[list[int]], params: SamplingParams, resolved: ResolvedMode
                      ) -> list[list[int]]: ...


class LLMEngine:
    """Continuous batching over a loaded build's model engines (which it then uses: run one LLMEngine at a time per
    build)."""

    def __init__(self, build: LoadedBuild, max_running: int | None = None, max_waiting: int = 1024,
                 kv_budget_tokens: int | None = None, calibrate: bool = False) -> None:
        """``max_running``: requests decoded together (default and at most: the engine's max batch).
        ``max_waiting``: requests queued beyond those; one more is refused (CapacityError).
        ``kv_budget_tokens``: KV-cache slots per engine the running requests may reserve (default: max_running x
        max_context, all the engine can hold); a request that would exceed it waits.
        ``calibrate``: time the engines for the SSD load policy now, at every batch size up to max_running (a server:
        requests arrive while others run). Without it, each time the engines are idle the sizes the known requests
        can reach are timed, and adaptive SSD rows of a larger batch run as set until then."""
        limit, context = build.limits.max_batch, build.limits.max_context
        if max_running is not None and not 1 <= max_running <= limit:
            raise ConfigError(f"max_running must be in 1..{limit} (the engine's max batch), got {max_running}")
        max_running = max_running or limit
        kv_budget_tokens = kv_budget_tokens or max_running * context
        if kv_budget_tokens < context:
            raise ConfigError(f"kv_budget_tokens must hold at least one request of max context {context}, got "
                              f"{kv_budget_tokens}")
        self.build = build
        self.scheduler = Scheduler(max_running, max_waiting, kv_budget_tokens)
        self.lane = DraftLane(build.engines, build.options.draft_cores, build.options.draft_timeout_s)
        self.context = RoundContext(build.engines.get("target"), self.lane)
        self.planner = RoundPlanner(build.learned, max_running)
        self.metrics = EngineMetrics()
        self.created = time.perf_counter()
        if calibrate:
            self.planner.calibrate(server_families(build.decoding_defaults), max_running, self.context.target,
                                   self.lane)

    # -- requests -------------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    mode: "str | Settings | ResolvedMode" = DEFAULT_MODE, request_id: str | None = None,
                    stream: int = 0) -> str:
        """Queue a request (checked now: a RequestError names what is wrong); returns its id. ``mode``: a name, a
        settings object, or a mode the build already resolved for these params. ``stream`` picks one of a seed's
        independent random streams (``generate`` gives each prompt of a batch its own)."""
        params = SamplingParams() if params is None else params
        resolved = mode if isinstance(mode, ResolvedMode) else self.build.resolve(mode, params)
        [ids] = self.build.check_prompts([prompt_ids], params, resolved)
        request_id = self.scheduler.new_id() if request_id is None else str(request_id)
        tokenizer = self.build.tokenizer
        seq = SequenceState.create(request_id, ids, params, resolved, self.build.eos_ids,
                                   lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True), stream)
        if params.grammar is not None:
            seq.grammar = self.build.grammars.state(params.grammar)
        if self.context.target.has_features and resolved.name != "ar":   # its draft reads the target's features
            seq.features = FeatureLog()
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step: its rows are freed, the others continue exactly."""
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def take_result(self, request_id: str) -> SequenceState:
        """A finished request's state (tokens, finish reason, stats, text via ``.text(decode)``); once."""
        return self.scheduler.take_result(request_id)

    # -- the step -------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one round over every running request, report (module doc)."""
        outputs = Outputs()
        for seq in self.scheduler.schedule():       # aborted now
            outputs.emit(seq, [])
            self.metrics.aborted += 1
        if self.scheduler.running:
            plan = self._plan()
            rows, report = self._run(plan, outputs)
            self._report(rows, report, plan, outputs)
        self._end_step(outputs)
        return outputs.list()

    def _plan(self) -> Plan:
        scheduler = self.scheduler
        return self.planner.plan(scheduler.running, len(scheduler.waiting), self.lane, self.context.target,
                                 idle=not (scheduler.target_rows or scheduler.draft_rows),
                                 draft_rows={id(s) for s in scheduler.draft_rows})

    def _run(self, plan: Plan, outputs: Outputs) -> tuple[list[SequenceState], RoundReport]:
        """Lay the rows out, prefill the new ones, hand the draft the features its rows lack (EAGLE-3), run the
        round."""
        scheduler, target = self.scheduler, self.context.target
        scheduler.lay_out(plan.rounds, target, self.lane)
        rounds = [plan.rounds[id(s)] for s in scheduler.target_rows]
        for seq, tokens in prefill(target, scheduler.target_rows, spin=not any(p.works_draft for p in rounds)):
            outputs.emit(seq, tokens)
        if scheduler.draft_rows and not self.lane.failed:
            relay_features(self.lane.engine, scheduler.draft_rows)
        return scheduler.target_rows, run_round(self.context, scheduler.target_rows, rounds, len(scheduler.draft_rows))

    def _report(self, rows: list[SequenceState], report: RoundReport, plan: Plan, outputs: Outputs) -> None:
        for seq, result in zip(rows, report.rows):
            if result is not None:
                outputs.emit(seq, result.committed)
        self.metrics.record(rows, report, self.created)
        self.metrics.record_choices([plan.rounds[id(s)] for s in rows])
        self.planner.observe(rows, report, plan)
        self.metrics.last_choice = self.planner.last_choice

    def _end_step(self, outputs: Outputs) -> None:
        """Requests that ran while the draft failed note it; finished requests leave; with none live, the next
        request starts on fresh rows with a fresh draft engine (the failed one was retired)."""
        if self.lane.failed:
            for seq in self.scheduler.running:
                seq.stats.note_draft_failure(self.lane.failure)
        self.scheduler.retire_finished()
        if not self.scheduler.running:
            self.lane.recover()
        self.metrics.generated_tokens += outputs.tokens
        self.metrics.running, self.metrics.waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        self.metrics.kv_cache_usage = self.scheduler.kv_usage()

    def fan_out(self, settings) -> dict:
        """The fan-out shapes SSD groups with these settings learned (``FanOutPlanners.describe``)."""
        return self.context.fan_outs.describe(settings)

    def close(self) -> None:
        self.lane.close()
