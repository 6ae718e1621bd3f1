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
backup), then the target side (:func:`saguaro_rounds`: verify, look up, learn, back up). That loop runs one
batch from start to end (feature drafts); the engine step runs the same DraftWorker per group of SSD requests
that join and leave, with the target side of a round in ``batching/round.py`` (``speculate``, ``verify``,
``settle_ssd``, ``back_up``).

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
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ssd_trt.decoding.batch import Sequences, first_tokens
from ssd_trt.decoding.feature_relay import Verified, chain_features, hand_over, prompt_features
from ssd_trt.decoding.fan_out import FanOutPlanner, bonus_rank, confident_forks, ranked_forks
from ssd_trt.decoding.mode import ResolvedMode
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.rounds import verify_and_commit
from ssd_trt.decoding.sampling import Outcome, TokenDistribution, draw_rows, filter_logits, softmax
from ssd_trt.decoding.settings import SSD
from ssd_trt.decoding.speculative import draft_tokens
from ssd_trt.decoding.stats import RoundStats
from ssd_trt.engines.affinity import pin
from ssd_trt.engines.base import Engine, last_indices
from ssd_trt.engines.feeding import feed_rows
from ssd_trt.engines.placement import ModelPlacement
from ssd_trt.ngram import lookup_followers, ngram_proposal


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

    def run(self, engines: Mapping[str, Engine], prompts: list[list[int]], seqs: Sequences,
            rng: np.random.Generator, resolved: ResolvedMode, placements: Mapping[str, ModelPlacement]) -> dict:
        return generate_saguaro(engines["target"], engines["draft"], prompts, seqs, rng, resolved.settings,
                                placements["draft"])


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

    def __init__(self, draft: Engine, config: SSD, params: list[SamplingParams], rngs: list[np.random.Generator],
                 cores: tuple[int, ...] | None) -> None:
        self.draft, self.config, self.params, self.rngs, self.cores = draft, config, params, rngs, cores
        self.pending: list[list[int]] = []   # committed tokens the draft cache has not seen yet
        self.history: list[list[int]] = []   # every committed token (prompt lookup reads it)

    def start(self, prompts: list[list[int]]) -> None:
        pin(self.cores)                      # this worker thread is the draft's device
        self.draft.reset(len(prompts))
        self.pending = [list(p) for p in prompts]
        self.history = [list(p) for p in prompts]

    def commit(self, accepted_glue: list[list[int]], verified: Verified) -> None:
        """The verified prefix grew by these tokens (glue tokens 0..k of the last speculation); a feature
        draft gets the target's features of them (``verified``; empty for an independent draft)."""
        for row, tokens in enumerate(accepted_glue):
            self.pending[row] += tokens
            self.history[row] += tokens
        hand_over(self.draft, verified)

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


# -- the target side: the round loop --------------------------------------------------------------
class DraftFailed(Exception):
    """The draft raised, hung past its timeout or returned garbage (the cause is chained). ``bonus`` is
    each row's committed-but-unfed token: where target-only decoding picks up."""

    def __init__(self, bonus: list[int]) -> None:
        super().__init__("the draft failed")
        self.bonus = list(bonus)


@dataclass
class Round:
    """What one round needs besides the engines: the worker's thread, the learned fan-out, the stats."""
    pool: ThreadPoolExecutor
    worker: DraftWorker
    planner: FanOutPlanner
    stats: RoundStats
    timeout_s: float
    use_jit: bool

    def on_draft(self, fn, *args) -> Future:
        return self.pool.submit(fn, *args)

    def result(self, future: Future):
        """The draft job's result; its exception, or a TimeoutError when it hangs past the timeout."""
        return future.result(timeout=self.timeout_s)


