"""How many bonus-token guesses to cache per acceptance length (SSD paper, sec. 4.1).

Cache misses fall as a power law in fan-out: 1 - p_hit(F) ~ F^-r. With per-token acceptance rate a,
outcome k (k accepted, then a bonus) has probability ~ a^k (1 - a) for k < K and a^K for k = K. Minimising
the expected miss rate  sum_k P(k) F_k^-r  subject to sum_k F_k = B gives (Lagrange) F_k ∝ P(k)^(1/(1+r)):
  F_k = F_0 a^(k/(1+r))                          for k < K
  F_K = F_0 a^(K/(1+r)) (1 - a)^(-1/(1+r))       (the all-accepted outcome has no (1 - a) factor)
a capped geometric series, rounded here to integers >= 1 that sum exactly to B (largest remainders).
Both a and r are measured online, separately for speculations that came from a cache hit (primary)
and from a backup after a miss, since their acceptance differs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


def geometric_fan_out(acceptance: float, power: float, draft_len: int, budget: int) -> list[int]:
    """Integer fan-outs F_0..F_K (length K+1) summing to ``budget`` (>= K+1)."""
    if budget < draft_len + 1:
        raise ValueError(f"fan-out budget {budget} must be at least K+1 = {draft_len + 1}")
    a = min(max(acceptance, 1e-3), 1 - 1e-3)
    exponent = 1.0 / (1.0 + power)
    weights = np.array([a ** (k * exponent) for k in range(draft_len)]
                       + [a ** (draft_len * exponent) * (1 - a) ** (-exponent)])
    ideal = 1 + weights / weights.sum() * (budget - draft_len - 1)    # everyone gets >= 1
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


def bonus_rank(glue_logits: np.ndarray, own_next: int | None, bonus: int) -> int:
    """Rank of ``bonus`` in the draft's fork order at one position (own next token excluded)."""
    logits = glue_logits.astype(np.float64, copy=True)
    if own_next is not None:
        logits[own_next] = -math.inf
    return int((logits > logits[bonus]).sum())
