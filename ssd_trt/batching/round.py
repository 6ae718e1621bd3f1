"""One round of the engine step over every running request, whatever its mode (``engine.py`` lays the rows out
[SSD groups | SD | AR]; the draft's rows are the target's first rows).

  1. propose    the draft drafts a chain for the SD rows and for SSD rows without a ready speculation (a
                request that just joined, or whose K changed): one draft loop over those rows, each row
                drawing by its own parameters and stream (``speculative.draft_tokens``)
  2. speculate  for each SSD group, the draft's worker pre-drafts the likely outcomes of this round
                (``saguaro.DraftWorker.speculate``) -- on the draft's core, while the target verifies
  3. verify     one target forward over every row: [t*_prev] for AR rows, [t*_prev, s_1..s_K] for the others
                (ragged, right-padded); each row verifies (``sampling.verify_chain``) or samples, and commits.
                When no SSD group speculates, the draft's core is idle: the target runs on it too
                (``Engine.alone``), and paused SSD rows leave their catch-up to the round that resumes them
  4. settle     SD rows keep the draft's cache in step; SSD rows look up the outcome in their group's cache
                and back up on a miss (just in time, or prompt lookup), learning the fan-out as they go

A request's tokens depend only on its own rows' logits and its own random streams: the engines compute each
row exactly as alone (``engines/ort.py``: row-exact steps), so greedy output is the same under any
interleaving of requests, and a seeded sampled request whose mode runs the same rounds draws the same numbers.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ssd_trt.batching.policy import TARGET_ALONE
from ssd_trt.batching.sequence import SequenceState, Speculation
from ssd_trt.decoding.fan_out import bonus_rank
from ssd_trt.decoding.sampling import TokenDistribution, draw_rows, verify_chain
from ssd_trt.decoding.settings import SD, SSD
from ssd_trt.decoding.saguaro import DraftWorker, Speculation as RowsSpeculation, validate_cache, validate_speculation
from ssd_trt.decoding.speculative import draft_tokens
from ssd_trt.engines.feeding import feed_rows
from ssd_trt.ngram import ngram_proposal

if TYPE_CHECKING:
    from ssd_trt.batching.engine import LLMEngine, RequestOutput


@dataclass(frozen=True)
class RoundPlan:
    """How one request runs this round: ar | sd | ssd, with the settings in force (an adaptive SSD request's as
    the policy chose them: SSD settings; SD settings, drafting in turn with the verification; or None:
    speculation paused, an autoregressive round that keeps the request's draft row, so that resuming feeds the
    draft only what it missed) and, for adaptive SSD, the request's own settings (``family``: what the policy
    adapts and what its measurements are filed under). Every kind leaves the draft's cache holding the request's
    committed tokens but its ``draft_pending`` and its unfed last token, so a request may change kind between
    rounds."""
    kind: str
    settings: SD | SSD | None
    family: SSD | None = None


@dataclass
class ChainDraft:
    """Step 1's result for draft rows ``first`` onwards: K_max tokens per row and what the draft cache holds."""
    first: int
    start: np.ndarray          # each row's draft length before the loop
    fed: np.ndarray            # tokens the loop fed per row (pending + t*_prev + s_1..s_{K_max-1})
    drafted: int               # K_max
    tokens: np.ndarray         # [rows, K_max]
    dists: list[TokenDistribution] | None


def run_round(engine: "LLMEngine", plans: dict[int, RoundPlan], outputs: dict[str, "RequestOutput"]) -> None:
    rows, drafted = engine.target_rows, engine.draft_rows
    plan = [plans[id(seq)] for seq in rows]
    chain = propose(engine, rows, drafted, plan)
    groups = row_runs(drafted, plan, speculating=True)
    futures = [speculate(engine, rows, first, stop, plan[first].settings) for first, stop in groups]
    # the draft's core works through this round's verification, or lends it to the target (Engine.alone)
    draft_busy = any(future is not None for future in futures)
    if draft_busy:
        futures += [catch_up(engine, rows, first, stop) for first, stop in row_runs(drafted, plan, speculating=False)]
    proposals = [row_proposal(seq, plan[i], chain, i) for i, seq in enumerate(rows)]
    verify_started = time.perf_counter()
    outcomes = verify(engine, rows, proposals, outputs, alone=not draft_busy)
    verified = time.perf_counter()
    for i in range(len(drafted)):            # SSD rows, speculating or paused: the draft will see the verified glue
        if plan[i].kind == "ssd" and outcomes[i] is not None:
            rows[i].draft_pending += [int(t) for t in outcomes[i][0]]
    caches = [wait_for(engine, future) for future in futures][:len(groups)]
    looked_up = time.perf_counter()
    if chain is not None:
        settle_chain(engine, rows, plan, chain, outcomes)
    for (first, stop), cache in zip(groups, caches):
        settle_ssd(engine, rows, first, stop, plan[first], cache, proposals, outcomes)
    record_times(engine, (verify_started, verified, looked_up), caches, groups, rows, proposals, outcomes)


