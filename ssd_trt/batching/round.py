"""One round of the engine step over every running request, whatever its mode (``engine.py`` lays the rows out
[SSD groups | SD | AR]; the draft's rows are the target's first rows).

  1. propose    the draft drafts a chain for the SD rows and for SSD rows without a ready speculation (a
                request that just joined, or whose K changed): one draft loop over those rows, each row
                drawing by its own parameters and stream (``speculative.draft_tokens``); then a token tree
                for each group of SD rows that asked for one (``speculative_tree.draft_trees``)
  2. speculate  for each SSD group, the draft's worker pre-drafts the likely outcomes of this round
                (``saguaro.speculate``) -- on the draft's core, while the target verifies
  3. verify     one target forward over every row: [t*_prev] for AR rows, [t*_prev, s_1..s_K] for chains, the
                tree's nodes (under its tree mask) for tree rows (ragged, right-padded); each row verifies
                (``sampling.verify_chain``, ``speculative_tree.accepted_path``) or samples, and commits; a
                tree row's cache keeps its accepted path (``Engine.keep``).
                When no SSD group speculates, the draft's core is idle: the target runs on it too
                (``Engine.alone``), and paused SSD rows leave their catch-up to the round that resumes them
  4. settle     a draft that reads the target's features (EAGLE-3) is handed those of the verified tokens;
                SD rows keep the draft's cache in step; SSD rows look up the outcome in their group's cache
                and back up on a miss (just in time, or prompt lookup), learning the fan-out as they go
                (``saguaro.settle``: the SSD side of a round lives with the rest of the algorithm)

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
from ssd_trt.decoding.feature_relay import relay_features, target_features
from ssd_trt.decoding.saguaro import Speculation as RowsSpeculation, catch_up, settle, speculate, validate_speculation
from ssd_trt.decoding.sampling import TokenDistribution, draw_rows, verify_chain
from ssd_trt.decoding.settings import SD, SSD
from ssd_trt.decoding.speculative import draft_tokens
from ssd_trt.decoding.speculative_tree import DraftedTrees, TokenTree, accepted_path, draft_trees

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

    @property
    def tree(self) -> bool:
        """An SD round over a token tree (``SD.tree_widths``)."""
        return self.kind == "sd" and bool(self.settings.tree_widths)


@dataclass
class ChainDraft:
    """Step 1's result for draft rows ``first`` onwards: K_max tokens per row and what the draft cache holds."""
    first: int
    start: np.ndarray          # each row's draft length before the loop
    fed: np.ndarray            # tokens the loop fed per row (pending + t*_prev + s_1..s_{K_max-1})
    drafted: int               # K_max
    tokens: np.ndarray         # [rows, K_max]
    dists: list[TokenDistribution] | None


@dataclass
class TreeRow:
    """A tree row's proposal: row ``row`` of a group's drafted trees."""
    trees: DraftedTrees
    row: int


def run_round(engine: "LLMEngine", plans: dict[int, RoundPlan], outputs: dict[str, "RequestOutput"]) -> None:
    rows, drafted = engine.target_rows, engine.draft_rows
    plan = [plans[id(seq)] for seq in rows]
    chain = propose(engine, rows, drafted, plan)
    trees = propose_trees(engine, rows, drafted, plan)
    groups = ssd_runs(plan, len(drafted), speculating=True)
    futures = [speculate(engine, rows, first, stop, plan[first].settings) for first, stop in groups]
    # the draft's core works through this round's verification, or lends it to the target (Engine.alone)
    draft_busy = any(future is not None for future in futures)
    if draft_busy:
        paused = ssd_runs(plan, len(drafted), speculating=False)
        futures += [catch_up(engine, rows, first, stop) for first, stop in paused]
    proposals = [trees.get(i) or row_proposal(seq, plan[i], chain, i) for i, seq in enumerate(rows)]
    verify_started = time.perf_counter()
    outcomes = verify(engine, rows, proposals, outputs, alone=not draft_busy)
    verified = time.perf_counter()
    for i in range(len(drafted)):
        if outcomes[i] is None:
            continue
        if plan[i].kind == "ssd":            # speculating or paused: the draft will see the verified glue
            rows[i].draft_pending += [int(t) for t in outcomes[i][0]]
        elif plan[i].tree:                   # the draft holds the tree's root (t*_prev): the path follows
            rows[i].draft_pending = [int(t) for t in outcomes[i][0][1:]]
    caches = [wait_for(engine, future) for future in futures][:len(groups)]
    looked_up = time.perf_counter()
    if drafted and engine.draft_failure is None:     # the draft is idle: it may take the features just verified
        relay_features(engine.generator.engine("draft"), drafted)
    if chain is not None:
        settle_chain(engine, rows, plan, chain, outcomes)
    for (first, stop), cache in zip(groups, caches):
        settle(engine, rows, first, stop, plan[first].settings, plan[first].family, cache, proposals, outcomes)
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
    wanted = [i for i in range(len(drafted)) if not rows[i].finished and not plan[i].tree and
              (plan[i].kind == "sd" or (plan[i].settings is not None and rows[i].speculation is None))]
    if not wanted or engine.draft_failure is not None:
        return None
    first, stop = wanted[0], wanted[-1] + 1
    view_rows = rows[first:stop]
    flags = [first + r in wanted for r in range(len(view_rows))]
    started = time.perf_counter()
    try:
        chain = engine.on_draft(draft_chain, engine, first, view_rows, plan[first:stop], flags)
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


