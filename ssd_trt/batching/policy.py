"""How SSD runs at the live batch size, from measured cost curves (SSD paper, sec. 4.3 and 5).

With b sequences in a round, the round waits for a backup whenever any of them misses the speculation cache:
P(some miss) = 1 - p_hit^b. A just-in-time neural backup costs a synchronous draft of K tokens for the batch;
prompt lookup costs nothing but proposes worse tokens. Verifying K+1 tokens per sequence also costs more
than one as the batch grows (the target's step turns from weight-bound to compute-bound). So for each
candidate -- speculation off (an autoregressive round), or K' = 1..K with either backup -- the policy
estimates tokens per second for the whole batch,

    b * E[tokens per round] / (max(verify(b, K'+1), speculate(b, K')) + P(some miss) * backup(b, K'))

and runs the best. E[tokens per round] = 1 + p_hit * A_hit(K') + (1 - p_hit) * A_backup(K'), with the
acceptances A and the hit rate p_hit measured online from the rounds run so far (exponential averages, per K'
and source; before any round, from the settings' prior acceptance a: A(K') = a + ... + a^K'). The step
times are measured on the engines (:class:`CostCurves`): each timed once per (batch, tokens) shape when
first needed, then updated by every round that runs that shape.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
import numpy as np

from ssd_trt.decoding.settings import SSD

EMA = 0.2          # weight of the newest observation in the running averages
PRIOR_HIT_RATE = 0.7


@dataclass
class CostCurves:
    """Seconds per engine step, by (role, rows, tokens per row): timed on the idle engines (:func:`calibrate`),
    then refreshed by every step the engine step runs. Between measured row counts the cost is interpolated
    linearly; a token count never measured is scaled from the nearest one measured (step cost ~ tokens)."""
    seconds: dict[tuple[str, int, int], float] = field(default_factory=dict)

    def covers(self, role: str, rows: int, tokens: int) -> bool:
        return any(key[0] == role and key[2] == tokens for key in self.seconds) and \
            max((key[1] for key in self.seconds if key[0] == role), default=0) >= rows

    def cost(self, role: str, rows: int, tokens: int) -> float:
        measured = sorted({key[2] for key in self.seconds if key[0] == role})
        if not measured:
            raise KeyError(f"no {role} step was timed")
        nearest = min(measured, key=lambda t: (abs(t - tokens), -t))
        scale = 1.0 if nearest == tokens else tokens / nearest
        points = sorted((key[1], value) for key, value in self.seconds.items() if key[0] == role and key[2] == nearest)
        xs, ys = [x for x, _ in points], [y for _, y in points]
        return float(np.interp(rows, xs, ys)) * scale

    def observe(self, role: str, rows: int, tokens: int, seconds: float) -> None:
        key = (role, rows, tokens)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def calibrate(self, engine, role: str, rows: list[int], token_counts: list[int]) -> None:
        """Time ``engine`` (idle: it is reset) at every (rows, tokens) pair not measured yet."""
        for count in rows:
            wanted = [t for t in token_counts if (role, count, t) not in self.seconds]
            if wanted:
                for tokens, seconds in timed_steps(engine, count, wanted).items():
                    self.seconds[(role, count, tokens)] = seconds


@dataclass
class Yield:
    """Running averages of what SSD rounds produced: accepted tokens per (K, hit | backup source), the hit rate."""
    prior_acceptance: float
    accepted: dict[tuple[int, str], float] = field(default_factory=dict)
    hit_rate: float | None = None

    def observe_round(self, draft_len: int, source: str, accepted: int) -> None:
        key = (draft_len, "primary" if source == "primary" else source)
        old = self.accepted.get(key)
        self.accepted[key] = accepted if old is None else (1 - EMA) * old + EMA * accepted

    def observe_lookup(self, hit: bool) -> None:
        self.hit_rate = float(hit) if self.hit_rate is None else (1 - EMA) * self.hit_rate + EMA * float(hit)

    def acceptance(self, draft_len: int, source: str) -> float:
        measured = self.accepted.get((draft_len, source))
        if measured is not None:
            return measured
        a = self.prior_acceptance * (0.5 if source == "ngram" else 1.0)
        return sum(a ** i for i in range(1, draft_len + 1))


@dataclass(frozen=True)
class Choice:
    """What a round of adaptive SSD rows runs: ``settings`` (K, backup), or None for an autoregressive round;
    with the estimate that chose it (tokens per second for the batch) and the alternatives'."""
    settings: SSD | None
    estimate: float
    alternatives: dict[str, float]


def choose(settings: SSD, batch: int, costs: CostCurves, measured: Yield) -> Choice:
    """The best of: no speculation, or K' = 1..K with each allowed backup, for ``batch`` live sequences."""
    options: dict[str, tuple[SSD | None, float]] = {"ar": (None, batch / costs.cost("target", batch, 1))}
    p_hit = PRIOR_HIT_RATE if measured.hit_rate is None else measured.hit_rate
    backups = ("jit", "ngram") if settings.backup == "auto" else (settings.backup,)
    for draft_len in range(1, settings.draft_len + 1):
        candidate = replace(settings, draft_len=draft_len, fan_out_budget=max(settings.fan_out_budget, draft_len + 1))
        verify = costs.cost("target", batch, draft_len + 1)
        speculate = costs.cost("draft", batch, candidate.tree_tokens) * draft_len + \
            costs.cost("draft", batch, draft_len + 1)
        for backup in backups:
            per_round = 1 + p_hit * measured.acceptance(draft_len, "primary") + \
                (1 - p_hit) * measured.acceptance(draft_len, backup)
            wait = (1 - p_hit ** batch) * costs.cost("draft", batch, 1) * draft_len if backup == "jit" else 0.0
            options[f"ssd K={draft_len} {backup}"] = (replace(candidate, backup=backup),
                                                      batch * per_round / (max(verify, speculate) + wait))
    best = max(options, key=lambda name: options[name][1])
    return Choice(options[best][0], options[best][1], {name: round(value, 2) for name, (_, value) in options.items()})


def timed_steps(engine, rows: int, token_counts: list[int], context: int = 32, repeats: int = 3
                ) -> dict[int, float]:
    """Seconds of one step of each token count on ``rows`` fresh rows holding ``context`` tokens (median of
    ``repeats``, after one untimed step); leaves the engine reset (it must hold no live rows)."""
    engine.reset(rows)
    engine.forward(np.zeros((rows, context), dtype=np.int64),
                   np.broadcast_to(np.arange(context), (rows, context)).copy())
    out = {}
    for tokens in token_counts:
        positions = np.broadcast_to(context + np.arange(tokens), (rows, tokens)).copy()
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            engine.forward(np.zeros((rows, tokens), dtype=np.int64), positions)
            times.append(time.perf_counter() - started)
            engine.rollback(np.full(rows, context, dtype=np.int32))
        out[tokens] = float(np.median(times[1:]))
    engine.reset(1)
    return out