def record_times(engine: "LLMEngine", times: tuple[float, float, float], caches: list, groups: list,
                 rows: list[SequenceState], proposals: list, outcomes: list) -> None:
    """Where the round's time went, and (for the first SSD rounds) a timeline of what overlapped what: the
    draft's speculation and the target's verification, the hits and the backup (``bench/plots.py``)."""
    verify_started, verified, looked_up = times
    metrics, done = engine.metrics, [c for c in caches if c is not None]
    metrics.verify_s += verified - verify_started
    metrics.wait_s += max(0.0, looked_up - verified)
    metrics.draft_s += sum(c.finished - c.started for c in done)
    ssd = [i for first, stop in groups for i in range(first, stop) if outcomes[i] is not None]
    if not done or not ssd or len(metrics.timeline) >= 200:
        return
    origin = engine.created
    metrics.timeline.append({
        "round": len(metrics.timeline), "submitted": verify_started - origin,
        "verify": [verify_started - origin, verified - origin],
        "draft": [min(c.started for c in done) - origin, max(c.finished for c in done) - origin],
        "hits": sum(rows[i].speculation is not None and rows[i].speculation.source == "primary" for i in ssd),
        "backup": sum(rows[i].speculation is not None and rows[i].speculation.source != "primary" for i in ssd),
        "backup_s": time.perf_counter() - looked_up, "rows": len(rows),
        "accepted": [outcomes[i][1] for i in ssd], "source": [proposals[i].source for i in ssd]})


# -- 1. propose -------------------------------------------------------------------------------------------
def propose(engine: "LLMEngine", rows: list[SequenceState], drafted: list[SequenceState],
            plan: list[RoundPlan]) -> ChainDraft | None:
    wanted = [i for i in range(len(drafted)) if not rows[i].finished and
              (plan[i].kind == "sd" or (plan[i].settings is not None and rows[i].speculation is None))]
    if not wanted or engine.draft_failure is not None:
        return None
    first = wanted[0]
    view_rows = rows[first:len(drafted)]
    flags = [first + r in wanted for r in range(len(view_rows))]
    started = time.perf_counter()
    try:
        chain = engine.on_draft(draft_chain, engine, first, view_rows, plan[first:len(drafted)], flags)
        engine.metrics.draft_s += time.perf_counter() - started
    except Exception as failure:   # noqa: BLE001 -- any draft failure: the round goes on without the draft
        engine.draft_failed(failure)
        return None
    for r, seq in enumerate(view_rows):
        if plan[first + r].kind == "ssd":
            seq.draft_pending = []           # the loop fed them; the draft cache keeps them
            if flags[r]:
                K = plan[first + r].settings.draft_len
                seq.speculation = Speculation(chain.tokens[r, :K].copy(),
                                              None if chain.dists is None else chain.dists[r][:K], "jit")
    return chain