def propose_trees(engine: "LLMEngine", rows: list[SequenceState], drafted: list[SequenceState],
                  plan: list[RoundPlan]) -> dict[int, TreeRow]:
    """Step 1 for tree rows (the layout puts those of one tree shape together): each group's trees, drafted on the
    draft's core; its cache keeps each row's pending tokens and root."""
    vocab = engine.generator.engine("target").spec.vocab_size
    proposals: dict[int, TreeRow] = {}
    for first, stop in row_runs(plan, len(drafted), lambda p: p.tree, lambda p: p.settings.tree_widths):
        if engine.draft_failure is not None:
            break
        seqs = rows[first:stop]
        view = engine.generator.engine("draft").rows(first, stop)
        pending = [s.draft_pending + [s.unfed if s.unfed is not None else 0] for s in seqs]
        started = time.perf_counter()
        try:
            trees = engine.on_draft(draft_trees, view, pending, TokenTree.of(plan[first].settings.tree_widths),
                                    [s.params for s in seqs], [s.draft_rng for s in seqs])
            if int(trees.nodes.min()) < 0 or int(trees.nodes.max()) >= vocab:
                raise ValueError(f"draft proposed token ids outside the target's vocabulary 0..{vocab - 1} in a tree")
        except Exception as failure:   # noqa: BLE001 -- any draft failure: the round goes on without the draft
            engine.draft_failed(failure)
            return {}
        engine.metrics.draft_s += time.perf_counter() - started
        for r, seq in enumerate(seqs):
            seq.draft_pending = []
            if not seq.finished:
                proposals[first + r] = TreeRow(trees, r)
    return proposals


def row_runs(plan: list[RoundPlan], count: int, member, key) -> list[tuple[int, int]]:
    """Runs of adjacent rows among the first ``count`` (the draft's) whose plan is a ``member`` and whose plans share
    a ``key``: the layout puts each group together."""
    runs: list[tuple[int, int]] = []
    for i in range(count):
        if not member(plan[i]):
            continue
        if runs and runs[-1][1] == i and key(plan[runs[-1][0]]) == key(plan[i]):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def ssd_runs(plan: list[RoundPlan], count: int, speculating: bool) -> list[tuple[int, int]]:
    """SSD groups that speculate (``speculating``: with the same settings), or whose speculation the load policy
    paused."""
    return row_runs(plan, count, lambda p: p.kind == "ssd" and (p.settings is not None) == speculating,
                    lambda p: p.settings)


# -- 2. speculate: saguaro.speculate per SSD group; the draft's results -----------------------------------
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


