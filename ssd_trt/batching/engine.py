"""The engine step: requests join and leave between rounds; every round runs all of them together.

    engine = LLMEngine(ssd_trt.load("build/smollm2-135m"))
    rid = engine.add_request(ids, SamplingParams(max_new_tokens=64, temperature=0.7, seed=1), mode="ssd")
    while engine.has_unfinished():
        for output in engine.step():         # new tokens of every request that moved, and which finished
            ...
    result = engine.take_result(rid)

One :meth:`LLMEngine.step` (the shape of nano-vllm's ``LLMEngine.step``):
  1. schedule   take new requests and aborts; admit waiting requests while slots and KV memory allow
                (``max_running``, at most the engine's max batch); decide how each runs this round
                (``policy.py``: adaptive SSD rows may run without speculation, or with a shorter K, at load)
  2. lay out    the target's rows in the order [SSD groups | SD | AR] (the draft holds the first two, the
                same rows); the engines' caches are rearranged (``Engine.select_rows``) only when the set or
                its grouping changed; the prompts of requests that just joined are prefilled on their own
                rows (``Engine.rows``; on the draft's cores too, idle between rounds) and their first token
                sampled
  3. one round  (``round.py``) the draft proposes for SD rows (and SSD rows without a ready speculation);
                the draft pre-speculates for SSD rows on its own core while the target verifies every row in
                one forward (AR rows feed one token); each row commits by its own parameters and random
                stream; SSD rows look up their next speculation and back up on a miss
  4. report     each request's new tokens, and the requests that finished (EOS, stop token or string,
                length, abort); finished requests leave the rows at the next step

Thread safety: ``add_request`` and ``abort`` may be called from any thread while another thread runs
``step``; they take effect at the next step.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ssd_trt.batching.policy import TARGET_ALONE, Choice, CostCurves, LoadPolicy, Yield
from ssd_trt.batching.round import RoundPlan, run_round
from ssd_trt.batching.sequence import SequenceState
from ssd_trt.decoding.fan_out import FanOutPlanner
from ssd_trt.decoding.feature_relay import FeatureLog, relay_features, target_features
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.sampling import draw_rows
from ssd_trt.decoding.settings import DEFAULT_MODE, SD, SSD, Settings, settings_for
from ssd_trt.engines.affinity import pin
from ssd_trt.engines.cuda_graphs import doubling_sizes
from ssd_trt.engines.feeding import feed_ragged
from ssd_trt.errors import RequestError


def is_adaptive(mode: "str | Settings") -> bool:
    """An SSD request that leaves K and the budget to the build adapts them to the load (``policy.py``)."""
    settings = settings_for(mode)
    return isinstance(settings, SSD) and settings.draft_len is None and settings.fan_out_budget is None


def least_moves(ordered: list[SequenceState], group, previous: dict[int, int]) -> list[SequenceState]:
    """``ordered`` (grouped) rearranged within each group so that as many rows as possible keep their index:
    a row that stays in its group's range stays put, the others fill the gaps. A request that leaves then
    moves one row (the group's last) into its place, not every row after it."""
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


class CapacityError(RequestError):
    """The engine's waiting queue is full: retry later (or raise ``max_waiting``)."""


@dataclass
class RequestOutput:
    """What one step did for one request."""
    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None


@dataclass
class EngineMetrics:
    """Totals over every round this engine ran (what Triton's metrics report)."""
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
    aborted: int = 0                     # requests stopped by abort()
    last_choice: dict = field(default_factory=dict)
    verify_s: float = 0.0                # the target's forwards
    draft_s: float = 0.0                 # the draft's speculation jobs (overlapping the verification)
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


class LLMEngine:
    """Continuous batching over a loaded :class:`~ssd_trt.runtime.Generator`'s engines (which it then owns:
    run one LLMEngine at a time per Generator)."""

    def __init__(self, generator, max_running: int | None = None, max_waiting: int = 1024,
                 kv_budget_tokens: int | None = None, calibrate: bool = False) -> None:
        """``max_running``: requests decoded together (default and at most: the engine's max batch).
        ``max_waiting``: requests queued beyond those; one more is refused (CapacityError).
        ``kv_budget_tokens``: KV-cache slots per engine the running requests may reserve (default: max_running x
        max_context, all the engine can hold); a request that would exceed it waits.
        ``calibrate``: time the engines for the SSD load policy now, at every batch size up to max_running (a
        server: requests arrive while others run). Without it, each time the engines are idle the sizes the
        known requests can reach are timed, and adaptive SSD rows of a larger batch run as set until then."""
        limit, context = generator.limits.max_batch, generator.limits.max_context
        if max_running is not None and not 1 <= max_running <= limit:
            raise RequestError(f"max_running must be in 1..{limit} (the engine's max batch), got {max_running}")
        self.generator = generator
        self.max_running = max_running or limit
        self.max_waiting = max_waiting
        self.kv_budget_tokens = kv_budget_tokens or self.max_running * context
        if self.kv_budget_tokens < context:
            raise RequestError(f"kv_budget_tokens must hold at least one request of max context {context}, got "
                               f"{self.kv_budget_tokens}")
        self.metrics = EngineMetrics()
        self.created = time.perf_counter()
        self._lock = threading.Lock()
        self._incoming: list[SequenceState] = []
        self._aborts: set[str] = set()
        self._waiting: deque[SequenceState] = deque()
        self._running: list[SequenceState] = []
        self._results: dict[str, SequenceState] = {}
        self._target_rows: list[SequenceState] = []      # the target engine's rows, in order
        self._draft_rows: list[SequenceState] = []       # the draft's: the target's first rows
        self._ids = itertools.count()
        self._planners: dict[SSD, FanOutPlanner] = {}
        self._yields: dict[SSD, Yield] = generator.ssd_yields          # the Generator's: kept across requests
        self._policies: dict[SSD, LoadPolicy] = generator.load_policies
        self.draft_failure: BaseException | None = None
        placement = generator.options.placement("draft")
        self._draft_cores, self.draft_timeout_s = placement.cores, placement.timeout_s
        self._pool: ThreadPoolExecutor | None = None
        self.costs: CostCurves = generator.cost_curves
        # a target exported for a feature draft (EAGLE-3): requests that use the draft keep its features
        self._relays_features = generator.engine("target").has_features
        self._calibrated: dict[tuple[int, int], int] = {}     # (K, budget) -> batch sizes timed up to
        if calibrate:       # SSD's defaults for greedy and for sampled requests (their K and budget may differ)
            self._calibrate([SSD().resolved(generator.decoding_defaults(params))
                             for params in (SamplingParams(), SamplingParams(temperature=1.0))], self.max_running)

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    mode: "str | Settings" = DEFAULT_MODE, request_id: str | None = None, stream: int = 0) -> str:
        """Queue a request (checked now: a RequestError names what is wrong); returns its id. ``stream`` picks
        one of a seed's independent random streams (``generate`` gives each prompt of a batch its own)."""
        params = SamplingParams() if params is None else params
        [ids], resolved = self.generator.check_request([prompt_ids], params, mode)
        with self._lock:
            known = {s.request_id for s in [*self._incoming, *self._waiting, *self._running]} | set(self._results)
        if request_id is None:
            request_id = next(str(n) for n in self._ids if str(n) not in known)
        request_id = str(request_id)
        if request_id in known:
            raise RequestError(f"request id {request_id!r} is already in use (running, waiting or not yet "
                               f"collected with take_result)")
        tokenizer = self.generator.tokenizer
        seq = SequenceState.create(request_id, ids, params, resolved, self.generator.eos_ids,
                                   lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True), stream,
                                   adaptive=is_adaptive(mode))
        if self._relays_features and resolved.name != "ar":    # its draft will read the target's features
            seq.features = FeatureLog()
        with self._lock:
            queued = len(self._waiting) + len(self._incoming)
            if queued >= self.max_waiting:
                raise CapacityError(f"{queued} requests are already waiting for one of {self.max_running} "
                                    f"running slots (max_waiting {self.max_waiting}); retry later")
            self._incoming.append(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step: its rows are freed, the others continue exactly."""
        with self._lock:
            self._aborts.add(str(request_id))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._running or self._waiting or self._incoming)

    def take_result(self, request_id: str) -> SequenceState:
        """A finished request's state (tokens, finish reason, stats, text via ``.text(decode)``); once."""
        if str(request_id) not in self._results:
            raise KeyError(f"request {request_id!r} has not finished (or its result was already taken)")
        return self._results.pop(str(request_id))

    # -- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        self._schedule(outputs)
        if self._running:
            plans, chosen = self._plan(self._running)
            self._lay_out(plans)
            self._prefill([seq for seq in self._target_rows if seq.unfed is None and not seq.tokens], outputs)
            if self._draft_rows and self.draft_failure is None:      # features the draft's rows lack (EAGLE-3)
                relay_features(self.generator.engine("draft"), self._draft_rows)
            started = time.perf_counter()
            run_round(self, plans, outputs)
            for policy, choice in chosen:     # how long the round the policy chose took (prefill excluded)
                policy.observe(choice, time.perf_counter() - started)
            self.metrics.steps += 1
            self.metrics.active_batch = len(self._target_rows)
        for seq in [s for s in self._running if s.finished]:
            self._running.remove(seq)
            self._results[seq.request_id] = seq
        self.metrics.running = len(self._running)
        if not self._running:                  # nothing live: the next request starts on fresh rows
            self._target_rows, self._draft_rows = [], []
            self.draft_failure = None          # and with a fresh draft engine (the failed one was retired)
        return list(outputs.values())

    def emit(self, outputs: dict[str, RequestOutput], seq: SequenceState, tokens: list[int]) -> None:
        out = outputs.setdefault(seq.request_id, RequestOutput(seq.request_id, [], False, None))
        out.new_tokens += tokens
        out.finished, out.finish_reason = seq.finished, seq.finish_reason
        self.metrics.generated_tokens += len(tokens)

    def _schedule(self, outputs: dict[str, RequestOutput]) -> None:
        with self._lock:
            self._waiting.extend(self._incoming)
            self._incoming.clear()
            aborts, self._aborts = self._aborts, set()
        for seq in [s for s in self._waiting if s.request_id in aborts]:
            self._waiting.remove(seq)
            seq.finish("abort")
            self.metrics.aborted += 1
            self._results[seq.request_id] = seq
            self.emit(outputs, seq, [])
        for seq in [s for s in self._running if s.request_id in aborts and not s.finished]:
            seq.finish("abort")
            self.metrics.aborted += 1
            self.emit(outputs, seq, [])
            self._running.remove(seq)
            self._results[seq.request_id] = seq
        while self._waiting and len(self._running) < self.max_running and self._fits(self._waiting[0]):
            self._running.append(self._waiting.popleft())
        self.metrics.waiting = len(self._waiting)

    def _fits(self, seq: SequenceState) -> bool:
        """KV memory: the caches are dense (rows x the longest row), so one more request fits while
        (rows + 1) x the longest request's need (prompt + max new tokens + the mode's headroom) stays within
        the budget."""
        need = max(len(s.prompt) + s.params.max_new_tokens + s.resolved.headroom for s in self._running + [seq])
        return (len(self._running) + 1) * need <= self.kv_budget_tokens

    def _plan(self, running: list[SequenceState]) -> tuple[dict[int, RoundPlan], list[tuple[LoadPolicy, Choice]]]:
        """How each request runs this round. Adaptive SSD requests (K and budget left to the build) follow the
        load policy for the live batch (``policy.py``); a request that set K runs as set; without a working
        draft, every request runs AR rounds. Also: the policies that chose, and what."""
        batch, plans = len(running), {}
        choices: dict[SSD, tuple[LoadPolicy, Choice]] = {}
        for seq in running:
            name, settings = seq.resolved.name, seq.resolved.settings
            if name == "ar" or self.draft_failure is not None:
                plans[id(seq)] = RoundPlan("ar", None)
            elif name == "sd":
                plans[id(seq)] = RoundPlan("sd", settings)
            elif not seq.adaptive:
                plans[id(seq)] = RoundPlan("ssd", settings)
            else:
                if settings not in choices:
                    # every request known now may run at once: time the batch sizes up to theirs
                    self._calibrate([settings], len(running) + len(self._waiting))
                    policy = self._policies.setdefault(settings, LoadPolicy())
                    if self._calibrated.get(self._calibration_key(settings), 0) < batch:
                        # this batch size was not timed (rows were live when it came): as set, until the
                        # engines are idle again and it is calibrated
                        choice = Choice("as set", settings, {})
                    else:
                        choice = policy.choose(settings, batch, self.costs, self.yield_of(settings),
                                               self._draft_backlog(running, settings))
                    choices[settings] = (policy, choice)
                    self.metrics.last_choice = {"batch": batch, "chose": choices[settings][1].name,
                                                **choices[settings][1].scores}
                chosen = choices[settings][1].settings          # None: speculation paused
                plans[id(seq)] = RoundPlan("sd" if isinstance(chosen, SD) else "ssd", chosen, settings)
        return plans, list(choices.values())

    def _draft_backlog(self, running: list[SequenceState], family: SSD) -> int:
        """Tokens the draft must feed before the adaptive SSD requests of ``family`` can speculate: what their
        draft rows missed, and the whole history of those it holds no row for."""
        drafted = {id(s) for s in self._draft_rows}
        return sum(len(s.draft_pending) if id(s) in drafted else len(s.prompt) + len(s.tokens)
                   for s in running if s.adaptive and s.resolved.settings == family)

    def _calibration_key(self, settings: SSD) -> tuple[int, int]:
        return settings.draft_len, settings.fan_out_budget

    def _calibrate(self, settings: list[SSD], rows: int) -> None:
        """Time the engines at the step shapes the policy compares, for the batch sizes up to ``rows`` (doubling,
        up to max_running), while they hold no live rows (at load with ``calibrate=True``: every size; before
        a round: those the requests known then may reach; a later, larger batch: when the engines are idle
        again). A one-prompt ``generate`` so times one row, not sixteen (~16 s of steps on a 2-core CPU)."""
        if self._target_rows or self._draft_rows:
            return
        all_sizes = doubling_sizes(1, self.max_running)
        top = next(size for size in all_sizes if size >= min(max(rows, 1), self.max_running))
        sizes = [size for size in all_sizes if size <= top]
        for s in settings:
            key = self._calibration_key(s)
            if self._calibrated.get(key, 0) >= top:
                continue
            target_tokens = list(range(1, s.draft_len + 2))
            draft_tokens = sorted({1} | {k + 1 for k in range(1, s.draft_len + 1)} |
                                  {SSD(draft_len=k, fan_out_budget=max(s.fan_out_budget, k + 1)).tree_tokens
                                   for k in range(1, s.draft_len + 1)})
            target = self.generator.engine("target")
            self.costs.calibrate(target, "target", sizes, target_tokens)
            with target.alone():
                self.costs.calibrate(target, TARGET_ALONE, sizes, target_tokens)
            self.costs.calibrate(self.generator.engine("draft"), "draft", sizes, draft_tokens)
            self._calibrated[key] = top

    def _lay_out(self, plans: dict[int, RoundPlan]) -> None:
        """Order the rows [SSD groups | SD | AR]; rearrange the caches only when that order changed."""
        def group(seq: SequenceState) -> tuple:
            plan = plans[id(seq)]
            return ({"ssd": 0, "sd": 1, "ar": 2}[plan.kind],
                    repr(plan.family or plan.settings) if plan.kind == "ssd" else "")
        previous = {id(s): i for i, s in enumerate(self._target_rows)}
        ordered = least_moves(sorted(self._running, key=lambda s: (group(s), previous.get(id(s), len(previous)))),
                              group, previous)
        if [id(s) for s in ordered] != [id(s) for s in self._target_rows]:
            self.generator.engine("target").select_rows([previous.get(id(s)) for s in ordered])
        drafted = [s for s in ordered if plans[id(s)].kind != "ar"]
        before = {id(s): i for i, s in enumerate(self._draft_rows)}
        for seq in self._draft_rows:
            if id(seq) not in {id(s) for s in drafted}:
                seq.speculation = None
        for seq in drafted:
            if id(seq) not in before:           # a new draft row: the draft has seen nothing of it
                seq.draft_pending = seq.history[:-1] if seq.tokens else list(seq.prompt)
                seq.speculation = None
            plan = plans[id(seq)]
            if seq.speculation is not None and (plan.kind != "ssd" or plan.settings is None
                                                or len(seq.speculation.tokens) != plan.settings.draft_len):
                seq.speculation = None
        self._target_rows = ordered
        if drafted and [id(s) for s in drafted] != [id(s) for s in self._draft_rows]:
            try:
                self.on_draft(lambda: self.generator.engine("draft").select_rows([before.get(id(s)) for s in drafted]))
            except Exception as failure:   # noqa: BLE001 -- the requests go on without the draft
                self.draft_failed(failure)
                return
        self._draft_rows = drafted

    def _prefill(self, new: list[SequenceState], outputs: dict[str, RequestOutput]) -> None:
        """Prompts of the requests that just joined, on their own rows (contiguous runs), and their first
        token, drawn by each request's parameters and stream."""
        index = {id(s): i for i, s in enumerate(self._target_rows)}
        target = self.generator.engine("target")
        runs: list[list[SequenceState]] = []
        for seq in sorted(new, key=lambda s: index[id(s)]):
            run = runs[-1] if runs else []
            longest = max([len(s.prompt) for s in run + [seq]])
            # one forward for adjacent rows while right-padding to the longest wastes < 15% (a prefill costs
            # the same per token at any batch on a CPU: padding is pure loss)
            if run and index[id(run[-1])] + 1 == index[id(seq)] and \
                    longest * (len(run) + 1) <= 1.15 * sum(len(s.prompt) for s in run + [seq]):
                run.append(seq)
            else:
                runs.append([seq])
        for run in runs:
            first = index[id(run[0])]
            with target.alone():            # between rounds: the draft is idle
                logits = feed_ragged(target.rows(first, first + len(run)), [s.prompt for s in run])
            for r, seq in enumerate(run):
                if seq.features is not None:
                    seq.features.append(0, target_features(target)[r, :len(seq.prompt)])
            tokens, _ = draw_rows(logits, [s.params for s in run], [s.rng for s in run])
            for seq, token in zip(run, tokens):
                self.emit(outputs, seq, seq.commit([int(token)]))

    # -- the draft's core ---------------------------------------------------------------------------
    def on_draft(self, job, *args):
        """Run ``job`` on the draft's worker thread (pinned to the draft's cores) and wait for its result, at most
        the draft's timeout (:meth:`submit_draft` returns the Future instead)."""
        return self.submit_draft(job, *args).result(timeout=self.draft_timeout_s)

    def submit_draft(self, job, *args):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ssd-draft",
                                            initializer=pin, initargs=(self._draft_cores,))
        return self._pool.submit(job, *args)

    def draft_failed(self, failure: BaseException) -> None:
        """A draft job raised, hung or returned garbage: every request finishes without the draft (exactly, as
        AR), and the draft engine is never used again by this Generator."""
        self.draft_failure = failure
        for seq in self._running:
            seq.speculation = None
            seq.stats.draft_failures.append(f"{type(failure).__name__}: {failure}")
        self._draft_rows = []
        failed = self.generator.engines.opened.get("draft")
        self.generator.engines.retire("draft")
        try:                                  # its slots are given back, as every engine's are after a request
            failed.rollback(np.zeros_like(failed.lengths))
        except Exception:  # noqa: BLE001 -- a broken engine may refuse even that; it is never used again
            pass
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def planner(self, settings: SSD) -> FanOutPlanner:
        if settings not in self._planners:
            self._planners[settings] = FanOutPlanner(settings.draft_len, settings.fan_out_budget,
                                                     settings.prior_acceptance, settings.prior_power)
        return self._planners[settings]

    def fan_out(self, settings: SSD) -> dict:
        """The fan-out shapes learned for requests with these settings (``FanOutPlanner.describe``; empty when
        none ran: e.g. an adaptive request the load policy ran with another K)."""
        planner = self._planners.get(settings)
        return {} if planner is None else planner.describe()

    def yield_of(self, settings: SSD) -> Yield:
        """What adaptive SSD rounds with these request settings produced (keyed by the unadapted settings)."""
        if settings not in self._yields:
            self._yields[settings] = Yield(settings.prior_acceptance)
        return self._yields[settings]

    @property
    def target_rows(self) -> list[SequenceState]:
        return self._target_rows

    @property
    def draft_rows(self) -> list[SequenceState]:
        return self._draft_rows

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=self.draft_failure is None)
            self._pool = None
