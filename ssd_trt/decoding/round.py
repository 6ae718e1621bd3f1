"""One round of the engine step over every running request, whatever its mode. The rows arrive laid out
[SSD groups | SD chains | SD trees | AR] (``batching/scheduler.py``); the draft holds the first rows, those of the
requests that draft.

  1. propose    SD chain rows: one draft loop over them, each row drawing by its own parameters and stream
                (``speculative.draft_chains``); SD tree rows: a token tree per group of one shape
                (``speculative_tree.draft_trees``); SSD groups: Saguaro's round starts (``saguaro.start``:
                steps 1-4 on the draft's thread, while the target verifies); SSD rows the load policy paused
                catch up on the draft's thread meanwhile (``saguaro.catch_up``)
  2. verify     one target forward over every row: [t*_prev] for AR rows, [t*_prev, s_1..s_K] for chains, the
                tree's nodes (under its tree mask) for tree rows (ragged, right-padded); each row verifies
                (``sampling.verify_chain``, ``speculative_tree.accepted_path``) or samples, and commits; a tree
                row's cache keeps its accepted path (``Engine.keep``). When no SSD group speculates, the draft's
                core is idle: the target runs on it too (``Engine.alone``; spinning on it when the draft has no work
                this round at all)
  3. settle     a draft that reads the target's features (EAGLE-3) is handed those of the verified tokens; SD rows
                keep the draft's cache in step; SSD groups look up their outcomes and back up on a miss
                (``saguaro.settle``: the SSD side of a round lives with the rest of the algorithm)

The round returns what each row committed and did (:class:`RoundReport`); the engine step streams it, counts it and
feeds it to the load policy. A request's tokens depend only on its own rows' logits and its own random streams:
the engines compute each row exactly as alone (``engines/ort.py``: row-exact steps), so greedy output is the same
under any interleaving of requests, and a seeded sampled request whose mode runs the same rounds draws the same
numbers.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from ssd_trt.decoding import saguaro
from ssd_trt.decoding.draft_lane import DraftLane
from ssd_trt.decoding.fan_out import FanOutPlanners
from ssd_trt.decoding.feature_relay import relay_features, target_features
from ssd_trt.decoding.grammar import apply_mask, draft_copies
from ssd_trt.decoding.logprobs import token_logprobs
from ssd_trt.decoding.penalties import adjusted, adjusts, chain_outputs, tree_outputs
from ssd_trt.decoding.sampling import draw_rows, verify_chain
from ssd_trt.decoding.sequence import SequenceState, Speculation
from ssd_trt.decoding.settings import SD, SSD
from ssd_trt.decoding.speculative import draft_chains, validate_tokens
from ssd_trt.decoding.speculative_tree import DraftedTrees, TokenTree, accepted_path, draft_trees
from ssd_trt.engines.base import Engine


@dataclass(frozen=True)
class RoundPlan:
    """How one request runs this round: ar | sd | ssd, with the settings in force (an adaptive SSD request's as the
    load policy chose them: SSD settings; SD settings, drafting in turn with the verification; or None: speculation
    paused, an autoregressive round that keeps the request's draft row, so that resuming feeds the draft only what
    it missed) and, for adaptive SSD, the request's own settings (``family``: what the policy adapts and files its
    measurements under). Every kind leaves the draft's cache holding the request's committed tokens but its
    ``draft_pending`` and its unfed last token, so a request may change kind between rounds."""
    kind: str
    settings: SD | SSD | None
    family: SSD | None = None

    @property
    def tree(self) -> bool:
        """An SD round over a token tree (``SD.tree_widths``)."""
        return self.kind == "sd" and bool(self.settings.tree_widths)

    @property
    def drafts(self) -> bool:
        """The request holds a draft row this round."""
        return self.kind != "ar"

    @property
    def works_draft(self) -> bool:
        """The draft has work for the request this round (an SD proposal, or SSD's speculation)."""
        return self.kind == "sd" or (self.kind == "ssd" and self.settings is not None)

    @property
    def group(self) -> tuple:
        """Rows of one group sit together: [SSD groups (by settings) | SD chains | SD trees (by shape) | AR]."""
        if self.kind == "ssd":
            return 0, repr(self.family or self.settings)
        if self.kind == "sd":
            return (2, repr(self.settings.tree_widths)) if self.tree else (1, "")
        return 3, ""


@dataclass
class RoundContext:
    """What a round uses: the target engine, the draft's lane, and the fan-out planners of SSD groups."""
    target: Engine
    draft: DraftLane
    fan_outs: FanOutPlanners = field(default_factory=FanOutPlanners)


@dataclass
class RowResult:
    """What one row did this round: the tokens it committed, where the tokens it verified came from (sd | tree |
    primary | jit | ngram; None: an autoregressive round), how many were drafted and accepted, and an SSD row's
    lookup of its outcome (hit, or the backup that covered the miss)."""
    committed: list[int]
    proposal: str | None = None
    drafted: int = 0
    accepted: int = 0
    lookup: saguaro.Lookup | None = None


@dataclass
class RoundReport:
    """One round: per target row its result (None: a row that finished before the round), the verification's shape
    and times, and the draft's work."""
    rows: list[RowResult | None]
    started: float                 # the round began
    verify: tuple[float, float]    # the target's forward: start, end
    collected: float               # the speculations were in (the target waited for the draft until then)
    settled: float                 # lookups and backups done
    width: int                     # tokens per row of the verification
    alone: bool                    # the target ran on the draft's cores too
    speculations: list[saguaro.SpeculationCache]
    ssd_rows: list[int]            # rows of the groups that speculated


@dataclass
class ChainDraft:
    """The SD chain rows' proposals: rows ``first`` onwards, K_max tokens each, and what the draft cache holds."""
    first: int
    start: np.ndarray          # each row's draft length before the loop
    fed: np.ndarray            # tokens the loop fed per row (pending + t*_prev + s_1..s_{K_max-1})
    drafted: int               # K_max
    tokens: np.ndarray         # [rows, K_max]
    dists: list | None


@dataclass
class TreeRow:
    """A tree row's proposal: row ``row`` of a group's drafted trees."""
    trees: DraftedTrees
    row: int


def run_round(ctx: RoundContext, rows: list[SequenceState], plans: list[RoundPlan], drafted: int) -> RoundReport:
    """One round over ``rows`` (the target's, in order; the first ``drafted`` are the draft's rows too)."""
    started = time.perf_counter()
    chains = propose_chains(ctx.draft, rows, plans, drafted)                                      # 1.
    trees = propose_trees(ctx.draft, rows, plans, drafted, ctx.target.spec.vocab_size)
    groups = row_runs(plans, drafted, lambda p: p.kind == "ssd" and p.settings is not None, lambda p: p.settings)
    paused = row_runs(plans, drafted, lambda p: p.kind == "ssd" and p.settings is None, lambda p: p.family)
    pending = [saguaro.start(ctx.draft, ctx.fan_outs.get(plans[first].settings), rows[first:stop], first,
                             plans[first].settings) for first, stop in groups]
    # the draft's core works through this round's verification, or lends it to the target (Engine.alone)
    draft_busy = any(p is not None for p in pending)
    catching_up = [saguaro.catch_up(ctx.draft, rows[first:stop], first) for first, stop in paused] if draft_busy else []
    proposals = [trees.get(i) or row_proposal(seq, plans[i], chains, i) for i, seq in enumerate(rows)]
    verify_started = time.perf_counter()
    results, verified, width = verify(ctx.target, rows, proposals, alone=not draft_busy,                 # 2.
                                      spin=not any(plan.works_draft for plan in plans))
    verify_ended = time.perf_counter()
    caches = [ctx.draft.result(p) for p in pending]
    for job in catching_up:
        ctx.draft.result(job)
    collected = time.perf_counter()
    if drafted and not ctx.draft.failed:                # the draft is idle: it may take the features just verified
        relay_features(ctx.draft.engine, rows[:drafted])                                                      # 3.
    for chain in chains:
        settle_chain(ctx.draft, rows, chain, results)
    for i, proposal in enumerate(proposals):
        if isinstance(proposal, TreeRow) and verified[i] is not None:  # the draft holds the root (t*_prev)
            rows[i].draft_pending = verified[i][1:]
    accepted = [None if r is None else r.accepted for r in results]
    for (first, stop), cache in zip(groups, caches):
        lookups = saguaro.settle(ctx.draft, ctx.fan_outs.get(plans[first].settings), rows[first:stop], first,
                                 plans[first].settings, cache, verified[first:stop], accepted[first:stop])
        for r, lookup in enumerate(lookups):
            if results[first + r] is not None:
                results[first + r].lookup = lookup
    for first, stop in paused:
        saguaro.settle_paused(rows[first:stop], verified[first:stop])
    return RoundReport(results, started, (verify_started, verify_ended), collected, time.perf_counter(), width,
                       not draft_busy, [c for c in caches if c is not None],
                       [i for (first, stop), c in zip(groups, caches) if c is not None for i in range(first, stop)])


def row_runs(plans: list[RoundPlan], count: int, member, key) -> list[tuple[int, int]]:
    """Runs of adjacent rows among the first ``count`` (the draft's) whose plan is a ``member`` and whose plans share a
    ``key``: the layout puts each group together."""
    runs: list[tuple[int, int]] = []
    for i in range(count):
        if not member(plans[i]):
            continue
        if runs and runs[-1][1] == i and key(plans[runs[-1][0]]) == key(plans[i]):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


# -- 1. propose -------------------------------------------------------------------------------------------------
def pending_feeds(seqs: list[SequenceState]) -> list[list[int]]:
    """What each row's draft must be fed before it drafts: its pending tokens, then its bonus token t*_prev."""
    return [s.draft_pending + [s.unfed if s.unfed is not None else 0] for s in seqs]


def propose_chains(lane: DraftLane, rows: list[SequenceState], plans: list[RoundPlan], drafted: int
                   ) -> list[ChainDraft]:
    """The SD chain rows' proposals, one draft loop per run of them on the draft's thread (the layout makes them one
    run); none once the draft failed."""
    chains = []
    for first, stop in row_runs(plans, drafted, lambda p: p.kind == "sd" and not p.tree, lambda p: True):
        seqs = rows[first:stop]
        wanted = [not s.finished for s in seqs]
        if lane.failed or not any(wanted):
            continue
        view = lane.rows(first, stop)
        start = view.lengths
        made = lane.run(draft_chains, view, pending_feeds(seqs), [p.settings.draft_len for p in plans[first:stop]],
                        [s.params for s in seqs], [s.draft_rng for s in seqs], wanted, draft_copies(seqs))
        if made is None:
            return []
        tokens, dists = made
        for seq in seqs:
            seq.draft_pending = []           # the loop fed them; settle_chain keeps what was accepted
        chains.append(ChainDraft(first, start, view.lengths - start, tokens.shape[1], tokens, dists))
    return chains


def propose_trees(lane: DraftLane, rows: list[SequenceState], plans: list[RoundPlan], drafted: int,
                  vocab: int) -> dict[int, TreeRow]:
    """The SD tree rows' proposals: each group's trees (one shape), drafted on the draft's thread; its cache keeps each
    row's pending tokens and root."""
    proposals: dict[int, TreeRow] = {}
    for first, stop in row_runs(plans, drafted, lambda p: p.tree, lambda p: p.settings.tree_widths):
        seqs = rows[first:stop]
        tree = TokenTree.of(plans[first].settings.tree_widths)
        trees = lane.run(checked_trees, lane.rows(first, stop), pending_feeds(seqs), tree, [s.params for s in seqs],
                         [s.draft_rng for s in seqs], vocab, draft_copies(seqs))
        if trees is None:
            return {}
        for r, seq in enumerate(seqs):
            seq.draft_pending = []
            if not seq.finished:
                proposals[first + r] = TreeRow(trees, r)
    return proposals


def checked_trees(view: Engine, pending: list[list[int]], tree: TokenTree, params, rngs, vocab: int,
                  grammars=None) -> DraftedTrees:
    """(On the draft's thread.) ``draft_trees``, refusing token ids the target does not have."""
    trees = draft_trees(view, pending, tree, params, rngs, grammars)
    validate_tokens(trees.nodes, trees.nodes.shape, vocab, "a tree")
    return trees


def row_proposal(seq: SequenceState, plan: RoundPlan, chains: list[ChainDraft], index: int) -> Speculation | None:
    """The drafted tokens row ``index`` verifies this round (None: an autoregressive round)."""
    if seq.finished or plan.kind == "ar":
        return None
    if plan.kind == "ssd":
        return seq.speculation
    chain = next((c for c in chains if c.first <= index < c.first + len(c.start)), None)
    if chain is None:
        return None
    K, r = plan.settings.draft_len, index - chain.first
    return Speculation(chain.tokens[r, :K], None if chain.dists is None else chain.dists[r][:K], "sd")


# -- 2. verify --------------------------------------------------------------------------------------------------
def verify(target: Engine, rows: list[SequenceState], proposals: list, alone: bool, spin: bool
           ) -> tuple[list[RowResult | None], list[list[int] | None], int]:
    """One target forward over every row (``alone``: the draft is idle meanwhile, so the target may use its cores too;
    ``spin``: and it has no work this round at all, ``Engine.alone``).
    Per row: its result and the tokens verified (t*_prev and the accepted drafted tokens; a tree: its accepted path),
    None for a row that did not run (finished); and the step's tokens per row. The target computes the features of
    exactly the verified tokens: a request's log keeps them when the build relays them to a feature draft."""
    start = target.lengths
    ids, positions, mask = verify_inputs(rows, proposals, start)
    with target.alone(spin) if alone else nullcontext():
        logits = target.forward(ids, positions, mask)
    new_lengths, results, verified_tokens = start.copy(), [], []
    for i, (seq, proposal) in enumerate(zip(rows, proposals)):
        if seq.finished:
            results.append(None)
            verified_tokens.append(None)
            continue
        previous = seq.unfed
        verified = [0]                        # columns of this row's feed the target verified
        chosen = target_choice_logits(seq, proposal, logits[i])
        if proposal is None:
            token, _ = draw_rows(chosen[:1], [seq.params], [seq.rng])
            accepted, committed, result = 0, [int(token[0])], RowResult([])
        elif isinstance(proposal, TreeRow):
            verified, extra = accepted_path(proposal.trees, proposal.row, chosen[:proposal.trees.tree.size],
                                            seq.params, seq.rng)
            accepted = len(verified) - 1
            committed = [int(t) for t in proposal.trees.nodes[proposal.row, verified[1:]]] + [extra]
            result = RowResult([], "tree", len(proposal.trees.tree.widths), accepted)
        else:
            outcome = verify_chain(proposal.tokens, proposal.dists, chosen[:len(proposal.tokens) + 1],
                                   seq.params, seq.rng)
            accepted = outcome.accepted
            verified = list(range(accepted + 1))
            committed = [int(t) for t in proposal.tokens[:accepted]] + [outcome.bonus]
            result = RowResult([], proposal.source, len(proposal.tokens), accepted)
        if seq.features is not None:
            seq.features.append(int(start[i]), target_features(target)[i, verified])
        if isinstance(proposal, TreeRow):     # the accepted path's slots become the row's next slots
            target.keep(i, int(start[i]), verified)
        # committed token k was predicted at the verified column k: the target's own logprobs, accepted draft
        # tokens included (decoding/logprobs.py)
        logprobs = None if seq.params.logprobs is None else \
            token_logprobs(logits[i, verified[:len(committed)]], committed, seq.params.logprobs)
        result.committed = seq.commit(committed, logprobs)
        new_lengths[i] = start[i] + 1 + accepted
        results.append(result)
        verified_tokens.append([previous] + committed[:accepted])
    target.rollback(new_lengths)
    return results, verified_tokens, ids.shape[1]


def target_choice_logits(seq: SequenceState, proposal, logits: np.ndarray) -> np.ndarray:
    """The logits [W, V] one row's decisions are made on: its own, masked by its grammar and adjusted where the request
    asks for a logit bias or penalties, each verified position by the output ahead of it on its path
    (``grammar.py``, ``penalties.py``)."""
    if not adjusts(seq.params) and seq.grammar is None:
        return logits
    if proposal is None:
        outputs = [seq.tokens]
    elif isinstance(proposal, TreeRow):
        trees = proposal.trees
        outputs = tree_outputs(seq.tokens, trees.nodes[proposal.row], trees.tree.parents)
    else:
        outputs = chain_outputs(seq.tokens, [int(t) for t in proposal.tokens])
    chosen = logits[:len(outputs)]
    if seq.grammar is not None:
        done = len(seq.tokens)
        masks = seq.grammar.masks_along([output[done:] for output in outputs])
        chosen = np.stack([apply_mask(row, mask) for row, mask in zip(chosen, masks)])
    return adjusted(chosen, seq.params, seq.prompt, outputs) if adjusts(seq.params) else chosen


def verify_inputs(rows: list[SequenceState], proposals: list, start: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The verification's ids and positions [B, W], right-padded, and its mask [B, W, W]: None (causal) unless a row
    verifies a tree (then that row's nodes see their ancestors only, and every other row stays causal, the mask it
    would have alone)."""
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


# -- 3. settle --------------------------------------------------------------------------------------------------
def settle_chain(lane: DraftLane, rows: list[SequenceState], chain: ChainDraft, results: list[RowResult | None]
                 ) -> None:
    """SD chain rows: the draft fed pending + t*_prev + s_1..s_{K_max-1}; keep through s_min(k, K_max-1), and the
    accepted tokens it has not seen stay pending."""
    if lane.failed:
        return
    view = lane.rows(chain.first, chain.first + len(chain.start))
    # a feature draft keeps none of the drafted tokens it fed: they carried its own features, and a verified token
    # is fed again carrying the target's (engines/feature_draft.py)
    refeed_verified = lane.engine.takes_target_features
    lengths = view.lengths
    for r in range(len(chain.start)):
        result = results[chain.first + r]
        if result is None:
            continue
        kept = 0 if refeed_verified else min(result.accepted, chain.drafted - 1)
        fed_pending = int(chain.fed[r]) - (chain.drafted - 1)
        lengths[r] = chain.start[r] + fed_pending + kept
        rows[chain.first + r].draft_pending = [int(t) for t in chain.tokens[r, kept:result.accepted]]
    lane.run(view.rollback, lengths)