def verify(engine: "LLMEngine", rows: list[SequenceState], proposals: list["Speculation | TreeRow | None"],
           outputs: dict[str, "RequestOutput"], alone: bool) -> list[tuple[list[int], int] | None]:
    """One target forward over every row (``alone``: the draft is idle meanwhile, so the target may use its cores
    too); per row (verified tokens = [t*_prev, s_1..s_k] (a tree: its accepted path), k) or None for a row that
    did not run (finished). The target computes the features of exactly those tokens: a request's log keeps
    them when the build relays them to a feature draft."""
    target = engine.generator.engine("target")
    start = target.lengths
    ids, positions, mask = verify_inputs(rows, proposals, start)
    started = time.perf_counter()
    with target.alone() if alone else nullcontext():
        logits = target.forward(ids, positions, mask)
    engine.costs.observe(TARGET_ALONE if alone else "target", len(rows), ids.shape[1], time.perf_counter() - started)
    new_lengths, results = start.copy(), []
    for i, (seq, proposal) in enumerate(zip(rows, proposals)):
        if seq.finished:
            results.append(None)
            continue
        previous = seq.unfed
        verified = [0]                        # columns of this row's feed the target verified
        if proposal is None:
            token, _ = draw_rows(logits[i, :1], [seq.params], [seq.rng])
            accepted, committed = 0, [int(token[0])]
        elif isinstance(proposal, TreeRow):
            verified, extra = accepted_path(proposal.trees, proposal.row, logits[i, :proposal.trees.tree.size],
                                            seq.params, seq.rng)
            accepted = len(verified) - 1
            committed = [int(t) for t in proposal.trees.nodes[proposal.row, verified[1:]]] + [extra]
            engine.metrics.drafted += len(proposal.trees.tree.widths)
        else:
            outcome = verify_chain(proposal.tokens, proposal.dists, logits[i, :len(proposal.tokens) + 1],
                                   seq.params, seq.rng)
            accepted = outcome.accepted
            verified = list(range(accepted + 1))
            committed = [int(t) for t in proposal.tokens[:accepted]] + [outcome.bonus]
            engine.metrics.drafted += len(proposal.tokens)
        if proposal is not None:
            seq.stats.record_round(accepted)
            engine.metrics.speculative_rounds += 1
            engine.metrics.accepted += accepted
        if seq.features is not None:
            seq.features.append(int(start[i]), target_features(target)[i, verified])
        if isinstance(proposal, TreeRow):     # the accepted path's slots become the row's next slots
            target.keep(i, int(start[i]), verified)
        engine.emit(outputs, seq, seq.commit(committed))
        new_lengths[i] = start[i] + 1 + accepted
        results.append(([previous] + committed[:accepted], accepted))
    target.rollback(new_lengths)
    return results


def verify_inputs(rows: list[SequenceState], proposals: list, start: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The verification's ids and positions [B, W], right-padded, and its mask [B, W, W]: None (causal) unless a
    row verifies a tree (then that row's nodes see their ancestors only, and every other row stays causal, the
    mask it would have alone)."""
    feeds, depths = [], []
    for seq, proposal in zip(rows, proposals):
        if seq.finished:
            feeds.append([0])
            depths.append([0])
        elif isinstance(proposal, TreeRow):
            feeds.append([int(t) for t in proposal.trees.nodes[proposal.row]])
            depths.append(list(proposal.trees.tree.depths))
        else:
            feed = [seq.unfed] + ([] if proposal is None else [int(t) for t in proposal.tokens])
            feeds.append(feed)
            depths.append(list(range(len(feed))))
    width = max(len(f) for f in feeds)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    positions = start[:, None].astype(np.int64) + np.arange(width)[None, :]
    for i, (feed, depth) in enumerate(zip(feeds, depths)):
        ids[i, :len(feed)] = feed
        positions[i, :len(depth)] = start[i] + np.asarray(depth)
    trees = [(i, p.trees.tree) for i, p in enumerate(proposals) if isinstance(p, TreeRow) and not rows[i].finished]
    if not trees:
        return ids, positions, None
    mask = np.tile(np.tril(np.ones((width, width), dtype=bool)), (len(rows), 1, 1))
    for i, tree in trees:
        mask[i, :tree.size, :tree.size] = tree.mask
    return ids, positions, mask


# -- 4. settle --------------------------------------------------------------------------------------------
def settle_chain(engine: "LLMEngine", rows: list[SequenceState], plan: list[RoundPlan], chain: ChainDraft,
                 outcomes: list) -> None:
    """SD rows: the draft fed pending + t*_prev + s_1..s_{K_max-1}; keep through s_min(k, K_max-1), and the
    accepted tokens it has not seen stay pending."""
    if engine.draft_failure is not None:
        return
    draft = engine.generator.engine("draft").rows(chain.first, chain.first + len(chain.start))
    # a feature draft keeps none of the drafted tokens it fed: they carried its own features, and a verified token
    # is fed again carrying the target's (engines/feature_draft.py)
    refeed_verified = engine.generator.engine("draft").takes_target_features
    lengths = draft.lengths
    for r in range(len(chain.start)):
        i = chain.first + r
        if plan[i].kind != "sd" or outcomes[i] is None:
            continue
        accepted = outcomes[i][1]
        if plan[i].family is not None:     # an adaptive SSD request the load policy runs in SD rounds
            engine.yield_of(plan[i].family).observe_round(plan[i].settings.draft_len, "sd", accepted)
        kept = 0 if refeed_verified else min(accepted, chain.drafted - 1)
        fed_pending = int(chain.fed[r]) - (chain.drafted - 1)
        lengths[r] = chain.start[r] + fed_pending + kept
        rows[i].draft_pending = [int(t) for t in chain.tokens[r, kept:accepted]]
    engine.on_draft(draft.rollback, lengths)
