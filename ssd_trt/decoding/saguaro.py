"""SSD with Saguaro scheduling: the draft pre-speculates every likely verification outcome while the target verifies
(Kumar, Dao, May: "Speculative Speculative Decoding", ICLR 2026, arXiv 2603.03251).

One round of a group of SSD requests (adjacent rows of the engine step with the same settings), in the paper's
order. The draft runs on its own core (``draft_lane.py``), concurrently with the target:

  target:  verify [t*_prev, s_1..s_K] ──> outcome (k, t*) ──> 5. lookup ──> next speculation (6. on a miss)
  draft :  1. glue decode   one forward over [t*_prev, s_1..s_K]: draft logits at positions j = 0..K (where the
                            draft kept the chain it drafted s_1..s_K on -- one guess a round, after a hit or a
                            just-in-time backup: ``Speculation.held_logits`` -- its cache holds t*_prev, s_1..s_{K-1}
                            and their logits already, and it feeds s_K alone)
           2. forks         the B most likely outcomes (j, t*) become bonus guesses: the draft's top tokens at
                            each j (minus its own s_{j+1}: a rejected token has zero residual mass, so it can
                            never be t*) weighed by the odds of reaching j, plus prompt-lookup candidates
                            (fan_out.py)
           3. tree decode   K steps over all N = sum_j F_j branches at once; branch (j, t) attends to the prefix,
                            glue tokens 0..j and its own earlier tokens (a tree mask)
           4. cache fill    key (row, k=j, t*=t) -> that branch's K tokens and their draft distributions
  after the verification:
           5. lookup        the outcome's key in the cache: on a hit the next speculation is ready at once (a chain:
                            with the draft's cache already holding it); on a miss a kept chain goes back to the
                            verified prefix
           6. miss backup   the neural draft drafts K tokens just in time, or prompt lookup proposes them (near-zero
                            latency, for large batches: all rows must hit, p_hit^b); which one, the load policy
                            decides from measured costs (``batching/policy.py``)
  and the fan-out shapes learn from where the bonus token fell (fan_out.FanOutPlanner).

A row with no speculation to verify (a request that just joined, whose K changed, or that ran SD or AR rounds)
gets one from step 6's just-in-time loop first. Rows whose speculation the load policy paused run autoregressive
rounds and :func:`catch_up`: the draft feeds what they committed while it would otherwise idle.

The file reads in that order: the draft's side (:class:`DraftWorker`: steps 1-4, and 6's just-in-time loop), then
the group's side of one round of the engine step (:func:`start`: steps 1-4 submitted; ``round.py`` verifies every
row of every mode in one target forward; :func:`settle`: steps 5-6). Requests join and leave between rounds, each
with its own parameters and random streams.

With a feature draft (EAGLE-3, ``engines/feature_draft.py``) the glue decode runs before the target's features of
the speculation exist: s_1..s_K carry the draft's own, and every branch is pre-drafted behind them; after the
verification the draft is handed the target's features of t*_prev, s_1..s_k, and the next glue decode re-feeds
those tokens carrying them.

Sampling is lossless because the target verifies with the exact distribution each drafted token was drawn from
(``sampling.verify_chain``). With Saguaro sampling (C < 1) that distribution is sigma_{F,C}: the draft's top-(F+1)
tokens at a position -- a superset of the tokens cached as bonus guesses there, since the draft's own token is
excluded from the forks -- get C times their mass, which moves residual mass onto cached tokens (the reference
code scales top-(F+1) too). Every draft draw of SSD goes through :meth:`DraftWorker.draw`. Under a grammar
(structured output, ``grammar.py``) the glue logits and every draw are first masked along their branch's path (the
speculation s_1..s_j, the fork token, the branch's own tokens), from the request's matcher as it stood when the round
began: the bonus guesses and the cached branches are then tokens the grammar allows.

Tree decode re-feeds the glue tokens and earlier branch tokens at every step (their KV is not kept between steps)
because the attention op treats every cached slot as visible prefix; a masked cached region would remove that
re-feed (profiled cost: docs/decoding.md).
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ssd_trt.decoding.draft_lane import DraftLane
from ssd_trt.decoding.fan_out import FanOutPlanner, bonus_rank, confident_forks, ranked_forks
from ssd_trt.decoding.grammar import draft_copies, mask_rows
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.sampling import TokenDistribution, draw_rows, filter_logits, softmax
from ssd_trt.decoding.sequence import SequenceState, Speculation, held_tokens
from ssd_trt.decoding.settings import SSD
from ssd_trt.decoding.speculative import draft_tokens, masked_draws, validate_tokens
from ssd_trt.engines.base import Engine, last_indices
from ssd_trt.engines.feeding import feed_rows
from ssd_trt.ngram import lookup_followers, ngram_proposal


@dataclass
class SpeculationCache:
    """Step 4's result for one group: (row, k, t*) -> that branch's K tokens and their distributions (a held
    speculation where the draft kept the branch). ``kept``: when the draft kept each row's one branch (a chain),
    the row's draft length before the glue and the glue tokens it kept in front of the branch (j+1); None when the
    draft's cache went back to before the glue (a tree)."""
    entries: dict[tuple[int, int, int], Speculation]
    glue_logits: np.ndarray             # [B, K+1, V] the draft's view of the speculation being verified
    started: float
    finished: float
    kept: list[tuple[int, int]] | None = None


