"""The verification math, once. Every strategy calls these functions.

Notation (Leviathan et al. 2023; Chen et al. 2023): the draft proposes x ~ q, the target's
distribution is p. Accepting x with probability min(1, p(x)/q(x)) and otherwise sampling from the
residual norm(max(0, p - q)) yields exactly p. Any proposal q works -- including Saguaro's sigma_{F,C}
(Kumar, Dao, May 2026, sec. 4) -- provided verification uses the very q the draft sampled from.
Temperature, top-k and top-p are applied to target and draft logits by the same function.

Sampling at the cost of the model, not of Python: :func:`filter_logits` filters, renormalises and
(with :meth:`TokenDistribution.sample`) draws for every row of a step at once -- all rows of a batch,
all branches of an SSD tree step -- and a distribution is kept on its support (the top-k tokens, or
the nucleus), as (token ids, probabilities), not as a full-vocabulary vector. Verification divides by
exactly the probabilities that were sampled from.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from ssd_trt.decoding.params import SamplingParams

NUCLEUS_FIRST_GUESS = 64     # candidates tried first for a top-p nucleus; grown x8 until it closes
PAD = -1                     # token id of the padding past a row's support (probability 0)


@dataclass(frozen=True, slots=True)
class TokenDistribution:
    """Distributions over the vocabulary, one per row (any leading shape), kept on their support.

    Sparse: ``ids`` [..., S] int64 and ``probs`` [..., S] float64 -- row r gives token ids[r, s]
    probability probs[r, s]; ids are distinct within a row, and entries past a row's support have
    id ``PAD`` and probability 0. Dense: ``ids`` is None and ``probs`` [..., V] is indexed by token id.
    """
    ids: np.ndarray | None
    probs: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """The leading (row) shape."""
        return self.probs.shape[:-1]

    def __getitem__(self, index) -> "TokenDistribution":
        """Rows of the distribution (``index`` selects along the leading axes only)."""
        return TokenDistribution(None if self.ids is None else self.ids[index], self.probs[index])

    def prob(self, tokens: np.ndarray) -> np.ndarray:
        """The probability of ``tokens[r]`` under row r (``tokens`` has the leading shape)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if self.ids is None:
            return np.take_along_axis(self.probs, tokens[..., None], axis=-1)[..., 0]
        return np.where(self.ids == tokens[..., None], self.probs, 0.0).sum(axis=-1)

    def sample(self, rng: np.random.Generator) -> np.ndarray:
        """One token per row by inverse CDF (one uniform per row, rows in C order)."""
        cdf = np.cumsum(self.probs, axis=-1)
        u = rng.random(self.shape) * cdf[..., -1]
        # the first entry whose cdf exceeds u; never past the last entry with mass (u*total may round up)
        index = np.minimum((cdf <= u[..., None]).sum(axis=-1), np.argmax(cdf, axis=-1))
        if self.ids is None:
            return index.astype(np.int64)
        return np.take_along_axis(self.ids, index[..., None], axis=-1)[..., 0]

    def dense(self, vocab: int) -> np.ndarray:
        """Full-vocabulary probabilities [..., V] (for the few places that need them, e.g. a residual)."""
        if self.ids is None:
            return self.probs
        flat_ids, flat_probs = self.ids.reshape(-1, self.ids.shape[-1]), self.probs.reshape(-1, self.ids.shape[-1])
        out = np.zeros((flat_ids.shape[0], vocab))
        rows, cols = np.nonzero(flat_ids != PAD)
        out[rows, flat_ids[rows, cols]] = flat_probs[rows, cols]      # ids are distinct within a row
        return out.reshape(self.shape + (vocab,))

    def boosted(self, counts: np.ndarray, downweight: float) -> "TokenDistribution":
        """Saguaro's sigma_{F,C}: each row's top-``counts[r]`` tokens get C times their mass, renormalised.

        sigma_{F,C}(z)_t ∝ C*exp(z_t) for t in top-F(z), exp(z_t) otherwise (0 < C <= 1). Lowering q on
        the tokens the speculation cache holds as bonus candidates raises max(0, p - q) there, so the
        residual -- hence the bonus token t* -- lands in the cache more often.
        """
        counts = np.broadcast_to(np.asarray(counts, dtype=np.int64), self.shape)
        most = int(counts.max(initial=0))
        if downweight == 1.0 or most <= 0:
            return self
        probs = self.probs.reshape(-1, self.probs.shape[-1])
        width = probs.shape[-1]
        most = min(most, width)
        top = np.argpartition(-probs, most - 1, axis=-1)[:, :most]            # unordered top-`most`
        order = np.argsort(-_take_rows(probs, top), axis=-1, kind="stable")
        ranked = _take_rows(top, order)                                        # best first
        chosen = np.arange(most)[None, :] < counts.reshape(-1, 1)
        scale = np.ones_like(probs)
        np.put_along_axis(scale, ranked, np.where(chosen, downweight, 1.0), axis=-1)
        scaled = probs * scale
        scaled /= scaled.sum(axis=-1, keepdims=True)
        return TokenDistribution(self.ids, scaled.reshape(self.probs.shape))

    @staticmethod
    def stack(rows: Sequence["TokenDistribution"], vocab: int) -> "TokenDistribution":
        """Stack same-shaped distributions along a new first axis (sparse ones padded to one width)."""
        if any(r.ids is None for r in rows):
            return TokenDistribution(None, np.stack([r.dense(vocab) for r in rows]))
        width = max(r.ids.shape[-1] for r in rows)
        # filled row by row rather than np.pad-ed: np.pad costs ~15 us a call, and a batch's draws stack every row
        ids = np.full((len(rows),) + rows[0].shape + (width,), PAD, dtype=np.int64)
        probs = np.zeros(ids.shape)
        for index, row in enumerate(rows):
            ids[index, ..., :row.ids.shape[-1]] = row.ids
            probs[index, ..., :row.probs.shape[-1]] = row.probs
        return TokenDistribution(ids, probs)

    @staticmethod
    def point_mass(tokens: np.ndarray) -> "TokenDistribution":
        """q = onehot(x) per row: a deterministic proposal (prompt lookup): accept w.p. min(1, p(x))."""
        tokens = np.asarray(tokens, dtype=np.int64)
        return TokenDistribution(tokens[..., None], np.ones(tokens.shape + (1,)))


