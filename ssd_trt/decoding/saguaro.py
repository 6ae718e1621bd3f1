"""SSD with Saguaro scheduling: the draft pre-speculates every likely verification outcome while the
target verifies (Kumar, Dao, May: "Speculative Speculative Decoding", ICLR 2026, arXiv 2603.03251).

One round, as the two devices see it (the draft runs on its own core/thread, concurrently):

  target:  verify [t*_prev, s_1..s_K] ──> outcome (k, t*) ──> look up the cache ──> next speculation
  draft :  1. glue decode   one forward over [t*_prev, s_1..s_K]: draft logits at positions j = 0..K
           2. forking       the B most likely outcomes (j, t*) become bonus guesses: the draft's top tokens
                            at each j (minus its own s_{j+1}: a rejected token has zero residual
                            mass, so it can never be t*) weighed by the odds of reaching j, plus
                            prompt-lookup candidates (fan_out.py)
           3. tree decode   K steps over all N = sum_j F_j branches at once; branch (j, t) attends to
                            the prefix, glue tokens 0..j and its own earlier tokens (a tree mask)
           4. cache fill    key (row, k=j, t*=t) -> that branch's K tokens and their draft distributions
  on a hit the next speculation is ready at once; on a miss a backup speculates: the neural draft
  just in time below the critical batch size, prompt lookup (near-zero latency) at or above it.
  After each round the fan-out shapes learn from where the bonus token fell (fan_out.FanOutPlanner).

With a feature draft (EAGLE-3, ``engines/feature_draft.py``) the glue decode runs before the target's
features of the speculation exist: s_1..s_K carry the draft's own, and every branch is pre-drafted behind
them; the commit after the verification hands the draft the target's features of t*_prev, s_1..s_k, and the
next glue decode re-feeds those tokens carrying them.

The file reads in that order: settings, the draft side (DraftWorker: steps 1-4 and the just-in-time
backup), then the target side of a round for one group of SSD requests in the engine step (:func:`speculate`
submits steps 1-4; ``batching/round.py`` verifies every request of every mode in one target forward;
:func:`settle` looks each outcome up, learns the fan-out, and :func:`back_up` covers a miss; :func:`catch_up`
feeds the draft requests whose speculation the load policy paused). Requests join and leave between rounds,
each with its own parameters and random streams.

Sampling is lossless because the target verifies with the exact distribution each drafted token was
drawn from (``sampling.verify_chain``). With Saguaro sampling (C < 1) that distribution is
sigma_{F,C}: the draft's top-(F+1) tokens at a position -- a superset of the tokens cached as bonus
guesses there, since the draft's own token is excluded from the forks -- get C times their mass,
which moves residual mass onto cached tokens (the reference code scales top-(F+1) too).

Tree decode re-feeds the glue tokens and earlier branch tokens at every step (their KV is not kept
between steps) because the attention op treats every cached slot as visible prefix; a masked cached
region would remove that re-feed (profiled cost: docs/decoding.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ssd_trt.batching.sequence import SequenceState, Speculation as RequestSpeculation
from ssd_trt.decoding.fan_out import bonus_rank, confident_forks, ranked_forks
from ssd_trt.decoding.mode import ResolvedMode
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.sampling import TokenDistribution, draw_rows, filter_logits, softmax
from ssd_trt.decoding.settings import SSD
from ssd_trt.decoding.speculative import draft_tokens
from ssd_trt.engines.base import Engine, last_indices
from ssd_trt.engines.feeding import feed_rows
from ssd_trt.ngram import lookup_followers, ngram_proposal

if TYPE_CHECKING:
    from ssd_trt.batching.engine import LLMEngine


# -- settings: decoding/settings.SSD (K, the fan-out budget B, fork policy, C, backup, b*) ----------------
class Saguaro:
    """``--mode ssd``."""
    name = "ssd"
    roles = ("target", "draft")

    def resolve(self, settings: SSD, defaults) -> ResolvedMode:
        settings = settings.resolved(defaults)
        return ResolvedMode(self.name, settings, draft_len=settings.draft_len, headroom=settings.tree_tokens,
                            tree_tokens=settings.tree_tokens,
                            tree_what=f"an SSD tree step with K={settings.draft_len} and fan-out budget "
                                      f"{settings.fan_out_budget}")


@dataclass
class Speculation:
    """K drafted tokens per row, the distributions they were drawn from, and where they came from."""
    tokens: np.ndarray                           # [B, K] int64
    dists: list[TokenDistribution] | None        # per row, K rows each (None when greedy)
    sources: list[str]                           # per row: primary | jit | ngram


@dataclass
class SpeculationCache:
    entries: dict[tuple[int, int, int], tuple[np.ndarray, TokenDistribution | None]]
    glue_logits: np.ndarray             # [B, K+1, V] the draft's view of the verified speculation
    started: float
    finished: float


# -- the draft side -------------------------------------------------------------------------------
class DraftWorker:
    """Owns the draft engine. Every method runs on the worker thread, one job at a time, in order.

    Each row has its own sampling parameters and its own random stream (``params``, ``rngs``): a row's draws
    depend on nothing else in the batch."""

    def __init__(self, draft: Engine, config: SSD, params: list[SamplingParams], rngs: list[np.random.Generator]
                 ) -> None:
        self.draft, self.config, self.params, self.rngs = draft, config, params, rngs
        self.pending: list[list[int]] = []   # committed tokens the draft cache has not seen yet
        self.history: list[list[int]] = []   # every committed token (prompt lookup reads it)

    def speculate(self, bonus: list[int], speculation: Speculation, shapes: list[list[int]]) -> SpeculationCache:
        """Steps 1-4 of the round for the speculation the target is verifying now."""
        started = time.perf_counter()
        glue = [[bonus[row]] + [int(t) for t in speculation.tokens[row]] for row in range(len(bonus))]
        glue_logits = self._glue_decode(glue)                                        # 1.
        forks = [self._forks(row, glue_logits[row], glue[row], shapes[row]) for row in range(len(glue))]  # 2.
        tokens, dists = self._tree_decode(glue, forks, shapes)                       # 3.
        entries = {(row, j, t): (tokens[row, n, 1:].copy(), None if dists is None else dists[:, row, n])
                   for row in range(len(glue)) for n, (j, t) in enumerate(forks[row])}   # 4. cache fill
        return SpeculationCache(entries, glue_logits, started, time.perf_counter())

    def _glue_decode(self, glue: list[list[int]]) -> np.ndarray:
        """Step 1: draft logits at glue positions j = 0..K [B, K+1, V] (pending committed tokens ride along
        in front and stay in the cache; the glue itself is rolled back: the tree steps re-feed it)."""
        size = len(glue[0])
        logits = feed_rows(self.draft, [p + g for p, g in zip(self.pending, glue)], tail=size)
        self.draft.rollback(self.draft.lengths - size)
        self.pending = [[] for _ in glue]
        return logits

    def _forks(self, row: int, glue_logits: np.ndarray, glue: list[int], shape: list[int]) -> list[tuple[int, int]]:
        """Step 2 for one row: the bonus guesses (j, t) to draft behind (policies in fan_out.py)."""
        K, config, params = self.config.draft_len, self.config, self.params[row]
        lookup = [lookup_followers(self.history[row] + glue[:j + 1], limit=config.lookup_forks)
                  if config.lookup_forks else [] for j in range(K + 1)]
        if config.fork_policy == "geometric":
            return ranked_forks(glue_logits, glue[1:], shape, lookup)
        # the draft's odds for the outcome: plain softmax when greedy (T=0 has no distribution to mimic)
        probs = (softmax(glue_logits) if params.greedy
                 else filter_logits(glue_logits, params).dense(glue_logits.shape[-1]))
        return confident_forks(probs, glue[1:], sum(shape), lookup)

    def _tree_decode(self, glue: list[list[int]], forks: list[list[tuple[int, int]]],
                     shapes: list[list[int]]) -> tuple[np.ndarray, TokenDistribution | None]:
        """Step 3: K steps over all branches at once (glue + earlier branch tokens re-fed); every branch of
        every row draws its next token in one call per step. Returns tokens [B, N, K+1] (column 0: the
        fork token) and the distributions they were drawn from [K, B, N] (None when greedy)."""
        K, batch, branches = self.config.draft_len, len(glue), len(forks[0])
        base = self.draft.lengths
        tokens = np.zeros((batch, branches, K + 1), dtype=np.int64)
        for row in range(batch):
            tokens[row, :, 0] = [t for _, t in forks[row]]
        step_dists: list[TokenDistribution] = []
        for step in range(1, K + 1):
            ids, positions, mask = tree_step_inputs(glue, forks, tokens[:, :, :step], base)
            # logits for the newest branch tokens only (the re-fed glue and earlier tokens need none)
            logits = self.draft.forward(ids, positions, mask, last_indices(batch, ids.shape[1], branches))
            self.draft.rollback(base)
            fan_next = np.array([shapes[row][step - 1] for row in range(batch)])[:, None]  # forks at that position
            tokens[:, :, step], q = self._draw(logits, np.broadcast_to(fan_next, (batch, branches)))
            if q is not None:
                step_dists.append(q)
        return tokens, TokenDistribution.stack(step_dists, self.draft.spec.vocab_size) if step_dists else None

    def _draw(self, logits: np.ndarray, fan_out: np.ndarray, active: list[bool] | None = None
              ) -> tuple[np.ndarray, TokenDistribution | None]:
        """Speculation tokens for every row of draft logits [B, ..., V]: argmax, or draws from sigma_{F+1,C}(q)
        where ``fan_out`` [B, ...] is F, the guesses that will sit at each token's position."""
        C = self.config.saguaro_c
        return draw_rows(logits, self.params, self.rngs, active,
                         boost=lambda q, row: q.boosted(np.asarray(fan_out[row]) + 1, C))

    def just_in_time(self, bonus: list[int], shapes: list[list[int]], wanted: list[bool] | None = None) -> Speculation:
        """Neural backup: draft K tokens after each row's new bonus token, synchronously (SD's draft loop,
        drawing as the cache's branches do). Rows not ``wanted`` draw nothing (their tokens are unused)."""
        K, batch = self.config.draft_len, len(bonus)
        prefix = self.draft.lengths + np.array([len(p) for p in self.pending])     # without the bonus
        fan_out = np.array([shapes[row][:K] for row in range(batch)])               # [B, K]: F at each position
        tokens, dists = draft_tokens(self.draft, [p + [b] for p, b in zip(self.pending, bonus)], K,
                                     lambda logits, i: self._draw(logits, fan_out[:, i], wanted))
        self.pending = [[] for _ in bonus]
        self.draft.rollback(prefix)   # drop bonus + drafted tokens: the next glue decode re-reads them
        return Speculation(tokens, dists, ["jit"] * batch)