@dataclass
class Lookup:
    """Steps 5-6 for one row: whether its outcome was in the cache, and the backup that drafted its next
    speculation on a miss (jit | ngram; None after a hit, or when the draft failed)."""
    hit: bool
    backup: str | None = None


# -- the draft's side (on the draft lane) ------------------------------------------------------------------------
class DraftWorker:
    """The draft's side of a round for one group's rows: every method runs on the draft's thread. Each row has its
    own sampling parameters and random stream, so a row's draws depend on nothing else in the batch."""

    def __init__(self, draft: Engine, settings: SSD, seqs: Sequence[SequenceState]) -> None:
        self.draft, self.settings = draft, settings
        self.params: list[SamplingParams] = [s.params for s in seqs]
        self.rngs: list[np.random.Generator] = [s.draft_rng for s in seqs]
        # snapshots: the engine step goes on changing the requests while the draft works
        self.pending: list[list[int]] = [list(s.draft_pending) for s in seqs]   # committed, not in the draft cache
        self.history: list[list[int]] = [s.history for s in seqs]               # every committed token (lookups)
        self.grammars = draft_copies(seqs)      # each row's grammar, masking every draw along its branch's path
        # the rows whose speculation the draft's cache holds (Speculation.held_logits), and whether this draft keeps
        # what it drafts (a feature draft keeps nothing: a verified token is fed again carrying the target's
        # features, engines/feature_draft.py)
        self.held_specs: list[Speculation | None] = [s.speculation if held_tokens(s.speculation) else None
                                                     for s in seqs]
        self.held: list[np.ndarray | None] = [None if h is None else h.held_logits for h in self.held_specs]
        self.keeps = not draft.takes_target_features

    def speculate(self, bonus: list[int], speculations: list[Speculation | None], shapes: list[list[int]]
                  ) -> SpeculationCache:
        """Steps 1-4 for the speculations the target is verifying now (None: a finished row, fed zeros)."""
        started, K = time.perf_counter(), self.settings.draft_len
        glue = [[bonus[r]] + ([0] * K if s is None else [int(t) for t in s.tokens]) for r, s in enumerate(speculations)]
        chain = all(sum(shape) == 1 for shape in shapes)       # one guess a row: step 3 is a chain (_chain_decode)
        glue_logits = self._glue_decode(glue, keep=chain)                                           # 1.
        # under a grammar the bonus guesses are tokens it allows after s_1..s_j
        glue_logits = mask_rows(glue_logits, self._masks([[g[1:j + 1] for j in range(K + 1)] for g in glue]))
        forks = [self._forks(r, glue_logits[r], glue[r], shapes[r]) for r in range(len(glue))]     # 2.
        held, kept = None, None
        if chain and all(len(row_forks) == 1 for row_forks in forks):
            base = self.draft.lengths - len(glue[0])
            tokens, dists, held = self._chain_decode(glue, forks, shapes)                          # 3.
            if held is not None:
                kept = [(int(base[r]), forks[r][0][0] + 1) for r in range(len(glue))]
        else:
            if chain:     # (a row without its one guess: the tree decode re-feeds the glue itself)
                self.draft.rollback(self.draft.lengths - len(glue[0]))
            tokens, dists = self._tree_decode(glue, forks, shapes)                                 # 3.
        entries = {(r, j, t): Speculation(tokens[r, n, 1:].copy(), None if dists is None else dists[:, r, n],  # 4.
                                          "primary", None if held is None else held[r])
                   for r in range(len(glue)) for n, (j, t) in enumerate(forks[r])}
        return validated(SpeculationCache(entries, glue_logits, started, time.perf_counter(), kept), len(glue), K,
                         self.draft.spec.vocab_size)

    def _glue_decode(self, glue: list[list[int]], keep: bool = False) -> np.ndarray:
        """Step 1: draft logits at glue positions j = 0..K [B, K+1, V] (pending committed tokens ride along in front
        and stay in the cache; the glue itself is rolled back, the tree steps re-feed it, unless ``keep``: a chain
        decodes behind it).

        Where every row's speculation is held (the draft kept the chain it drafted s_1..s_K on, a hit), the cache
        already holds glue 0..K-1 and their logits: the decode feeds s_K alone, one token instead of the pending
        verified tokens plus K+1. Where only some are, the held rows give their slots back and are fed in full
        with the rest (one step either way: its width is the longest row's)."""
        size = len(glue[0])
        if all(h is not None for h in self.held) and not any(self.pending):
            last = feed_rows(self.draft, [g[-1:] for g in glue], tail=1)
            logits = np.concatenate([np.stack(self.held), last], axis=1)
        else:
            held = np.array([held_tokens(h) for h in self.held_specs], dtype=np.int32)
            if held.any():
                self.draft.rollback(self.draft.lengths - held)
            logits = feed_rows(self.draft, [p + g for p, g in zip(self.pending, glue)], tail=size)
        if not keep:
            self.draft.rollback(self.draft.lengths - size)
        self.pending = [[] for _ in glue]
        self.held, self.held_specs = [None] * len(glue), [None] * len(glue)
        return logits

    def _forks(self, row: int, glue_logits: np.ndarray, glue: list[int], shape: list[int]) -> list[tuple[int, int]]:
        """Step 2 for one row: the bonus guesses (j, t) to draft behind (policies in fan_out.py)."""
        K, settings, params = self.settings.draft_len, self.settings, self.params[row]
        lookup = [lookup_followers(self.history[row] + glue[:j + 1], limit=settings.lookup_forks)
                  if settings.lookup_forks else [] for j in range(K + 1)]
        if settings.fork_policy == "geometric":
            return ranked_forks(glue_logits, glue[1:], shape, lookup)
        # the draft's odds for the outcome: plain softmax when greedy (T=0 has no distribution to mimic)
        probs = (softmax(glue_logits) if params.greedy
                 else filter_logits(glue_logits, params).dense(glue_logits.shape[-1]))
        return confident_forks(probs, glue[1:], sum(shape), lookup)

    def _tree_decode(self, glue: list[list[int]], forks: list[list[tuple[int, int]]],
                     shapes: list[list[int]]) -> tuple[np.ndarray, TokenDistribution | None]:
        """Step 3: K steps over all branches at once (glue + earlier branch tokens re-fed); every branch of every row
        draws its next token in one call per step. Returns tokens [B, N, K+1] (column 0: the fork token) and the
        distributions they were drawn from [K, B, N] (None when greedy)."""
        K, batch, branches = self.settings.draft_len, len(glue), len(forks[0])
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
            masks = self._masks([[glue[row][1:j + 1] + [int(t) for t in tokens[row, n, :step]]
                                  for n, (j, _) in enumerate(forks[row])] for row in range(batch)])
            tokens[:, :, step], q = self.draw(mask_rows(logits, masks), np.broadcast_to(fan_next, (batch, branches)))
            if q is not None:
                step_dists.append(q)
        return tokens, TokenDistribution.stack(step_dists, self.draft.spec.vocab_size) if step_dists else None

    def _chain_decode(self, glue: list[list[int]], forks: list[list[tuple[int, int]]], shapes: list[list[int]]
                      ) -> tuple[np.ndarray, TokenDistribution | None, np.ndarray | None]:
        """Step 3 when every row has one guess (j, t): its branch sees glue 0..j and its own tokens, a chain. The glue
        decode left the glue in the cache: each row keeps it up to j and the K tokens are drafted one token a step (as
        SD drafts) instead of re-feeding glue and branch at every step, which on a CPU costs in proportion to the
        tokens fed (K=3: 4 one-token steps instead of steps of 5, 6 and 7 tokens; docs/real_pair.md). The draft
        attends to what the tree decode's branch attends to; the same tokens [B, 1, K+1] and distributions [K, B, 1].

        The draft keeps the chain (``keeps``): its cache ends holding glue 0..j, t, s_1..s_{K-1}, exactly what a hit
        on (j, t) commits and then speculates, and the logits [B, K, V] it drew s_1..s_K from are returned to go with
        the speculation (held). Settling rolls a row back to its verified prefix unless it hit."""
        K, batch = self.settings.draft_len, len(glue)
        base = self.draft.lengths - len(glue[0])
        self.draft.rollback(base + np.array([row_forks[0][0] + 1 for row_forks in forks], dtype=np.int32))
        tokens = np.zeros((batch, 1, K + 1), dtype=np.int64)
        tokens[:, 0, 0] = [row_forks[0][1] for row_forks in forks]
        fan_out = np.array([shape[:K] for shape in shapes])                 # [B, K]: F at each position
        step_dists: list[TokenDistribution] = []
        step_logits: list[np.ndarray] = []
        # draft_tokens' loop (speculative.py), kept in the tree decode's [B, branches = 1] layout
        logits = self.draft.forward(tokens[:, :, 0], self.draft.lengths[:, None].astype(np.int64))
        for step in range(1, K + 1):
            step_logits.append(logits[:, 0])
            masks = self._masks([[glue[row][1:row_forks[0][0] + 1] + [int(t) for t in tokens[row, 0, :step]]]
                                 for row, row_forks in enumerate(forks)])
            tokens[:, :, step], q = self.draw(mask_rows(logits, masks), fan_out[:, step - 1:step])
            if q is not None:
                step_dists.append(q)
            if step < K:
                logits = self.draft.forward(tokens[:, :, step], self.draft.lengths[:, None].astype(np.int64))
        dists = TokenDistribution.stack(step_dists, self.draft.spec.vocab_size) if step_dists else None
        if not self.keeps:
            self.draft.rollback(base)
            return tokens, dists, None
        return tokens, dists, np.stack(step_logits, axis=1)

    def _masks(self, paths: list[list[list[int]]]) -> list[list[np.ndarray | None] | None]:
        """Per row, its grammar's masks at the end of each of its ``paths`` (None: a row without a grammar)."""
        return [None if g is None else g.masks_along(row_paths) for g, row_paths in zip(self.grammars, paths)]

    def draw(self, logits: np.ndarray, fan_out: np.ndarray, active: list[bool] | None = None
             ) -> tuple[np.ndarray, TokenDistribution | None]:
        """Speculation tokens for every row of draft logits [B, ..., V]: argmax, or draws from sigma_{F+1,C}(q) where
        ``fan_out`` [B, ...] is F, the guesses that will sit at each token's position (module doc)."""
        C = self.settings.saguaro_c
        return draw_rows(logits, self.params, self.rngs, active,
                         boost=lambda q, row: q.boosted(np.asarray(fan_out[row]) + 1, C))

    def just_in_time(self, bonus: list[int], shapes: list[list[int]], wanted: list[bool]) -> list[Speculation]:
        """Step 6's neural backup (and a row's first speculation): draft K tokens after each row's new bonus token,
        now, drawing as the cache's branches do. Rows not ``wanted`` draw nothing (their tokens are not used): their
        pending tokens enter the cache, and a row whose speculation the cache holds stays as it was (the loop
        feeds every row at least one token: such a row re-feeds its last held slot, and the loop's additions are
        rolled back). The wanted rows' chains are kept: each speculation is held (``Speculation.held_logits``)."""
        K, batch = self.settings.draft_len, len(bonus)
        held = np.array([held_tokens(h) for h in self.held_specs], dtype=np.int32)
        before = self.draft.lengths
        if held.any():
            self.draft.rollback(before - (held > 0))
        feeds = [p + [b] if h is None else ([b] + [int(t) for t in h.tokens])[len(h.tokens) - 1:len(h.tokens)]
                 for p, b, h in zip(self.pending, bonus, self.held_specs)]
        fan_out = np.array([shapes[row][:K] for row in range(batch)])               # [B, K]: F at each position
        step_logits: list[np.ndarray] = []                                          # raw, before any grammar mask
        masked = masked_draws(lambda logits, i: self.draw(logits, fan_out[:, i], wanted), self.grammars)

        def draw(logits: np.ndarray, i: int):
            step_logits.append(logits)
            return masked(logits, i)
        # the bonus token is committed: the grammar copies stand after it (this worker's copies are not used again)
        tokens, dists = draft_tokens(self.draft, feeds, K, draw)
        validate_tokens(tokens, (batch, K), self.draft.spec.vocab_size, "a just-in-time speculation")
        keep = np.array(wanted) & self.keeps
        # kept: pending + bonus + s_1..s_{K-1}; a held row as it was; any other row: its pending, not the bonus
        without_bonus = before + np.array([len(p) for p in self.pending], dtype=np.int32)
        self.draft.rollback(np.where(keep, self.draft.lengths, np.where(held > 0, before, without_bonus)))
        self.pending = [[] for _ in bonus]
        logits = np.stack(step_logits, axis=1)                                      # [B, K, V]
        return [Speculation(tokens[r].copy(), None if dists is None else dists[r], "jit",
                            logits[r].copy() if keep[r] else None) for r in range(batch)]


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