def softmax(logits: np.ndarray) -> np.ndarray:
    """softmax over the last axis, float64 (-inf logits get probability 0)."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    return probs / probs.sum(axis=-1, keepdims=True)


def filter_logits(logits: np.ndarray, params: SamplingParams) -> TokenDistribution:
    """softmax(logits / T) restricted to the top-k tokens, then to the top-p nucleus of that, then to the tokens
    with at least ``min_p`` times the most likely one's probability, renormalised.

    For every row of ``logits`` [..., V] at once. top-k keeps the k highest logits and any tied with the
    k-th (as transformers' TopKLogitsWarper). The nucleus keeps, in order of probability (ties: lower
    token id first), every token whose predecessors hold less than top_p of the mass, so the most likely
    token always stays. The result is sparse when top-k or top-p restrict it, else dense.
    """
    if params.min_p > 0:
        return _min_p(filter_logits(logits, replace(params, min_p=0.0)), params.min_p)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    support, z = _finite_support(np.asarray(logits).reshape(-1, vocab))
    inverse_t = 1.0 / max(params.temperature, 1e-8)
    width = z.shape[-1]
    if 0 < params.top_k < width:
        columns, kth = _top_k_candidates(z, params.top_k)
        candidates = _take_rows(z, columns).astype(np.float64)
        probs = softmax(np.where(candidates >= kth[:, None], candidates * inverse_t, -np.inf))
        if params.top_p < 1.0:
            columns, probs = _nucleus(columns, probs, params.top_p)
    elif params.top_p < 1.0:
        columns, probs = _nucleus_of_full_softmax(z, inverse_t, params.top_p)
    elif support is None:
        return TokenDistribution(None, softmax(z.astype(np.float64) * inverse_t).reshape(lead + (vocab,)))
    else:
        columns, probs = np.broadcast_to(np.arange(width), z.shape), softmax(z.astype(np.float64) * inverse_t)
    ids = columns if support is None else \
        np.where(columns == PAD, PAD, _take_rows(support, np.maximum(columns, 0)))
    return TokenDistribution(ids.astype(np.int64).reshape(lead + ids.shape[-1:]), probs.reshape(lead + probs.shape[-1:]))


def _min_p(dist: TokenDistribution, min_p: float) -> TokenDistribution:
    """min-p filtering (Nguyen et al. 2024): each row keeps the tokens with probability >= min_p * its largest,
    renormalised (the most likely token always stays)."""
    probs = dist.probs
    kept = np.where(probs >= min_p * probs.max(axis=-1, keepdims=True), probs, 0.0)
    kept = kept / kept.sum(axis=-1, keepdims=True)
    return TokenDistribution(None if dist.ids is None else np.where(kept > 0, dist.ids, PAD), kept)


def _take_rows(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``values[r, index[r, j]]`` for 2-D arrays: np.take_along_axis(values, index, axis=-1) without its per-call
    set-up, which costs more than the gather itself on the one-row arrays most calls here see."""
    return values[np.arange(index.shape[0])[:, None], index]


