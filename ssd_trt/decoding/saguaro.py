"""SSD with Saguaro scheduling: the draft pre-speculates every likely verification outcome while the
target verifies (Kumar, Dao, May: "Speculative Speculative Decoding", ICLR 2026, arXiv 2603.03251).

One round, as the two devices see it (the draft runs on its own core/thread, concurrently):

  target:  verify [t*_prev, s_1..s_K] ──> outcome (k, t*) ──> look up cache ──> next speculation
  draft :  1. glue decode   one forward over [t*_prev, s_1..s_K]: draft logits at positions j = 0..K
           2. forking       the B most likely outcomes (j, t*) become bonus guesses: the draft's top tokens
                            at each j (minus its own s_{j+1}: a rejected token has zero residual
                            mass, so it can never be t*) weighed by the odds of reaching j, plus
                            prompt-lookup candidates (fan_out.py)
           3. tree decode   K steps over all N = sum_j F_j branches at once; branch (j, t) attends to
                            the prefix, glue tokens 0..j and its own earlier tokens (a tree mask)
           4. cache fill    key (row, k=j, t*=t) -> that branch's K tokens and their draft probabilities
  on a hit the next speculation is ready at once; on a miss a backup speculates: the neural draft
  just in time below the critical batch size, prompt lookup (near-zero latency) at or above it.

Sampling is lossless because the target verifies with the exact distribution each drafted token was
drawn from (``sampling.verify_chain``). With Saguaro sampling (C < 1) that distribution is
sigma_{F,C}: the draft's top-(F+1) tokens at a position -- a superset of the tokens cached as bonus
guesses there, since the draft's own token is excluded from the forks -- get C times their mass,
which moves residual mass onto cached tokens (the reference code scales top-(F+1) too).

Tree decode re-feeds the glue tokens and earlier branch tokens at every step (their KV is not kept
between steps) because the attention op treats every cached slot as visible prefix; a masked cached
region would remove that re-feed (profiled cost in the README).
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np

from ssd_trt.decoding.backup import lookup_followers, ngram_proposal
from ssd_trt.decoding.batch import Sequences, feed_ragged, feed_rows, first_tokens
from ssd_trt.decoding.fan_out import FanOutPlanner, bonus_rank, confident_forks, ranked_forks
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.sampling import TokenDistribution, filter_logits, softmax, verify_chain
from ssd_trt.decoding.stats import RoundStats
from ssd_trt.engines.base import last_indices
from ssd_trt.errors import RequestError


@dataclass(frozen=True)
class SaguaroConfig:
    draft_len: int = 4                 # K
    fan_out_budget: int = 8            # B = sum_k F_k guesses per sequence and round
    fork_policy: str = "confidence"    # confidence (this round's odds) | geometric (the paper's shape)
    lookup_forks: int = 3              # prompt-lookup bonus guesses per position (0: draft guesses only)
    saguaro_c: float = 1.0             # C of sigma_{F,C}; 1 = plain draft sampling
    backup: str = "auto"               # auto | jit | ngram
    critical_batch: int = 4            # b*: batches >= b* use the fast backup on a miss
    prior_acceptance: float = 0.6
    prior_power: float = 0.6
    draft_timeout_s: float = 60.0
    draft_cores: tuple[int, ...] | None = None   # pin the draft worker thread (None: the engine's own)

    def __post_init__(self) -> None:
        if not 1 <= self.draft_len <= 32:
            raise RequestError(f"draft_len (K) must be in 1..32, got {self.draft_len}")
        if self.fan_out_budget < self.draft_len + 1:
            raise RequestError(f"fan_out_budget must be >= K+1 = {self.draft_len + 1}, got {self.fan_out_budget}")
        if not 0 < self.saguaro_c <= 1:
            raise RequestError(f"saguaro_c (C) must be in (0, 1], got {self.saguaro_c}")
        if self.fork_policy not in ("confidence", "geometric"):
            raise RequestError(f"fork_policy must be confidence or geometric, got {self.fork_policy!r}")
        if isinstance(self.lookup_forks, bool) or not isinstance(self.lookup_forks, int) or self.lookup_forks < 0:
            raise RequestError(f"lookup_forks must be a non-negative integer, got {self.lookup_forks!r}")
        if self.backup not in ("auto", "jit", "ngram"):
            raise RequestError(f"backup must be auto, jit or ngram, got {self.backup!r}")
        if self.draft_timeout_s <= 0:
            raise RequestError("draft_timeout_s must be positive")


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


class DraftWorker:
    """Owns the draft engine. Every method runs on the worker thread, one job at a time, in order."""

    def __init__(self, draft, config: SaguaroConfig, params: SamplingParams, seed: int | None) -> None:
        self.draft, self.config, self.params = draft, config, params
        self.rng = np.random.default_rng(None if seed is None else seed + 1)
        self.pending: list[list[int]] = []   # committed tokens the draft cache has not seen yet
        self.history: list[list[int]] = []   # every committed token (prompt lookup reads it)

    # -- bookkeeping ---------------------------------------------------------------------------
    def start(self, prompts: list[list[int]]) -> None:
        if self.config.draft_cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(self.config.draft_cores))
        self.draft.reset(len(prompts))
        self.pending = [list(p) for p in prompts]
        self.history = [list(p) for p in prompts]

    def commit(self, accepted_glue: list[list[int]]) -> None:
        """The verified prefix grew by these tokens (glue tokens 0..k of the last speculation)."""
        for row, tokens in enumerate(accepted_glue):
            self.pending[row] += tokens
            self.history[row] += tokens

    def _flush_pending(self, extra: list[list[int]]) -> np.ndarray:
        """Feed pending + extra tokens (the same number for every row); keep pending in the cache;
        return the logits over ``extra`` [B, len(extra[0]), V]."""
        size = len(extra[0])
        logits = feed_rows(self.draft, [p + e for p, e in zip(self.pending, extra)], tail=size)
        self.draft.rollback(self.draft.lengths - size)
        self.pending = [[] for _ in extra]
        return logits

    def _draw(self, logits: np.ndarray, fan_out: np.ndarray) -> tuple[np.ndarray, TokenDistribution | None]:
        """Speculation tokens for every row of draft logits [..., V] at once: argmax, or draws from
        sigma_{F+1,C}(q) where ``fan_out`` [...] is F, the guesses that will sit at each token's position."""
        if self.params.greedy:
            return np.argmax(logits, axis=-1).astype(np.int64), None
        q = filter_logits(logits, self.params).boosted(np.asarray(fan_out) + 1, self.config.saguaro_c)
        return q.sample(self.rng), q

    # -- the Saguaro round (draft side) ----------------------------------------------------------
    def speculate(self, bonus: list[int], spec: Speculation, shapes: list[list[int]]) -> SpeculationCache:
        started = time.perf_counter()
        K, batch = self.config.draft_len, len(bonus)
        glue = [[bonus[row]] + [int(t) for t in spec.tokens[row]] for row in range(batch)]

        # 1. glue decode: draft logits at j = 0..K (pending committed tokens ride along in front)
        glue_logits = self._flush_pending(glue)                       # [B, K+1, V]
        base = self.draft.lengths

        # 2. forking: B bonus guesses (j, t), never the draft's own next token (every row gets as many)
        forks = [self._forks(row, glue_logits[row], glue[row], shapes[row]) for row in range(batch)]
        branches = len(forks[0])

        # 3. tree decode: K steps over all branches at once (glue + earlier branch tokens re-fed);
        #    every branch of every row draws its next token in one vectorised call
        tokens = np.zeros((batch, branches, K + 1), dtype=np.int64)   # [:, :, 0] is the fork token
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
        dists = TokenDistribution.stack(step_dists, self.draft.spec.vocab_size) if step_dists else None  # [K, B, N]

        # 4. cache fill: (row, k, t*) -> the branch's K tokens and their draft distributions
        entries = {}
        for row in range(batch):
            for n, (j, t) in enumerate(forks[row]):
                entries[(row, j, t)] = (tokens[row, n, 1:].copy(), None if dists is None else dists[:, row, n])
        return SpeculationCache(entries, glue_logits, started, time.perf_counter())

    def _forks(self, row: int, glue_logits: np.ndarray, glue: list[int], shape: list[int]) -> list[tuple[int, int]]:
        """Step 2 for one row: the bonus guesses (j, t) to draft behind (policies in fan_out.py)."""
        K, config = self.config.draft_len, self.config
        lookup = [lookup_followers(self.history[row] + glue[:j + 1], limit=config.lookup_forks)
                  if config.lookup_forks else [] for j in range(K + 1)]
        if config.fork_policy == "geometric":
            return ranked_forks(glue_logits, glue[1:], shape, lookup)
        # the draft's odds for the outcome: plain softmax when greedy (T=0 has no distribution to mimic)
        probs = (softmax(glue_logits) if self.params.greedy
                 else filter_logits(glue_logits, self.params).dense(glue_logits.shape[-1]))
        return confident_forks(probs, glue[1:], sum(shape), lookup)

    def just_in_time(self, bonus: list[int], shapes: list[list[int]]) -> Speculation:
        """Neural backup: draft K tokens after each row's new bonus token, synchronously."""
        K, batch = self.config.draft_len, len(bonus)
        fed = [p + [b] for p, b in zip(self.pending, bonus)]       # pending prefix + the bonus token
        logits = feed_ragged(self.draft, fed)
        self.pending = [[] for _ in bonus]
        start = self.draft.lengths - 1                              # the prefix, without the bonus
        tokens = np.zeros((batch, K), dtype=np.int64)
        step_dists: list[TokenDistribution] = []
        for i in range(K):
            tokens[:, i], q = self._draw(logits, np.array([shapes[row][i] for row in range(batch)]))
            if q is not None:
                step_dists.append(q)
            if i + 1 < K:
                logits = self.draft.forward(tokens[:, i:i + 1], self.draft.lengths[:, None].astype(np.int64))[:, 0]
        self.draft.rollback(start)   # drop bonus + drafted tokens: the next glue decode re-reads them
        dists = TokenDistribution.stack(step_dists, self.draft.spec.vocab_size) if step_dists else None  # [K, B]
        return Speculation(tokens, None if dists is None else [dists[:, row] for row in range(batch)],
                           ["jit"] * batch)


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