def validated(cache: SpeculationCache, batch: int, draft_len: int, vocab: int) -> SpeculationCache:
    """Refuse a malformed cache (garbage from the draft is a draft failure, never an output)."""
    for (row, k, token), speculation in cache.entries.items():
        tokens = speculation.tokens
        if not (0 <= row < batch and 0 <= k <= draft_len and 0 <= token < vocab and len(tokens) == draft_len
                and int(np.min(tokens)) >= 0 and int(np.max(tokens)) < vocab):
            raise ValueError(f"draft returned a malformed cache entry {(row, k, token)}")
    return cache


# -- one group's round, the target's side (in the engine step) -------------------------------------------------
def bonus_tokens(seqs: Sequence[SequenceState]) -> list[int]:
    """Each row's t*_prev: the committed token the caches do not hold yet (0 for a finished row)."""
    return [s.unfed if s.unfed is not None else 0 for s in seqs]


def start(lane: DraftLane, planner: FanOutPlanner, seqs: Sequence[SequenceState], first: int,
          settings: SSD) -> Future | None:
    """Before the verification: rows without a speculation to verify draft one just in time; then steps 1-4 start
    on the draft's thread, for the verification that follows. None when the draft failed."""
    missing = [s.speculation is None and not s.finished for s in seqs]
    if any(missing) and not just_in_time(lane, planner, seqs, first, settings, missing):
        return None
    worker = DraftWorker(lane.rows(first, first + len(seqs)), settings, seqs)
    pending = lane.submit(worker.speculate, bonus_tokens(seqs), [s.speculation for s in seqs],
                          [planner.shape("primary")] * len(seqs))
    for seq in seqs:
        seq.draft_pending = []           # the glue decode feeds them
    return pending