def draft_chain(engine: "LLMEngine", first: int, seqs: list[SequenceState], plans: list[RoundPlan],
                wanted: list[bool]) -> ChainDraft:
    """(On the draft's thread.) The one draft loop over draft rows ``first`` onwards; rows not ``wanted`` are
    fed along (their pending tokens enter the cache) but draw nothing."""
    draft = engine.generator.engine("draft").rows(first, first + len(seqs))
    lengths = [0 if p.settings is None else p.settings.draft_len for p in plans]
    most = max(k for k, w in zip(lengths, wanted) if w)
    shapes = [engine.planner(p.settings).shape("backup") if p.kind == "ssd" and p.settings else None for p in plans]
    sampled = any(not s.params.greedy for s, w in zip(seqs, wanted) if w)

    def draw(logits: np.ndarray, i: int):
        active = [w and i < k for w, k in zip(wanted, lengths)]

        def boost(q: TokenDistribution, r: int) -> TokenDistribution:   # SSD rows draw as the cache's branches
            if shapes[r] is None or plans[r].settings.saguaro_c == 1.0:
                return q
            return q.boosted(np.asarray(shapes[r][i]) + 1, plans[r].settings.saguaro_c)
        tokens, q = draw_rows(logits, [s.params for s in seqs], [s.draft_rng for s in seqs], active, boost)
        return tokens, (TokenDistribution.point_mass(tokens) if q is None and sampled else q)

    start = draft.lengths
    pending = [s.draft_pending + [s.unfed if s.unfed is not None else 0] for s in seqs]
    tokens, dists = draft_tokens(draft, pending, most, draw)
    validate_speculation(RowsSpeculation(tokens, dists, []), len(seqs), most, draft.spec.vocab_size)
    fed = draft.lengths - start
    kept = draft.lengths
    for r, (seq, p) in enumerate(zip(seqs, plans)):
        if p.kind == "ssd":      # SSD keeps the pending tokens only: the glue decode re-reads the rest
            kept[r] = start[r] + len(seq.draft_pending)
    draft.rollback(kept)
    return ChainDraft(first, start, fed, most, tokens, dists)


def row_runs(drafted: list[SequenceState], plan: list[RoundPlan], speculating: bool) -> list[tuple[int, int]]:
    """Runs of adjacent SSD draft rows that speculate (``speculating``: with the same settings) or whose
    speculation the load policy paused (the layout puts each family together, first)."""
    runs: list[tuple[int, int]] = []
    for i in range(len(drafted)):
        if plan[i].kind != "ssd" or (plan[i].settings is not None) != speculating:
            continue
        if runs and runs[-1][1] == i and plan[runs[-1][0]].settings == plan[i].settings:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def catch_up(engine: "LLMEngine", rows: list[SequenceState], first: int, stop: int):
    """Paused SSD rows, in a round where other rows speculate: after the speculation, the draft's core feeds them
    what they committed while the target verifies, so that resuming costs less catch-up. (In a round where no
    row speculates the target runs on the draft's core too, and the tokens wait: the draft feeds them when
    speculation resumes, ``propose``.) None when there is nothing to feed."""
    seqs = rows[first:stop]
    if engine.draft_failure is not None or any(not s.draft_pending for s in seqs):
        return None
    pending = [list(s.draft_pending) for s in seqs]
    for seq in seqs:
        seq.draft_pending = []
    view = engine.generator.engine("draft").rows(first, stop)
    return engine.submit_draft(lambda: feed_rows(view, pending) is None)


# -- 2. speculate -----------------------------------------------------------------------------------------
def group_worker(engine: "LLMEngine", rows: list[SequenceState], first: int, stop: int, settings: SSD) -> DraftWorker:
    """Saguaro's draft worker over one SSD group's draft rows, with each row's parameters and stream."""
    seqs = rows[first:stop]
    worker = DraftWorker(engine.generator.engine("draft").rows(first, stop), settings, [s.params for s in seqs],
                         [s.draft_rng for s in seqs], None)
    worker.pending = [list(s.draft_pending) for s in seqs]
    worker.history = [s.history for s in seqs]
    return worker


def speculate(engine: "LLMEngine", rows: list[SequenceState], first: int, stop: int, settings: SSD):
    """Submit step 2 for one group; the draft absorbs the rows' pending tokens. None without a draft."""
    seqs = rows[first:stop]
    if engine.draft_failure is not None or any(s.speculation is None and not s.finished for s in seqs):
        return None
    worker = group_worker(engine, rows, first, stop, settings)
    K = settings.draft_len
    tokens = np.stack([s.speculation.tokens if s.speculation is not None else np.zeros(K, np.int64) for s in seqs])
    dists = [None if s.speculation is None else s.speculation.dists for s in seqs]
    bonus = [s.unfed if s.unfed is not None else 0 for s in seqs]
    shapes = [engine.planner(settings).shape("primary")] * len(seqs)
    future = engine.submit_draft(worker.speculate, bonus, RowsSpeculation(tokens, dists, ["primary"] * len(seqs)),
                                 shapes)
    for seq in seqs:
        seq.draft_pending = []
    return future