def tree_step_inputs(glue: list[list[int]], forks: list[list[tuple[int, int]]], branch_tokens: np.ndarray,
                     base: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, positions and tree mask for one tree-decode step.

    Layout of the T = (K+1) + steps*N new tokens: glue 0..K, then step 1's N branch tokens, step 2's, ...
    Glue i sees glue 0..i; branch n's token at step e sees glue 0..j_n and its own tokens 1..e.
    """
    batch, branches, steps = branch_tokens.shape
    glue_len = len(glue[0])
    size = glue_len + steps * branches
    ids = np.zeros((batch, size), dtype=np.int64)
    positions = np.zeros((batch, size), dtype=np.int64)
    mask = np.zeros((batch, size, size), dtype=bool)
    mask[:, :glue_len, :glue_len] = np.tril(np.ones((glue_len, glue_len), dtype=bool))
    for row in range(batch):
        ids[row, :glue_len] = glue[row]
        positions[row, :glue_len] = base[row] + np.arange(glue_len)
        for n, (j, _) in enumerate(forks[row]):
            own = [glue_len + e * branches + n for e in range(steps)]
            for e, index in enumerate(own):
                ids[row, index] = branch_tokens[row, n, e]
                positions[row, index] = base[row] + j + 1 + e
                mask[row, index, :j + 1] = True
                mask[row, index, own[:e + 1]] = True
    return ids, positions, mask


# -- the target side: one round of a group of SSD requests -------------------------------------------------
# The engine step (``batching/round.py``) lays SSD requests with the same settings out as adjacent rows (a
# group) and, each round: submits the group's speculation (below) to the draft's thread, verifies every row of
# every mode in one target forward, then settles the group: looks the outcomes up and backs up on a miss.
def group_worker(engine: "LLMEngine", rows: list[SequenceState], first: int, stop: int, settings: SSD) -> DraftWorker:
    """Saguaro's draft worker over one SSD group's draft rows, with each row's parameters and stream."""
    seqs = rows[first:stop]
    worker = DraftWorker(engine.generator.engine("draft").rows(first, stop), settings, [s.params for s in seqs],
                         [s.draft_rng for s in seqs])
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
    future = engine.submit_draft(worker.speculate, bonus, Speculation(tokens, dists, ["primary"] * len(seqs)),
                                 shapes)
    for seq in seqs:
        seq.draft_pending = []
    return future


def settle(engine: "LLMEngine", rows: list[SequenceState], first: int, stop: int, settings: SSD,
           family: SSD | None, cache: SpeculationCache | None, proposals: list, outcomes: list) -> None:
    """After the verification: look each row's outcome (k, t*) up in its group's cache; a miss backs up. Learn
    the fan-out shape, and (``family``: an adaptive request's own settings) what the round yielded."""
    seqs = rows[first:stop]
    K = settings.draft_len
    planner = engine.planner(settings)
    measured = engine.yield_of(family) if family is not None else None
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
            seq.speculation = RequestSpeculation(entry[0], entry[1], "primary")
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
            seqs[r].speculation = RequestSpeculation(made.tokens[r].copy(),
                                                     None if made.dists is None else made.dists[r], "jit")
            seqs[r].stats.backup_rounds["jit"] += 1
        return
    for r in missed:
        tokens = np.asarray(ngram_proposal(seqs[r].history, settings.draft_len), dtype=np.int64)
        dists = None if seqs[r].params.greedy else TokenDistribution.point_mass(tokens)
        seqs[r].speculation = RequestSpeculation(tokens, dists, "ngram")
        seqs[r].stats.backup_rounds["ngram"] += 1


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


# -- checks of what the draft returns, and the round timeline ---------------------------------------
def validate_cache(cache: SpeculationCache, batch: int, draft_len: int, vocab: int) -> SpeculationCache:
    """Refuse a malformed cache from the draft (garbage is a draft failure, never an output)."""
    for (row, k, token), (tokens, _) in cache.entries.items():
        if not (0 <= row < batch and 0 <= k <= draft_len and 0 <= token < vocab and len(tokens) == draft_len
                and int(np.min(tokens)) >= 0 and int(np.max(tokens)) < vocab):
            raise ValueError(f"draft returned a malformed cache entry {(row, k, token)}")
    return cache


def validate_speculation(speculation: Speculation, batch: int, draft_len: int, vocab: int) -> Speculation:
    """Refuse a just-in-time speculation of the wrong shape or with out-of-vocabulary tokens."""
    tokens = np.asarray(speculation.tokens)
    if tokens.shape != (batch, draft_len) or (tokens.size and (tokens.min() < 0 or tokens.max() >= vocab)):
        raise ValueError(f"draft returned a malformed speculation (shape {tokens.shape}, expected "
                         f"{(batch, draft_len)}, tokens within 0..{vocab - 1})")
    return speculation


def overlap_summary(timeline: list[dict]) -> dict:
    """How much of each verification the draft was working at the same time."""
    verify_total = sum(t["verify"][1] - t["verify"][0] for t in timeline)
    overlap = sum(max(0.0, min(t["verify"][1], t["draft"][1]) - max(t["verify"][0], t["draft"][0]))
                  for t in timeline)
    return {"verify_overlap_fraction": overlap / verify_total if verify_total else None}


SAGUARO = Saguaro()