def generate_saguaro(target: Engine, draft: Engine, prompts: list[list[int]], seqs: Sequences,
                     rng: np.random.Generator, config: SSD,
                     placement: ModelPlacement = ModelPlacement()) -> dict:
    if config.draft_len is None or config.fan_out_budget is None:
        raise ValueError(f"generate_saguaro needs resolved settings (SSD.resolved(defaults)), got {config}")
    params, batch, K = seqs.params, len(prompts), config.draft_len
    stats = RoundStats(mode="ssd", draft_len=K)
    use_jit = config.backup == "jit" or (config.backup == "auto" and batch < config.critical_batch)
    # Not a `with` block: that would wait for a hung draft call. A hung draft is abandoned (its
    # thread finishes on its own; the runtime retires that draft engine); otherwise the thread is joined.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ssd-draft")
    draft_rng = np.random.default_rng(None if params.seed is None else params.seed + 1)
    state = Round(pool, DraftWorker(draft, config, [params] * batch, [draft_rng] * batch, placement.cores),
                  FanOutPlanner(K, config.fan_out_budget, config.prior_acceptance, config.prior_power),
                  stats, placement.timeout_s, use_jit)
    try:
        summary = saguaro_rounds(state, target, prompts, seqs, rng)
    except DraftFailed as failed:
        summary = finish_without_draft(target, seqs, failed.bonus, rng, stats, failed.__cause__)
    finally:
        pool.shutdown(wait=not stats.draft_hung, cancel_futures=True)
    return summary


def saguaro_rounds(state: Round, target: Engine, prompts: list[list[int]], seqs: Sequences,
                   rng: np.random.Generator) -> dict:
    """Rounds until every row is done: the draft pre-speculates the next round while the target verifies."""
    batch, K, vocab = len(prompts), state.worker.config.draft_len, target.spec.vocab_size
    timeline: list[dict] = []
    draft_started = state.on_draft(state.worker.start, prompts)     # draft prefill overlaps target prefill
    bonus = first_tokens(target, prompts, seqs, rng)
    state.on_draft(state.worker.commit, [[] for _ in prompts], prompt_features(target, state.worker.draft, prompts))
    speculation = guarded(bonus, lambda: first_speculation(state, draft_started, bonus, batch, vocab))
    while not seqs.all_done:
        t_submit = time.perf_counter()
        shapes = [state.planner.shape("primary")] * batch          # guesses for the *next* round
        cache_future = state.on_draft(state.worker.speculate, bonus, speculation, shapes)
        t_verify = time.perf_counter()                             # target: verify (draft: speculate)
        outcomes = verify_and_commit(target, bonus, speculation.tokens, speculation.dists, seqs, rng, state.stats)
        verified = chain_features(target, state.worker.draft, outcomes)   # now: the next target step overwrites them
        t_verified = time.perf_counter()
        glue = accepted_glue(bonus, speculation, outcomes)
        bonus = [previous if o is None else o.bonus for previous, o in zip(bonus, outcomes)]
        cache = guarded(bonus, lambda: validate_cache(state.result(cache_future), batch, K, vocab))
        t_looked_up = time.perf_counter()
        state.on_draft(state.worker.commit, glue, verified)
        learn_fan_out(state.planner, cache, speculation, outcomes)
        next_speculation, missed = look_up(cache, outcomes, seqs, K, state.use_jit, state.stats)
        if missed:
            guarded(bonus, lambda: back_up(state, next_speculation, missed, bonus, prompts, seqs, vocab))
        t_done = time.perf_counter()
        state.stats.add_time(draft_s=max(0.0, cache.finished - cache.started), verify_s=t_verified - t_verify,
                             wait_s=max(0.0, t_looked_up - t_verified) + (t_done - t_looked_up))
        timeline.append(round_record(len(timeline), seqs.started, t_submit, (t_verify, t_verified), cache,
                                     batch - len(missed), t_done - t_looked_up, outcomes, speculation.sources))
        speculation = next_speculation
    summary = state.stats.summary()
    summary.update(overlap_summary(timeline))
    summary.update({"fan_out": state.planner.describe(), "timeline": timeline,
                    "saguaro_c": state.worker.config.saguaro_c, "backup_policy": "jit" if state.use_jit else "ngram"})
    return summary


def guarded(bonus: list[int], job):
    """Run a step that needs the draft. Any failure of it -- an exception, a hang past the timeout, a
    malformed result -- becomes DraftFailed: the request then finishes exactly, without the draft."""
    try:
        return job()
    except Exception as failure:   # noqa: BLE001 -- any draft failure: finish exactly without it
        raise DraftFailed(bonus) from failure


def first_speculation(state: Round, draft_started: Future, bonus: list[int], batch: int, vocab: int) -> Speculation:
    """The first round has no cache to look in: the draft speculates just in time behind the first token."""
    state.result(draft_started)
    shapes = [state.planner.shape("backup")] * batch
    return validate_speculation(state.result(state.on_draft(state.worker.just_in_time, bonus, shapes)),
                                batch, state.worker.config.draft_len, vocab)


