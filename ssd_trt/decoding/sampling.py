"""The verification math, once. Every strategy calls these functions.

Notation (Leviathan et al. 2023; Chen et al. 2023): the draft proposes x ~ q, the target's
distribution is p. Accepting x with probability min(1, p(x)/q(x)) and otherwise sampling from the
residual norm(max(0, p - q)) yields exactly p. Any proposal q works -- including Saguaro's sigma_{F,C}
(Kumar, Dao, May 2026, sec. 4) -- provided verification uses the very q the draft sampled from.
Temperature, top-k and top-p are applied to target and draft logits by the same function.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ssd_trt.decoding.params import SamplingParams


def softmax(logits: np.ndarray) -> np.ndarray:
    """softmax over the last axis, float64 (-inf logits get probability 0)."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    return probs / probs.sum(axis=-1, keepdims=True)


def processed_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """softmax(logits / T) restricted to top-k and the top-p nucleus, renormalised. [..., V] float64."""
    z = np.asarray(logits, dtype=np.float64) / max(params.temperature, 1e-8)
    vocab = z.shape[-1]
    if 0 < params.top_k < vocab:
        kth = np.partition(z, vocab - params.top_k, axis=-1)[..., vocab - params.top_k, None]
        z = np.where(z >= kth, z, -np.inf)
    probs = softmax(z)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_probs, axis=-1) - sorted_probs   # mass strictly above each token
        keep_sorted = before < params.top_p                        # the nucleus always keeps the top token
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def saguaro_probs(probs: np.ndarray, fan_out: int, downweight: float) -> np.ndarray:
    """Saguaro's sigma_{F,C}: the draft's own top-F tokens get C times their mass, then renormalise.

    sigma_{F,C}(z)_t ∝ C*exp(z_t) for t in top-F(z), exp(z_t) otherwise (0 < C <= 1). Lowering q on
    the tokens the speculation cache holds as bonus candidates raises max(0, p - q) there, so the
    residual -- hence the bonus token t* -- lands in the cache more often.
    """
    if fan_out <= 0 or downweight == 1.0:
        return probs
    top = np.argpartition(-probs, min(fan_out, probs.shape[-1]) - 1, axis=-1)[..., :fan_out]
    scaled = probs.copy()
    np.put_along_axis(scaled, top, np.take_along_axis(probs, top, axis=-1) * downweight, axis=-1)
    return scaled / scaled.sum(axis=-1, keepdims=True)


def top_tokens(logits: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` highest-scoring token ids, best first (O(V) partition, then a tiny sort)."""
    count = min(count, logits.shape[-1])
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    top = np.argpartition(-logits, count - 1)[:count]
    return top[np.argsort(-logits[top], kind="stable")]


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw of one token from a probability vector."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from the target's logits [V]: argmax when greedy, else a sample of p."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(processed_probs(logits, params), rng)


@dataclass(frozen=True, slots=True)
class Outcome:
    """A verification outcome v = (k, t*): k drafted tokens accepted, then the bonus token t*."""
    accepted: int
    bonus: int


def verify_chain(draft_tokens: np.ndarray, draft_probs: np.ndarray | None, target_logits: np.ndarray,
                 params: SamplingParams, rng: np.random.Generator) -> Outcome:
    """Verify s_1..s_K against target logits at K+1 positions ([K+1, V]: position i scores s_{i+1}).

    Greedy: accept while s_i == argmax p_i. Sampling: accept s_i w.p. min(1, p_i(s_i)/q_i(s_i)); at
    the first rejection draw t* from norm(max(0, p_i - q_i)); if all K pass, draw t* from p_{K+1}.
    ``draft_probs`` [K, V] must be the distributions s_i were actually sampled from.
    """
    num_draft = len(draft_tokens)
    if params.greedy:
        choices = np.argmax(target_logits, axis=-1)
        for i in range(num_draft):
            if draft_tokens[i] != choices[i]:
                return Outcome(i, int(choices[i]))
        return Outcome(num_draft, int(choices[num_draft]))
    for i in range(num_draft):
        p = processed_probs(target_logits[i], params)
        token, q = int(draft_tokens[i]), draft_probs[i]
        if q[token] > 0 and rng.random() * q[token] < p[token]:      # u < p/q without dividing
            continue
        return Outcome(i, sample(residual(p, q), rng))
    return Outcome(num_draft, sample(processed_probs(target_logits[num_draft], params), rng))


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)); when p == q exactly (nothing left) fall back to p."""
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 0 else p


def verify_tree_children(children: list[int], child_probs: np.ndarray | None, p: np.ndarray,
                         params: SamplingParams, rng: np.random.Generator) -> tuple[int | None, int | None]:
    """One level of tree verification: pick which child (if any) continues the accepted path.

    Greedy: the child equal to argmax p, if present. Sampling (SpecInfer's multi-draft rule, Miao et al.
    2024): children were drawn i.i.d. from q; try them in order, accepting child x w.p.
    min(1, p(x)/q(x)); after each rejection replace p by norm(max(0, p - q)). If all are rejected the
    bonus token is drawn from the final p. Returns (index of accepted child, None) or (None, bonus).
    """
    if params.greedy:
        best = int(np.argmax(p))
        return (children.index(best), None) if best in children else (None, best)
    for index, token in enumerate(children):
        if child_probs[token] > 0 and rng.random() * child_probs[token] < p[token]:
            return index, None
        p = residual(p, child_probs)
    return None, sample(p, rng)