def just_in_time(lane: DraftLane, planner: FanOutPlanner, seqs: Sequence[SequenceState], first: int, settings: SSD,
                 wanted: list[bool]) -> bool:
    """The ``wanted`` rows' next speculations, drafted now on the draft's thread; False when the draft failed."""
    worker = DraftWorker(lane.rows(first, first + len(seqs)), settings, seqs)
    made = lane.run(worker.just_in_time, bonus_tokens(seqs), [planner.shape("backup")] * len(seqs), wanted)
    if made is None:
        return False
    for seq, speculation, drafted in zip(seqs, made, wanted):
        seq.draft_pending = []           # the loop fed them
        if drafted:
            seq.speculation = speculation
    return True


def settle(lane: DraftLane, planner: FanOutPlanner, seqs: Sequence[SequenceState], first: int, settings: SSD,
           cache: SpeculationCache | None, verified: Sequence[list[int] | None], accepted: Sequence[int | None]
           ) -> list[Lookup | None]:
    """After the verification: each row's verified glue [t*_prev, s_1..s_k] is pending for the draft, less what its
    cache kept (a chain: the glue up to the guess's j, and on a hit the whole branch, which the next speculation
    starts from; otherwise the row goes back to its verified prefix); step 5 looks its outcome (k, t*) up in the
    group's cache (``cache``: steps 1-4's, None when the draft failed), and learns the fan-out from where t* fell;
    step 6 backs the misses up. Per row: its lookup (None: a row that did not run, or finished, or no cache)."""
    K = settings.draft_len
    kept = None if cache is None else cache.kept
    lookups: list[Lookup | None] = [None] * len(seqs)
    missed, released = [], {}
    for r, seq in enumerate(seqs):
        if verified[r] is None:
            continue
        proposal, k = seq.speculation, accepted[r]
        seq.speculation = None
        entry = None
        if not (seq.finished or cache is None or proposal is None):
            own_next = int(proposal.tokens[k]) if k < K else None
            planner.curve(proposal.source).observe(k, K, bonus_rank(cache.glue_logits[r, k], own_next, seq.unfed))
            entry = cache.entries.get((r, k, seq.unfed))                                               # 5.
            lookups[r] = Lookup(entry is not None)
        if kept is None:
            seq.draft_pending += verified[r]
        elif entry is None:               # the branch the draft kept is not what was committed: back to the prefix
            base, glue_kept = kept[r]
            overlap = min(len(verified[r]), glue_kept)
            released[r] = base + overlap
            seq.draft_pending += verified[r][overlap:]
        if entry is not None:
            seq.speculation = entry
        elif lookups[r] is not None:
            missed.append(r)
    if released:
        view = lane.rows(first, first + len(seqs))
        lane.run(lambda: view.rollback(np.array([released.get(r, n) for r, n in enumerate(view.lengths)],
                                                dtype=np.int32)))
    if missed:                                                                                         # 6.
        for r, backup in back_up(lane, planner, seqs, first, settings, missed).items():
            lookups[r].backup = backup
    return lookups