def accepted_glue(bonus: list[int], speculation: Speculation, outcomes: list[Outcome | None]) -> list[list[int]]:
    """Per row, the glue tokens now verified: t*_prev and s_1..s_k (nothing for finished rows). The new
    bonus tokens are not glue yet: they lead the next speculation."""
    return [[] if o is None else [int(bonus[row])] + [int(t) for t in speculation.tokens[row, :o.accepted]]
            for row, o in enumerate(outcomes)]


def learn_fan_out(planner: FanOutPlanner, cache: SpeculationCache, speculation: Speculation,
                  outcomes: list[Outcome | None]) -> None:
    """Where the bonus token fell among the draft's candidates: the data behind F_k's power law."""
    K = speculation.tokens.shape[1]
    for row, outcome in enumerate(outcomes):
        if outcome is None:
            continue
        own_next = int(speculation.tokens[row, outcome.accepted]) if outcome.accepted < K else None
        rank = bonus_rank(cache.glue_logits[row, outcome.accepted], own_next, outcome.bonus)
        planner.curve(speculation.sources[row]).observe(outcome.accepted, K, rank)


def look_up(cache: SpeculationCache, outcomes: list[Outcome | None], seqs: Sequences, draft_len: int,
            use_jit: bool, stats: RoundStats) -> tuple[Speculation, list[int]]:
    """A hit is the next speculation, ready now; returns it (misses left empty) and the rows that missed."""
    batch = len(outcomes)
    tokens = np.zeros((batch, draft_len), dtype=np.int64)
    dists: list[TokenDistribution | None] | None = None if seqs.params.greedy else [None] * batch
    sources, missed = [], []
    for row, outcome in enumerate(outcomes):
        if outcome is None:
            sources.append("primary")
            continue
        hit = (row, outcome.accepted, outcome.bonus) in cache.entries
        stats.record_lookup(outcome.accepted, hit)
        if hit:
            tokens[row], row_dist = cache.entries[(row, outcome.accepted, outcome.bonus)]
            if dists is not None:
                dists[row] = row_dist
            sources.append("primary")
        else:
            missed.append(row)
            sources.append("jit" if use_jit else "ngram")
    return Speculation(tokens, dists, sources), missed


def back_up(state: Round, speculation: Speculation, missed: list[int], bonus: list[int], prompts: list[list[int]],
            seqs: Sequences, vocab: int) -> None:
    """Fill the missed rows of ``speculation`` in place: the neural draft just in time, or prompt lookup."""
    batch, K = len(bonus), speculation.tokens.shape[1]
    if state.use_jit:
        shapes = [state.planner.shape("backup")] * batch
        backup = validate_speculation(state.result(state.on_draft(state.worker.just_in_time, bonus, shapes)),
                                      batch, K, vocab)
    for row in missed:
        if state.use_jit:
            speculation.tokens[row] = backup.tokens[row]
            if speculation.dists is not None:
                speculation.dists[row] = backup.dists[row]
        else:      # a deterministic proposal: a point mass, still exact
            speculation.tokens[row] = ngram_proposal(prompts[row] + seqs.tokens[row], K)
            if speculation.dists is not None:
                speculation.dists[row] = TokenDistribution.point_mass(speculation.tokens[row])
        state.stats.backup_rounds[speculation.sources[row]] += 1
    if speculation.dists is not None:   # finished rows keep a placeholder (their outcome is never committed)
        speculation.dists = [d if d is not None else TokenDistribution.point_mass(speculation.tokens[row])
                      for row, d in enumerate(speculation.dists)]


def round_record(index: int, origin: float, submitted: float, verify: tuple[float, float], cache: SpeculationCache,
                 hits: int, backup_s: float, outcomes: list[Outcome | None], sources: list[str]) -> dict:
    """One round of the timeline (seconds since the request started)."""
    return {"round": index, "verify": [verify[0] - origin, verify[1] - origin],
            "draft": [cache.started - origin, cache.finished - origin], "submitted": submitted - origin,
            "hits": hits, "backup": len(outcomes) - hits, "backup_s": backup_s,
            "accepted": [None if o is None else o.accepted for o in outcomes], "source": list(sources)}


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


def finish_without_draft(target: Engine, seqs: Sequences, bonus: list[int], rng: np.random.Generator,
                         stats: RoundStats, failure: BaseException | None) -> dict:
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


SAGUARO = Saguaro()
