"""Which bonus-token guesses (k, t*) to cache, and how many per acceptance length (SSD paper, sec. 4.1).

Cache misses fall as a power law in fan-out: 1 - p_hit(F) ~ F^-r. With per-token acceptance rate a,
outcome k (k accepted, then a bonus) has probability ~ a^k (1 - a) for k < K and a^K for k = K. Minimising
the expected miss rate  sum_k P(k) F_k^-r  subject to sum_k F_k = B gives (Lagrange) F_k ∝ P(k)^(1/(1+r)):
  F_k = F_0 a^(k/(1+r))                          for k < K
  F_K = F_0 a^(K/(1+r)) (1 - a)^(-1/(1+r))       (the all-accepted outcome has no (1 - a) factor)
a capped geometric series, rounded here to integers >= 1 that sum exactly to B (largest remainders).
Both a and r are measured online, separately for speculations that came from a cache hit (primary)
and from a backup after a miss, since their acceptance differs.

Two ways to spend the budget B on concrete guesses (``settings.SSD.fork_policy``):
* geometric (the paper's): F_k from the shape above, the top-F_k draft tokens at each position.
* confidence: the same objective -- cache the B most likely outcomes -- with this round's own odds
  instead of the average ones. If the draft is calibrated, outcome (k, t) has probability
      P(k, t*=t) ~ prod_{i<k} q_i(s_{i+1}) * q_k(t)     (t != s_{k+1} for k < K: a rejected token has
                                                          zero residual mass, so it is never t*)
  so a position after a shaky draft token gets few guesses and a position the draft is sure of gets many.
Either way prompt-lookup candidates (tokens that followed the same n-gram earlier in the sequence,
``ngram.lookup_followers``) may join the guesses: a copied span is what the small draft misses most.
Which tokens are cached never changes the output -- verification does not look at the cache -- only
the hit rate.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import numpy as np

from ssd_trt.decoding.sampling import top_tokens

# Prior probability that a lookup candidate is the bonus token, by matched n-gram length. Rough (the
# hit rate on the project prompts was the same with a table 0.1 higher); it only orders lookup
# candidates against the draft's own guesses in the confidence policy.
LOOKUP_PRIOR = {1: 0.05, 2: 0.3, 3: 0.5}

def geometric_fan_out(acceptance: float, power: float, draft_len: int, budget: int) -> list[int]:
    """Integer fan-outs F_0..F_K (length K+1) summing to ``budget``. With B >= K+1 every acceptance length gets at
    least one guess (the paper's shapes); a smaller budget goes to the likeliest outcomes and leaves the others at
    F_k = 0 (their misses go to the backup: ``settings.min_fan_out_budget``)."""
    a = min(max(acceptance, 1e-3), 1 - 1e-3)
    exponent = 1.0 / (1.0 + power)
    weights = np.array([a ** (k * exponent) for k in range(draft_len)]
                       + [a ** (draft_len * exponent) * (1 - a) ** (-exponent)])
    floor = 1 if budget >= draft_len + 1 else 0
    ideal = floor + weights / weights.sum() * (budget - floor * (draft_len + 1))
    shape = np.floor(ideal).astype(int)
    for index in np.argsort(-(ideal - shape), kind="stable")[:budget - shape.sum()]:
        shape[index] += 1
    return shape.tolist()


@dataclass
class MissCurve:
    """Online estimates of acceptance a and miss power r for one speculation source."""
    prior_acceptance: float
    prior_power: float
    max_rank: int = 64
    accepted: float = 0.0
    drafted: float = 0.0
    rank_counts: np.ndarray = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.rank_counts = np.zeros(self.max_rank + 1)

    def observe(self, accepted: int, draft_len: int, bonus_rank: int | None) -> None:
        """``bonus_rank``: 0-based rank of t* among the draft's fork candidates (None: unknown)."""
        self.accepted += accepted
        self.drafted += draft_len
        if bonus_rank is not None:
            self.rank_counts[min(bonus_rank, self.max_rank)] += 1

    @property
    def acceptance(self) -> float:
        prior_weight = 4 * 8  # a few rounds' worth of prior
        return (self.accepted + self.prior_acceptance * prior_weight) / (self.drafted + prior_weight)

    @property
    def power(self) -> float:
        """Least-squares slope of log(1 - p_hit(F)) against log F, over F with data."""
        total = self.rank_counts.sum()
        if total < 20:
            return self.prior_power
        miss = 1 - np.cumsum(self.rank_counts[:-1]) / total        # miss rate with F = 1, 2, ...
        fan = np.arange(1, len(miss) + 1)
        usable = (miss > 0) & (miss < 1) & (fan <= 16)
        if usable.sum() < 3:
            return self.prior_power
        slope = np.polyfit(np.log(fan[usable]), np.log(miss[usable]), 1)[0]
        return float(min(max(-slope, 0.05), 3.0))


@dataclass
class FanOutPlanner:
    """Fan-out shapes after a hit (primary) and after a miss (backup), re-estimated every round."""
    draft_len: int
    budget: int
    prior_acceptance: float = 0.6
    prior_power: float = 0.6
    curves: dict[str, MissCurve] = field(default_factory=dict)

    def curve(self, source: str) -> MissCurve:
        key = "primary" if source == "primary" else "backup"
        if key not in self.curves:
            self.curves[key] = MissCurve(self.prior_acceptance, self.prior_power)
        return self.curves[key]

    def shape(self, source: str) -> list[int]:
        curve = self.curve(source)
        return geometric_fan_out(curve.acceptance, curve.power, self.draft_len, self.budget)

    def describe(self) -> dict:
        return {key: {"acceptance": round(c.acceptance, 4), "power": round(c.power, 4),
                      "shape": geometric_fan_out(c.acceptance, c.power, self.draft_len, self.budget)}
                for key, c in self.curves.items()}


class FanOutPlanners:
    """One :class:`FanOutPlanner` per SSD settings, made on first use: what the engine step's SSD groups learn. The
    backup that covers a miss does not change where the bonus token falls, so settings that differ only in it share
    one planner."""

    def __init__(self) -> None:
        self._by_settings: dict = {}

    def get(self, settings) -> FanOutPlanner:
        """The planner of SSD groups with these (resolved) settings."""
        key = planner_key(settings)
        if key not in self._by_settings:
            self._by_settings[key] = FanOutPlanner(settings.draft_len, settings.fan_out_budget,
                                                   settings.prior_acceptance, settings.prior_power)
        return self._by_settings[key]

    def describe(self, settings) -> dict:
        """The shapes learned for these settings (empty when none ran: e.g. an adaptive request the load policy ran
        with another K)."""
        planner = self._by_settings.get(planner_key(settings))
        return {} if planner is None else planner.describe()


@functools.lru_cache(maxsize=1024)
def planner_key(settings):
    """``settings`` with the backup left out (a pure function of frozen settings, cached: a round asks per group)."""
    return replace(settings, backup="auto")


def bonus_rank(glue_logits: np.ndarray, own_next: int | None, bonus: int) -> int:
    """Rank of ``bonus`` in the draft's fork order at one position (own next token excluded)."""
    logits = glue_logits.astype(np.float64, copy=True)
    if own_next is not None:
        logits[own_next] = -math.inf
    return int((logits > logits[bonus]).sum())


Candidates = list[list[tuple[int, int]]]   # per position j: lookup (token, matched n-gram length)


def ranked_forks(glue_logits: np.ndarray, own_next: list[int], shape: list[int],
                 lookup: Candidates) -> list[tuple[int, int]]:
    """Geometric policy: F_j guesses at position j -- its lookup candidates, then the draft's top tokens."""
    forks = []
    for j, fan in enumerate(shape):
        logits = glue_logits[j].astype(np.float64, copy=True)
        if j < len(own_next):
            logits[own_next[j]] = -math.inf
        chosen = [t for t, _ in lookup[j] if j >= len(own_next) or t != own_next[j]][:fan]
        for token in top_tokens(logits, fan + len(chosen)):
            if len(chosen) == fan:
                break
            if int(token) not in chosen:
                chosen.append(int(token))
        forks += [(j, t) for t in chosen]
    return forks


def confident_forks(glue_probs: np.ndarray, own_next: list[int], budget: int,
                    lookup: Candidates) -> list[tuple[int, int]]:
    """Confidence policy: the ``budget`` outcomes (j, t) with the highest estimated probability.

    ``glue_probs`` [K+1, V]: the draft's distributions at glue positions 0..K; ``own_next`` its K
    drafted tokens (s_1..s_K). A lookup candidate scores as if the draft gave it max(q, prior).
    """
    reach, scored = 1.0, []
    for j, q in enumerate(glue_probs):
        q = q.astype(np.float64, copy=True)
        own = own_next[j] if j < len(own_next) else None
        if own is not None:
            stay, q[own] = q[own], 0.0
        for token in top_tokens(q, budget):
            scored.append((reach * q[token], j, int(token)))
        for token, size in lookup[j]:
            if token != own:
                scored.append((reach * max(q[token], LOOKUP_PRIOR.get(size, max(LOOKUP_PRIOR.values()))), j, token))
        if own is not None:
            reach *= stay
    scored.sort(key=lambda item: -item[0])
    forks: list[tuple[int, int]] = []
    for _, j, token in scored:
        if (j, token) not in forks:
            forks.append((j, token))
            if len(forks) == budget:
                break
    return forks