def back_up(lane: DraftLane, planner: FanOutPlanner, seqs: Sequence[SequenceState], first: int, settings: SSD,
            missed: list[int]) -> dict[int, str | None]:
    """Step 6 for the ``missed`` rows of a group: the neural draft just in time (``settings.backup`` jit, as the load
    policy resolved it) or prompt lookup (a point mass: still exact). The backup each row got (None: the draft
    failed, the row runs without a speculation)."""
    if settings.backup == "jit" and not lane.failed:
        wanted = [r in missed for r in range(len(seqs))]
        drafted = just_in_time(lane, planner, seqs, first, settings, wanted)
        return {r: "jit" if drafted else None for r in missed}
    for r in missed:
        tokens = np.asarray(ngram_proposal(seqs[r].history, settings.draft_len), dtype=np.int64)
        dists = None if seqs[r].params.greedy else TokenDistribution.point_mass(tokens)
        seqs[r].speculation = Speculation(tokens, dists, "ngram")
    return {r: "ngram" for r in missed}


def release_held(lane: DraftLane, slots: dict[int, int]) -> None:
    """Draft rows (index -> slots) whose held speculation was dropped (the request left SSD, or its K changed) give
    back the slots it held, so the draft's cache is at the invariant again (``Speculation.held_logits``)."""
    if not slots or lane.failed:
        return
    engine = lane.engine
    lane.run(lambda: engine.rollback(engine.lengths - np.array([slots.get(r, 0) for r in range(len(engine.lengths))],
                                                               dtype=np.int32)))