def generate_saguaro(target, draft, prompts: list[list[int]], seqs: Sequences, rng: np.random.Generator,
                     config: SaguaroConfig) -> dict:
    params, batch, K = seqs.params, len(prompts), config.draft_len
    stats = RoundStats(mode="ssd", draft_len=K)
    planner = FanOutPlanner(K, config.fan_out_budget, config.prior_acceptance, config.prior_power)
    worker = DraftWorker(draft, config, params, params.seed)
    use_jit = config.backup == "jit" or (config.backup == "auto" and batch < config.critical_batch)
    # Not a `with` block: that would wait for a hung draft call. A hung draft is abandoned (its
    # thread finishes on its own; the runtime retires that draft engine); otherwise the thread is joined.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ssd-draft")
    try:
        return saguaro_rounds(pool, target, worker, planner, prompts, seqs, rng, config, stats, use_jit)
    finally:
        pool.shutdown(wait=not stats.draft_hung, cancel_futures=True)


def saguaro_rounds(pool: ThreadPoolExecutor, target, worker: DraftWorker, planner: FanOutPlanner,
            prompts: list[list[int]], seqs: Sequences, rng: np.random.Generator, config: SaguaroConfig,
            stats: RoundStats, use_jit: bool) -> dict:
    """The round loop of :func:`generate_saguaro` (target side; draft jobs go to ``pool``)."""
    params, batch, K = seqs.params, len(prompts), config.draft_len
    timeline: list[dict] = []

    def on_draft(fn, *args) -> Future:
        return pool.submit(fn, *args)

    def draft_result(future: Future):
        return future.result(timeout=config.draft_timeout_s)

    draft_started = on_draft(worker.start, prompts)        # draft prefill overlaps target prefill
    bonus = first_tokens(target, prompts, seqs, rng)
    try:
        draft_result(draft_started)
        spec = validate_speculation(draft_result(on_draft(worker.just_in_time, bonus,
                                                          [planner.shape("backup")] * batch)),
                                    batch, K, target.spec.vocab_size)
    except Exception as failure:   # noqa: BLE001 -- any draft failure: finish exactly without it
        return finish_without_draft(target, seqs, bonus, rng, stats, failure)
    round_index = 0
    while not seqs.all_done:
        shapes = [planner.shape("primary")] * batch          # guesses for the *next* round
        t_submit = time.perf_counter()
        cache_future = on_draft(worker.speculate, bonus, spec, shapes)

        # --- target: verify [t*_prev, s_1..s_K] in one pass (concurrently with the draft) ---
        t_verify = time.perf_counter()
        start = target.lengths
        feed = np.concatenate([np.array(bonus)[:, None], spec.tokens], axis=1)
        logits = target.forward(feed, start[:, None] + np.arange(K + 1)[None, :])
        outcomes = [verify_chain(spec.tokens[row], None if spec.dists is None else spec.dists[row],
                                 logits[row], params, rng) for row in range(batch)]
        t_verified = time.perf_counter()
        new_lengths = start.copy()
        accepted_glue = []
        for row, outcome in enumerate(outcomes):
            if seqs.done[row]:
                accepted_glue.append([])
                continue
            seqs.commit(row, [int(t) for t in spec.tokens[row, :outcome.accepted]] + [outcome.bonus])
            stats.record_round(outcome.accepted)
            new_lengths[row] = start[row] + 1 + outcome.accepted
            accepted_glue.append([bonus[row]] + [int(t) for t in spec.tokens[row, :outcome.accepted]])
        target.rollback(new_lengths)

        # --- lookup: a hit is the next speculation, ready now ---
        try:
            cache = validate_cache(draft_result(cache_future), batch, K, target.spec.vocab_size)
        except Exception as failure:   # noqa: BLE001
            return finish_without_draft(target, seqs, [o.bonus for o in outcomes], rng, stats, failure)
        t_looked_up = time.perf_counter()
        next_tokens = np.zeros((batch, K), dtype=np.int64)
        next_dists: list[TokenDistribution | None] | None = None if params.greedy else [None] * batch
        sources, missed = [], []
        for row, outcome in enumerate(outcomes):
            key = (row, outcome.accepted, outcome.bonus)
            own_next = int(spec.tokens[row, outcome.accepted]) if outcome.accepted < K else None
            rank = bonus_rank(cache.glue_logits[row, outcome.accepted], own_next, outcome.bonus)
            planner.curve(spec.sources[row]).observe(outcome.accepted, K, rank)
            if seqs.done[row]:
                sources.append("primary")
                continue
            hit = key in cache.entries
            stats.record_lookup(outcome.accepted, hit)
            if hit:
                next_tokens[row], row_dist = cache.entries[key]
                if next_dists is not None:
                    next_dists[row] = row_dist
                sources.append("primary")
            else:
                missed.append(row)
                sources.append("jit" if use_jit else "ngram")
        bonus = [o.bonus for o in outcomes]
        on_draft(worker.commit, accepted_glue)

        # --- miss: backup speculator ---
        if missed and use_jit:
            try:
                backup = validate_speculation(draft_result(on_draft(worker.just_in_time, bonus,
                                                                    [planner.shape("backup")] * batch)),
                                              batch, K, target.spec.vocab_size)
            except Exception as failure:   # noqa: BLE001
                return finish_without_draft(target, seqs, bonus, rng, stats, failure)
            for row in missed:
                next_tokens[row] = backup.tokens[row]
                if next_dists is not None:
                    next_dists[row] = backup.dists[row]
        elif missed:
            for row in missed:
                context = prompts[row] + seqs.tokens[row]
                next_tokens[row] = ngram_proposal(context, K)
                if next_dists is not None:
                    next_dists[row] = TokenDistribution.point_mass(next_tokens[row])
        for row in missed:
            stats.backup_rounds[sources[row]] += 1
        t_done = time.perf_counter()
        stats.add_time(draft_s=max(0.0, cache.finished - cache.started), verify_s=t_verified - t_verify,
                       wait_s=max(0.0, t_looked_up - t_verified) + (t_done - t_looked_up))
        timeline.append({"round": round_index, "verify": [t_verify - seqs.started, t_verified - seqs.started],
                         "draft": [cache.started - seqs.started, cache.finished - seqs.started],
                         "submitted": t_submit - seqs.started, "hits": batch - len(missed),
                         "backup": len(missed), "backup_s": t_done - t_looked_up,
                         "accepted": [o.accepted for o in outcomes], "source": list(spec.sources)})
        if next_dists is not None:   # finished rows keep a placeholder (their outcome is never committed)
            next_dists = [d if d is not None else TokenDistribution.point_mass(next_tokens[row])
                          for row, d in enumerate(next_dists)]
        spec = Speculation(next_tokens, next_dists, sources)
        round_index += 1
    summary = stats.summary()
    summary.update(overlap_summary(timeline))
    summary.update({"fan_out": planner.describe(), "timeline": timeline, "saguaro_c": config.saguaro_c,
                    "backup_policy": "jit" if use_jit else "ngram"})
    return summary