def wait_for(engine: "LLMEngine", future):
    if future is None:
        return None
    try:
        return future.result(timeout=engine.draft_timeout_s)
    except Exception as failure:   # noqa: BLE001 -- a draft that raised or hung: finish without it
        engine.draft_failed(failure)
        return None


# -- 3. verify --------------------------------------------------------------------------------------------
def row_proposal(seq: SequenceState, plan: RoundPlan, chain: ChainDraft | None, index: int) -> Speculation | None:
    """The drafted tokens row ``index`` verifies this round (None: an autoregressive round)."""
    if seq.finished or plan.kind == "ar":
        return None
    if plan.kind == "ssd":
        return seq.speculation
    if chain is None or index < chain.first:
        return None
    K, r = plan.settings.draft_len, index - chain.first
    return Speculation(chain.tokens[r, :K], None if chain.dists is None else chain.dists[r][:K], "sd")


def verify(engine: "LLMEngine", rows: list[SequenceState], proposals: list[Speculation | None],
           outputs: dict[str, "RequestOutput"], alone: bool) -> list[tuple[list[int], int] | None]:
    """One target forward over every row (``alone``: the draft is idle meanwhile, so the target may use its cores
    too); per row (glue kept for the draft = [t*_prev, s_1..s_k], k) or None for a row that did not run
    (finished)."""
    target = engine.generator.engine("target")
    feeds = [[0] if seq.finished else [seq.unfed] + ([] if p is None else [int(t) for t in p.tokens])
             for seq, p in zip(rows, proposals)]
    width = max(len(f) for f in feeds)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    for i, feed in enumerate(feeds):
        ids[i, :len(feed)] = feed
    start = target.lengths
    started = time.perf_counter()
    with target.alone() if alone else nullcontext():
        logits = target.forward(ids, start[:, None].astype(np.int64) + np.arange(width)[None, :])
    engine.costs.observe(TARGET_ALONE if alone else "target", len(rows), width, time.perf_counter() - started)
    new_lengths, results = start.copy(), []
    for i, (seq, proposal) in enumerate(zip(rows, proposals)):
        if seq.finished:
            results.append(None)
            continue
        previous = seq.unfed
        if proposal is None:
            token, _ = draw_rows(logits[i, :1], [seq.params], [seq.rng])
            accepted, committed = 0, [int(token[0])]
        else:
            outcome = verify_chain(proposal.tokens, proposal.dists, logits[i, :len(proposal.tokens) + 1],
                                   seq.params, seq.rng)
            accepted = outcome.accepted
            committed = [int(t) for t in proposal.tokens[:accepted]] + [outcome.bonus]
            seq.stats.record_round(accepted)
            engine.metrics.speculative_rounds += 1
            engine.metrics.drafted += len(proposal.tokens)
            engine.metrics.accepted += accepted
        engine.emit(outputs, seq, seq.commit(committed))
        new_lengths[i] = start[i] + 1 + accepted
        results.append(([previous] + committed[:accepted], accepted))
    target.rollback(new_lengths)
    return results


# -- 4. settle --------------------------------------------------------------------------------------------
def settle_chain(engine: "LLMEngine", rows: list[SequenceState], plan: list[RoundPlan], chain: ChainDraft,
                 outcomes: list) -> None:
    """SD rows: the draft fed pending + t*_prev + s_1..s_{K_max-1}; keep through s_min(k, K_max-1), and the
    accepted tokens it has not seen stay pending."""
    if engine.draft_failure is not None:
        return
    draft = engine.generator.engine("draft").rows(chain.first, chain.first + len(chain.start))
    lengths = draft.lengths
    for r in range(len(chain.start)):
        i = chain.first + r
        if plan[i].kind != "sd" or outcomes[i] is None:
            continue
        accepted = outcomes[i][1]
        if plan[i].family is not None:     # an adaptive SSD request the load policy runs in SD rounds
            engine.yield_of(plan[i].family).observe_round(plan[i].settings.draft_len, "sd", accepted)
        kept = min(accepted, chain.drafted - 1)
        fed_pending = int(chain.fed[r]) - (chain.drafted - 1)
        lengths[r] = chain.start[r] + fed_pending + kept
        rows[i].draft_pending = [int(t) for t in chain.tokens[r, kept:accepted]]
    engine.on_draft(draft.rollback, lengths)