def _finite_support(z: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """Rows [N, V] of mostly -inf logits (a reduced draft head: q = 0 off its subset) narrowed to the
    columns where any row is finite: (ids [N, S], logits [N, S]); else (None, z).

    Besides saving work this keeps numpy's selection fast: ``argpartition`` over tens of thousands of
    tied -inf entries took ~1.3 ms per row (measured on the embedded draft), 20x its cost on the rest.
    """
    columns = np.flatnonzero(np.isfinite(z).any(axis=0))
    if len(columns) * 2 > z.shape[-1] or not len(columns):
        return None, z
    return np.broadcast_to(columns, (z.shape[0], len(columns))), z[:, columns]


def _top_k_candidates(z: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Ids of each row's top-k logits [N, >=k] (widened to every logit tied with the k-th), and the k-th."""
    vocab = z.shape[-1]
    ids = np.argpartition(z, vocab - top_k, axis=-1)[:, vocab - top_k:]
    kth = _take_rows(z, ids).min(axis=-1)
    # a tie at -inf carries no mass: nothing to widen for
    widest = int(np.max(np.count_nonzero(z >= kth[:, None], axis=-1), where=np.isfinite(kth), initial=0))
    if widest > top_k:
        ids = np.argpartition(z, vocab - widest, axis=-1)[:, vocab - widest:]
    return ids, kth


def _nucleus(ids: np.ndarray, probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Keep each row's nucleus of a distribution given on candidates [N, S] (mass outside them: none)."""
    order = np.lexsort((ids, -probs), axis=-1)                  # by probability, ties by token id
    ids, probs = _take_rows(ids, order), _take_rows(probs, order)
    before = np.cumsum(probs, axis=-1) - probs                  # mass strictly above each token
    kept = np.where(before < top_p, probs, 0.0)
    return np.where(kept > 0, ids, PAD), kept / kept.sum(axis=-1, keepdims=True)


def _nucleus_of_full_softmax(z: np.ndarray, inverse_t: float, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The top-p nucleus of softmax(z / T) over the whole vocabulary, found among the top candidates.

    The normaliser is over all V tokens (one exp pass); the nucleus is looked for among the top 64, then
    512, ... tokens until each row's candidates hold at least top_p of the mass (then it closed inside).
    """
    vocab = z.shape[-1]
    top = z.max(axis=-1, keepdims=True)
    log_norm = top.astype(np.float64) * inverse_t + np.log(
        np.exp((z - top) * np.float32(inverse_t)).sum(axis=-1, keepdims=True, dtype=np.float64))
    count = NUCLEUS_FIRST_GUESS
    while True:
        count = min(count, vocab)
        ids = np.argpartition(z, vocab - count, axis=-1)[:, vocab - count:] if count < vocab \
            else np.broadcast_to(np.arange(vocab), z.shape)
        probs = np.exp(_take_rows(z, ids).astype(np.float64) * inverse_t - log_norm)
        if count == vocab or (probs.sum(axis=-1) >= top_p).all():
            return _nucleus(ids, probs, top_p)
        count *= 8


def next_tokens(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> np.ndarray:
    """One token per row from the target's logits [B, V]: argmax when greedy, else a draw from p."""
    if params.greedy:
        return np.argmax(logits, axis=-1).astype(np.int64)
    return filter_logits(logits, params).sample(rng)


def draw_rows(logits: np.ndarray, params: Sequence[SamplingParams], rngs: Sequence[np.random.Generator],
              active: Sequence[bool] | None = None, boost=None) -> tuple[np.ndarray, TokenDistribution | None]:
    """Tokens for every row r of ``logits`` [B, ..., V] by its own request's rule and random stream: argmax when
    ``params[r]`` is greedy, else a draw from its filtered distribution (``boost(q, r)`` may reshape it: Saguaro's
    sigma_{F,C}) with ``rngs[r]``. Rows not ``active`` take the argmax and draw nothing, so a request's stream
    advances only by its own draws, whatever else is batched with it. Returns tokens [B, ...] and the
    distributions drawn from [B, ...] (None when no row sampled; a greedy row carries a point mass)."""
    tokens = np.argmax(logits, axis=-1).astype(np.int64)
    sampled = [r for r in range(len(params)) if not params[r].greedy and (active is None or active[r])]
    if not sampled:
        return tokens, None
    dists = []
    for row in range(len(params)):
        if row not in sampled:
            dists.append(TokenDistribution.point_mass(tokens[row]))
            continue
        q = filter_logits(logits[row], params[row])
        q = q if boost is None else boost(q, row)
        tokens[row] = q.sample(rngs[row])
        dists.append(q)
    return tokens, TokenDistribution.stack(dists, logits.shape[-1])


def top_tokens(logits: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` highest-scoring token ids, best first (O(V) partition, then a tiny sort)."""
    count = min(count, logits.shape[-1])
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    top = np.argpartition(-logits, count - 1)[:count]
    return top[np.argsort(-logits[top], kind="stable")]


@dataclass(frozen=True, slots=True)
class Outcome:
    """A verification outcome v = (k, t*): k drafted tokens accepted, then the bonus token t*."""
    accepted: int
    bonus: int


def verify_chain(draft_tokens: np.ndarray, draft_q: TokenDistribution | None, target_logits: np.ndarray,
                 params: SamplingParams, rng: np.random.Generator) -> Outcome:
    """Verify s_1..s_K against target logits at K+1 positions ([K+1, V]: position i scores s_{i+1}).

    Greedy: accept while s_i == argmax p_i. Sampling: accept s_i w.p. min(1, p_i(s_i)/q_i(s_i)); at
    the first rejection draw t* from norm(max(0, p_i - q_i)); if all K pass, draw t* from p_{K+1}.
    ``draft_q`` (K rows) must be the distributions s_i were actually sampled from.
    """
    num_draft = len(draft_tokens)
    if params.greedy:
        choices = np.argmax(target_logits, axis=-1)
        for i in range(num_draft):
            if draft_tokens[i] != choices[i]:
                return Outcome(i, int(choices[i]))
        return Outcome(num_draft, int(choices[num_draft]))
    p = filter_logits(target_logits, params)                       # all K+1 positions at once
    tokens = np.asarray(draft_tokens, dtype=np.int64)
    p_drafted, q_drafted = p[:num_draft].prob(tokens), draft_q.prob(tokens)
    for i in range(num_draft):
        if q_drafted[i] > 0 and rng.random() * q_drafted[i] < p_drafted[i]:     # u < p/q without dividing
            continue
        return Outcome(i, residual_sample(p[i], draft_q[i], rng))
    return Outcome(num_draft, int(p[num_draft].sample(rng)))


def residual_sample(p: TokenDistribution, q: TokenDistribution, rng: np.random.Generator) -> int:
    """One draw from norm(max(0, p - q)) for a single row; when p == q exactly (nothing left), from p.

    max(0, p - q) is zero wherever p is, so it lives on p's support: only q's mass there is looked up.
    """
    support = np.flatnonzero(p.probs > 0) if p.ids is None else np.flatnonzero(p.ids != PAD)
    tokens = support if p.ids is None else p.ids[support]
    mass = np.maximum(p.probs[support] - _lookup(q, tokens), 0.0)
    if mass.sum() <= 0:
        return int(p.sample(rng))
    return int(TokenDistribution(tokens, mass / mass.sum()).sample(rng))


def _lookup(row: TokenDistribution, tokens: np.ndarray) -> np.ndarray:
    """Probabilities of many ``tokens`` under one row (sorted search over a sparse row's ids)."""
    if row.ids is None:
        return row.probs[tokens]
    order = np.argsort(row.ids, kind="stable")
    sorted_ids = row.ids[order]
    at = np.clip(np.searchsorted(sorted_ids, tokens), 0, len(sorted_ids) - 1)
    return np.where(sorted_ids[at] == tokens, row.probs[order][at], 0.0)


def verify_tree_children(children: list[int], child_q: TokenDistribution | None, p: TokenDistribution | None,
                         greedy_logits: np.ndarray | None, rng: np.random.Generator) -> tuple[int | None, int | None]:
    """One level of tree verification: pick which child (if any) continues the accepted path.

    Greedy (``greedy_logits`` given): the child equal to argmax p, if present. Sampling (SpecInfer's
    multi-draft rule, Miao et al. 2024): children were drawn i.i.d. from q; try them in order, accepting
    child x w.p. min(1, p(x)/q(x)); after each rejection replace p by norm(max(0, p - q)). If all are
    rejected the bonus token is drawn from the final p. Returns (index of accepted child, None) or
    (None, bonus). ``p`` and ``child_q`` are single rows.
    """
    if greedy_logits is not None:
        best = int(np.argmax(greedy_logits))
        return (children.index(best), None) if best in children else (None, best)
    support = np.flatnonzero(p.probs > 0) if p.ids is None else np.flatnonzero(p.ids != PAD)
    tokens = support if p.ids is None else p.ids[support]
    current, q_there = p.probs[support], _lookup(child_q, tokens)
    for index, token in enumerate(children):
        p_token = current[tokens == token].sum()
        q_token = float(child_q.prob(np.int64(token)))
        if q_token > 0 and rng.random() * q_token < p_token:
            return index, None
        remaining = np.maximum(current - q_there, 0.0)
        current = remaining / remaining.sum() if remaining.sum() > 0 else current
    return None, int(TokenDistribution(tokens, current).sample(rng))