def settle_paused(seqs: Sequence[SequenceState], verified: Sequence[list[int] | None]) -> None:
    """After the verification, rows whose speculation is paused: what they committed is pending for the draft."""
    for seq, tokens in zip(seqs, verified):
        if tokens is not None:
            seq.draft_pending += tokens


def catch_up(lane: DraftLane, seqs: Sequence[SequenceState], first: int) -> Future | None:
    """Paused rows, in a round where other rows speculate: the draft's thread feeds what they committed while the
    target verifies, so that resuming costs less catch-up. (In a round where no row speculates the target runs on
    the draft's core too, and the tokens wait: the draft feeds them when speculation resumes.) None when there is
    nothing to feed."""
    if lane.failed or any(not s.draft_pending for s in seqs):
        return None
    pending = [list(s.draft_pending) for s in seqs]
    for seq in seqs:
        seq.draft_pending = []
    view = lane.rows(first, first + len(seqs))
    return lane.submit(lambda: feed_rows(view, pending) is None)


def overlap_summary(timeline: list[dict]) -> dict:
    """How much of each verification the draft was working at the same time."""
    verify_total = sum(t["verify"][1] - t["verify"][0] for t in timeline)
    overlap = sum(max(0.0, min(t["verify"][1], t["draft"][1]) - max(t["verify"][0], t["draft"][0]))
                  for t in timeline)
    return {"verify_overlap_fraction": overlap / verify_total if verify_total else None}