def validate_cache(cache: SpeculationCache, batch: int, draft_len: int, vocab: int) -> SpeculationCache:
    """Refuse a malformed cache from the draft (garbage is a draft failure, never an output)."""
    for (row, k, token), (tokens, _) in cache.entries.items():
        if not (0 <= row < batch and 0 <= k <= draft_len and 0 <= token < vocab and len(tokens) == draft_len
                and int(np.min(tokens)) >= 0 and int(np.max(tokens)) < vocab):
            raise ValueError(f"draft returned a malformed cache entry {(row, k, token)}")
    return cache


def validate_speculation(spec: Speculation, batch: int, draft_len: int, vocab: int) -> Speculation:
    """Refuse a just-in-time speculation of the wrong shape or with out-of-vocabulary tokens."""
    tokens = np.asarray(spec.tokens)
    if tokens.shape != (batch, draft_len) or (tokens.size and (tokens.min() < 0 or tokens.max() >= vocab)):
        raise ValueError(f"draft returned a malformed speculation (shape {tokens.shape}, expected "
                         f"{(batch, draft_len)}, tokens within 0..{vocab - 1})")
    return spec


def finish_without_draft(target, seqs: Sequences, bonus: list[int], rng: np.random.Generator,
                         stats: RoundStats, failure: BaseException) -> dict:
    """The draft died, hung or returned garbage: finish every row target-only, exactly as AR would.

    The target's cache holds the verified prefix; ``bonus`` is each row's committed-but-unfed token.
    """
    from ssd_trt.decoding.autoregressive import continue_autoregressive
    stats.draft_failures.append(f"{type(failure).__name__}: {failure}")
    stats.draft_hung = isinstance(failure, FutureTimeout)
    continue_autoregressive(target, seqs, bonus, rng)
    summary = stats.summary()
    summary["fallback"] = "autoregressive (draft failed)"
    return summary


def overlap_summary(timeline: list[dict]) -> dict:
    """How much of each verification the draft was working at the same time."""
    verify_total = sum(t["verify"][1] - t["verify"][0] for t in timeline)
    overlap = sum(max(0.0, min(t["verify"][1], t["draft"][1]) - max(t["verify"][0], t["draft"][0]))
                  for t in timeline)
    return {"verify_overlap_fraction": overlap / verify_total if verify_total else None}