def settle_ssd(engine: "LLMEngine", rows: list[SequenceState], first: int, stop: int, plan: RoundPlan, cache,
               proposals: list, outcomes: list) -> None:
    """Look each row's outcome (k, t*) up in its group's cache; a miss backs up. Learn the fan-out shape."""
    seqs, settings = rows[first:stop], plan.settings
    K = settings.draft_len
    planner = engine.planner(settings)
    measured = engine.yield_of(plan.family) if plan.family is not None else None
    if cache is not None:
        try:
            cache = validate_cache(cache, len(seqs), K, engine.generator.engine("target").spec.vocab_size)
        except ValueError as malformed:      # garbage from the draft is a draft failure, never an output
            engine.draft_failed(malformed)
            cache = None
    missed = []
    for r, seq in enumerate(seqs):
        outcome, proposal = outcomes[first + r], proposals[first + r]
        if outcome is None or proposal is None:
            continue
        accepted = outcome[1]
        if measured is not None:
            measured.observe_round(K, proposal.source, accepted)
        if seq.finished:
            seq.speculation = None
            continue
        if cache is None:
            seq.speculation = None
            continue
        own_next = int(proposal.tokens[accepted]) if accepted < K else None
        rank = bonus_rank(cache.glue_logits[r, accepted], own_next, seq.unfed)
        planner.curve(proposal.source).observe(accepted, K, rank)
        entry = cache.entries.get((r, accepted, seq.unfed))
        seq.stats.record_lookup(accepted, entry is not None)
        engine.metrics.lookups += 1
        engine.metrics.hits += entry is not None
        if measured is not None:
            measured.observe_lookup(entry is not None)
        if entry is not None:
            seq.speculation = Speculation(entry[0], entry[1], "primary")
        else:
            missed.append(r)
    if missed:
        back_up(engine, rows, first, stop, settings, missed)


def back_up(engine: "LLMEngine", rows: list[SequenceState], first: int, stop: int, settings: SSD,
            missed: list[int]) -> None:
    """A miss: the neural draft drafts K tokens just in time (below the critical batch, or as the policy chose),
    or prompt lookup proposes them (a point mass: still exact)."""
    seqs = rows[first:stop]
    backup = settings.backup
    if backup == "auto":
        backup = "jit" if len(rows) < settings.critical_batch else "ngram"
    if backup == "jit" and engine.draft_failure is None:
        worker = group_worker(engine, rows, first, stop, settings)
        shapes = [engine.planner(settings).shape("backup")] * len(seqs)
        wanted = [r in missed for r in range(len(seqs))]
        bonus = [s.unfed if s.unfed is not None else 0 for s in seqs]
        try:
            made = validate_speculation(engine.on_draft(worker.just_in_time, bonus, shapes, wanted), len(seqs),
                                        settings.draft_len, engine.generator.engine("target").spec.vocab_size)
        except Exception as failure:   # noqa: BLE001 -- the request finishes without the draft
            engine.draft_failed(failure)
            for r in missed:
                seqs[r].speculation = None
            return
        for seq in seqs:
            seq.draft_pending = []
        for r in missed:
            seqs[r].speculation = Speculation(made.tokens[r].copy(), None if made.dists is None else made.dists[r],
                                              "jit")
            seqs[r].stats.backup_rounds["jit"] += 1
        return
    for r in missed:
        tokens = np.asarray(ngram_proposal(seqs[r].history, settings.draft_len), dtype=np.int64)
        dists = None if seqs[r].params.greedy else TokenDistribution.point_mass(tokens)
        seqs[r].speculation = Speculation(tokens, dists, "ngram")
        seqs[r].stats.backup_rounds["ngram"] += 1
