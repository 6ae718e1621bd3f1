"""How SSD runs at the live batch size, from measured costs (SSD paper, sec. 4.3 and 5).

With b sequences in a round, the round waits for a backup whenever any of them misses the speculation cache:
P(some miss) = 1 - p_hit^b. A just-in-time neural backup costs a synchronous draft of K tokens for the batch;
prompt lookup costs nothing but proposes worse tokens. Verifying K+1 tokens per sequence also costs more
than one as the batch grows (the target's step turns from weight-bound to compute-bound). So for each
candidate -- speculation off (an autoregressive round), or K' = 1..K with either backup -- the policy
estimates tokens per second for the whole batch,

    b * E[tokens per round] / (max(verify(b, K'+1), speculate(b, K')) + P(some miss) * backup(b, K'))

and ranks them. E[tokens per round] = 1 + p_hit * A_hit(K') + (1 - p_hit) * A_backup(K'), with the
acceptances A and the hit rate p_hit measured online from the rounds run so far (exponential averages, per K'
and source; before any round, from the settings' prior acceptance a: A(K') = a + ... + a^K'). The step
times are measured on the engines (``costs.CostCurves``): each timed once per (batch, tokens) shape when
first needed, then updated by every round that runs that shape. What the model leaves out (Python, waiting,
the draft feeding what it missed) :class:`LoadPolicy` measures: each option's rounds' wall time against the
model's, per load, and it keeps re-measuring the runner-up now and then.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from ssd_trt.batching.costs import TARGET_ALONE, CostCurves, running_average, settling_average
from ssd_trt.decoding.settings import SD, SSD

# weight of the newest observation in the running averages of a row-round's accepted tokens and of a lookup's hit: a
# row gains 1 to K+1 tokens per round, so one row-round says little; this remembers about the last 50 (a few requests'
# worth at batch 1)
YIELD_EMA = 0.02
PRIOR_HIT_RATE = 0.7


@dataclass
class Yield:
    """Averages of what SSD requests' rounds produced (``costs.settling_average``): accepted tokens per (K, hit |
    backup source | ``sd``: drafted in turn), the hit rate."""
    prior_acceptance: float
    accepted: dict[tuple[int, str], float] = field(default_factory=dict)
    rounds: dict[tuple[int, str], int] = field(default_factory=dict)
    hit_rate: float | None = None
    lookups: int = 0

    def observe_round(self, draft_len: int, source: str, accepted: int) -> None:
        key = (draft_len, "primary" if source == "primary" else source)
        count = self.rounds.get(key, 0)
        self.accepted[key] = settling_average(self.accepted.get(key), count, accepted, YIELD_EMA)
        self.rounds[key] = count + 1

    def observe_lookup(self, hit: bool) -> None:
        self.hit_rate = settling_average(self.hit_rate, self.lookups, float(hit), YIELD_EMA)
        self.lookups += 1

    def acceptance(self, draft_len: int, source: str) -> float:
        measured = self.accepted.get((draft_len, source))
        if measured is not None:
            return measured
        a = self.prior_acceptance * (0.5 if source == "ngram" else 1.0)
        return sum(a ** i for i in range(1, draft_len + 1))


@dataclass(frozen=True)
class Option:
    """One way to run a round of ``rows`` adaptive SSD rows of one family among ``others`` rows of other requests:
    ``settings`` (SSD: K and the backup; SD: K' drafted in turn with the verification; None: an autoregressive
    round), the tokens a family row is expected to gain per round (from the measured acceptance and hit rate) and
    the model's seconds per round (from the cost curves)."""
    settings: SSD | SD | None
    rows: int
    tokens: float
    seconds: float
    others: int = 0

    @property
    def batch(self) -> int:
        """Rows in the round."""
        return self.rows + self.others

    @property
    def estimate(self) -> float:
        """The model's tokens per second for the batch (each other row gains its one token a round, whatever the
        family runs: an autoregressive row's, at the least)."""
        return (self.rows * self.tokens + self.others) / self.seconds


@dataclass(frozen=True)
class Choice:
    """What a round of adaptive SSD rows runs: ``settings`` (SSD: K and the backup; SD: K' drafted in turn with
    the verification; None: an autoregressive round), the option's name, every option's score (tokens per second
    for the batch) and the option chosen (None for a round run as set, before the engines were timed)."""
    name: str
    settings: SSD | SD | None
    scores: dict[str, float]
    option: Option | None = None


def options(settings: SSD, batch: int, costs: CostCurves, measured: Yield, rows: int | None = None
            ) -> dict[str, Option]:
    """Every option for ``rows`` sequences of one family (default: all) among ``batch`` live ones -- no speculation;
    K' = 1..K drafted in turn with the verification (SD rounds); or K' = 1..K speculated beside it with each allowed
    backup -- with the model's tokens per row and seconds per round (module doc). The target verifies every row of
    the batch in one step, each at the round's widest feed (the others' rows are right-padded to K'+1); the draft
    drafts for the family's rows only."""
    rows = batch if rows is None else rows
    others = batch - rows

    def alone(tokens: int) -> float:
        """A target step while the draft is idle: on the draft's cores too (Engine.alone)."""
        return costs.cost(TARGET_ALONE if costs.covers(TARGET_ALONE, batch, tokens) else "target", batch, tokens)
    out: dict[str, Option] = {"ar": Option(None, rows, 1.0, alone(1), others)}
    for draft_len in range(1, settings.draft_len + 1):
        in_turn = costs.cost("draft", rows, 1) * draft_len + alone(draft_len + 1)
        out[f"sd K={draft_len}"] = Option(sd_option(draft_len), rows, 1 + measured.acceptance(draft_len, "sd"),
                                          in_turn, others)
    p_hit = PRIOR_HIT_RATE if measured.hit_rate is None else measured.hit_rate
    backups = ("jit", "ngram") if settings.backup == "auto" else (settings.backup,)
    for draft_len in range(1, settings.draft_len + 1):
        candidate = ssd_option(settings, draft_len, settings.backup)
        verify = costs.cost("target", batch, draft_len + 1)
        # the glue decode feeds s_K alone where the draft holds the speculation (a chain, kept after a hit and after a
        # just-in-time backup: saguaro.DraftWorker._glue_decode), else the K+1 glue tokens
        glue_tokens = 1 if candidate.step_tokens == 1 else draft_len + 1
        speculate = costs.cost("draft", rows, candidate.step_tokens) * draft_len + \
            costs.cost("draft", rows, glue_tokens)
        for backup in backups:
            per_round = 1 + p_hit * measured.acceptance(draft_len, "primary") + \
                (1 - p_hit) * measured.acceptance(draft_len, backup)
            # a just-in-time backup stalls the round when any of the family's rows misses
            wait = (1 - p_hit ** rows) * costs.cost("draft", rows, 1) * draft_len if backup == "jit" else 0.0
            out[f"ssd K={draft_len} {backup}"] = Option(ssd_option(settings, draft_len, backup), rows, per_round,
                                                        max(verify, speculate) + wait, others)
    return out


# The settings of an option, made once: validating a settings object costs more than scoring the option, and
# the policy asks for the same few every round. (Pure functions of frozen settings: the caches hold no state.)
@functools.lru_cache(maxsize=1024)
def sd_option(draft_len: int) -> SD:
    return SD(draft_len=draft_len)


@functools.lru_cache(maxsize=1024)
def ssd_option(settings: SSD, draft_len: int, backup: str) -> SSD:
    return settings.speculating(draft_len, backup)


class ShapeRecorder:
    """Stands in for :class:`CostCurves` to record which step shapes (role, tokens per row) a scoring reads."""

    def __init__(self) -> None:
        self.shapes: set[tuple[str, int]] = set()

    def covers(self, role: str, rows: int, tokens: int) -> bool:
        self.shapes.add((role, tokens))
        return True

    def cost(self, role: str, rows: int, tokens: int) -> float:
        self.shapes.add((role, tokens))
        return 1.0


def step_shapes(settings: SSD) -> dict[str, list[int]]:
    """The tokens per row of every step :func:`options` scores ``settings``' options by, per role: what the engine
    step times before the policy chooses (one function, so the two cannot drift apart)."""
    recorder = ShapeRecorder()
    options(settings, 1, recorder, Yield(settings.prior_acceptance))
    by_role: dict[str, set[int]] = {}
    for role, tokens in recorder.shapes:
        by_role.setdefault(role, set()).add(tokens)
    return {role: sorted(tokens) for role, tokens in by_role.items()}


def miss_backup(settings: SSD, batch: int, costs: CostCurves, measured: Yield, rows: int | None = None) -> str:
    """The backup of an SSD round at K = ``settings.draft_len`` that left it to the engine (``backup="auto"``), for
    ``rows`` rows with these settings (default: all) among ``batch``: of a just-in-time neural draft and prompt
    lookup, the one the model scores higher once its steps were timed; before that, the prior
    ``settings.critical_batch`` (b*: prompt lookup from b* rows on)."""
    if settings.backup != "auto":
        return settings.backup
    K, rows = settings.draft_len, batch if rows is None else rows
    if not (costs.covers("target", batch, K + 1) and costs.covers("draft", rows, settings.tree_tokens)):
        return "jit" if rows < settings.critical_batch else "ngram"
    scored = options(settings, batch, costs, measured, rows)
    return max(("jit", "ngram"), key=lambda backup: scored[f"ssd K={K} {backup}"].estimate)


def batch_bucket(batch: int) -> int:
    """Live batch sizes measured together: 1, 2, 3-4, 5-8, 9-16, ..."""
    return 1 << max(0, batch - 1).bit_length()


SLOWDOWN_MEMORY = 0.05   # weight of the newest round in a slowdown, once it has 20 rounds (before: their mean)


@dataclass
class Slowdown:
    """How much longer an option's rounds take than the model's step times say: measured seconds over the model's,
    per round, everything the model leaves out included (Python, waiting for the draft, the draft's feeding of
    pending tokens). The plain mean of the first 1 / SLOWDOWN_MEMORY rounds, then a slow exponential average."""
    ratio: float = 1.0
    rounds: int = 0

    def observe(self, ratio: float) -> None:
        self.ratio = settling_average(self.ratio, self.rounds, ratio, SLOWDOWN_MEMORY)
        self.rounds += 1


@dataclass
class LoadPolicy:
    """Which option adaptive SSD requests (one settings family) run at each load.

    An option's score is the batch's tokens per second: ``rows * tokens / (model seconds * slowdown)``. The tokens
    a row gains per round come from the measured acceptance and hit rate (:class:`Yield`; they do not depend on
    the load, so every bucket shares them). The seconds come from the cost curves, scaled by the option's
    *measured* slowdown at this batch bucket once it has ``MEASURED_AFTER`` rounds there; until then by its
    slowdown at the nearest bucket that measured it, or not at all. A round's time varies little, whereas the
    tokens it yields vary from 1 to K+1 per row: so the measurement that is kept per load is the one that
    settles in a few rounds, and a new load starts from what the nearest one measured.

    Now and then the runner-up runs ``EXPLORE_ROUNDS`` rounds in a row, so a slowdown measured under other
    conditions (or at another load) is refreshed and an option the model underrated is found. (Options far
    behind are not measured at every load: with the draft behind, as it is after autoregressive rounds, one
    exploration costs a prefill of the rows' histories on the draft, several rounds' worth at a large batch.)

    The first round after a switch of option pays for the switch: the draft catches up on what it missed (an
    autoregressive round leaves the draft's core to the target, ``round.py``), or speculation starts afresh. That
    one-off is not the option's slowdown, so it is filed apart (``switch_s``: its seconds beyond the round's
    expected time, averaged over switches either way) and charged where it belongs, to exploring. An
    exploration costs the gap for its rounds plus two switches, ``EXPLORE_ROUNDS * gap + 2 * switch_s / round``
    rounds of the best option (``gap`` = 1 - explored / best; a switch costs at least the model's time for the
    draft to feed its backlog), and is spaced to spend at most ``EXPLORE_BUDGET`` of the bucket's throughput,
    and no more often than every ``EXPLORE_EVERY`` rounds. Each exploration that leaves the best option the
    best doubles the spacing (up to 2^MAX_BACKOFF): at a steady load the policy's price tends to nothing, while
    a change of the best (by an exploration or a drift) resets it. For the same reason a measured option keeps
    running while the best is ahead of it by less than a switch costs over ``SWITCH_PAYBACK`` rounds: two
    options a few percent apart would otherwise trade places with every drift in the acceptance, each trade
    paying a switch."""
    slowdowns: dict[tuple[int, str], Slowdown] = field(default_factory=dict)
    rounds: dict[int, int] = field(default_factory=dict)
    explored: dict[int, int] = field(default_factory=dict)     # bucket: its round count at the last exploration
    exploring: dict[int, tuple[str, int]] = field(default_factory=dict)   # bucket: (option, rounds left)
    switch_s: dict[int, float] = field(default_factory=dict)   # bucket: a switch round's extra seconds (average)
    confirmed: dict[int, int] = field(default_factory=dict)    # bucket: explorations since its best last changed
    checking: set[int] = field(default_factory=set)            # buckets whose exploration just ended
    leader: dict[int, str] = field(default_factory=dict)       # bucket: its best option at the last round
    last: str | None = None                                     # the option the last round ran

    MEASURED_AFTER = 3
    SWITCH_PAYBACK = 16
    EXPLORE_EVERY = 16
    EXPLORE_ROUNDS = 4
    EXPLORE_BUDGET = 0.01
    MAX_BACKOFF = 4

    def choose(self, settings: SSD, batch: int, costs: CostCurves, measured: Yield, backlog: int = 0,
               rows: int | None = None) -> Choice:
        """For ``rows`` rows of this family (default: all) among ``batch``. ``backlog``: tokens the draft must feed
        before these rows can speculate (what it missed while they ran autoregressive rounds, and the prompts of rows
        it has never seen)."""
        bucket, rows = batch_bucket(batch), batch if rows is None else rows
        candidates = options(settings, batch, costs, measured, rows)
        scores = {name: option.estimate / self.slowdown(bucket, name) for name, option in candidates.items()}
        ranked = sorted(scores, key=lambda name: -scores[name])
        count = self.rounds[bucket] = self.rounds.get(bucket, 0) + 1
        best = ranked[0]
        # a switch costs what switches measured here, and at least the draft's catching up on the backlog (a
        # batched prefill of it: ~the rows' whole histories after a long autoregressive stretch)
        catch_up_s = costs.cost("draft", rows, math.ceil(backlog / rows)) if backlog else 0.0
        switch_rounds = self.switch_rounds(bucket, candidates[best].seconds * self.slowdown(bucket, best), catch_up_s)
        name = best
        if self.last in scores and self.last != best and \
                self.measured_rounds(bucket, self.last) >= self.MEASURED_AFTER and \
                (1 - scores[self.last] / scores[best]) * self.SWITCH_PAYBACK < switch_rounds / 2:
            name = self.last        # a switch to the best would not pay for itself within SWITCH_PAYBACK rounds
        if bucket in self.exploring:
            name, left = self.exploring.pop(bucket)
            if left > 1:
                self.exploring[bucket] = (name, left - 1)
        elif len(ranked) > 1:
            if bucket in self.checking:      # an exploration ended (had it changed the best, see below)
                self.checking.discard(bucket)
                self.confirmed[bucket] = self.confirmed.get(bucket, 0) + 1
            candidate = ranked[1]      # (scored by what the nearest load measured, where this one measured nothing)
            backoff = 2 ** min(self.confirmed.get(bucket, 0), self.MAX_BACKOFF)
            if count - self.explored.get(bucket, 0) >= backoff * self.explore_interval(
                    scores[candidate], scores[best], switch_rounds):
                name, self.explored[bucket] = candidate, count
                self.exploring[bucket] = (name, self.EXPLORE_ROUNDS - 1)
                self.checking.add(bucket)
        if self.leader.get(bucket) != best:  # a new best (whatever showed it): explore at the full rate again
            self.leader[bucket], self.confirmed[bucket] = best, 0
        return Choice(name, candidates[name].settings, {n: round(v, 1) for n, v in scores.items()}, candidates[name])

    def measured_rounds(self, bucket: int, name: str) -> int:
        slowdown = self.slowdowns.get((bucket, name))
        return 0 if slowdown is None else slowdown.rounds

    def slowdown(self, bucket: int, name: str) -> float:
        """The option's measured slowdown at ``bucket``, else at the nearest bucket that measured it (the smaller
        on a tie), else 1 (the model as it is)."""
        measured = [b for (b, n), s in self.slowdowns.items() if n == name and s.rounds >= self.MEASURED_AFTER]
        if not measured:
            return 1.0
        nearest = bucket if bucket in measured else \
            min(measured, key=lambda b: (abs(math.log2(b) - math.log2(bucket)), b))
        return self.slowdowns[(nearest, name)].ratio

    def switch_rounds(self, bucket: int, round_s: float, catch_up_s: float = 0.0) -> float:
        """An exploration's two switches (to the runner-up and back), in rounds of ``round_s`` seconds (the best
        option's): as measured, and at least ``catch_up_s``."""
        return max(2 * self.switch_s.get(bucket, 0.0), catch_up_s) / round_s if round_s > 0 else 0.0

    def explore_interval(self, runner_up: float, best: float, switch_rounds: float = 0.0) -> int:
        """Rounds between explorations of a runner-up scoring ``runner_up`` against ``best`` (tokens/s), when a
        switch costs ``switch_rounds`` rounds of the best option."""
        gap = 1.0 - runner_up / best if best > 0 else 0.0
        cost = self.EXPLORE_ROUNDS * gap + max(0.0, switch_rounds)
        return max(self.EXPLORE_EVERY, math.ceil(cost / self.EXPLORE_BUDGET))

    def observe(self, choice: Choice, seconds: float) -> None:
        """A round of ``choice`` took ``seconds``."""
        if choice.option is None:           # (an uncalibrated round: nothing to compare it with)
            return
        bucket, name = batch_bucket(choice.option.batch), choice.name
        switched, self.last = self.last is not None and self.last != name, name
        if not switched:
            self.slowdowns.setdefault((bucket, name), Slowdown()).observe(seconds / choice.option.seconds)
        elif (bucket, name) in self.slowdowns:  # (a first round after a switch has nothing to be compared with)
            extra = seconds - choice.option.seconds * self.slowdowns[(bucket, name)].ratio
            self.switch_s[bucket] = running_average(self.switch_s.get(bucket), extra)

    def describe(self) -> dict:
        return {f"{bucket} {name}": round(s.ratio, 3) for (bucket, name), s in sorted(self.slowdowns.items())}


@dataclass
class Learned:
    """What the load policy measured, kept across requests (a Generator holds one; every engine step over it adds to
    it): the engines' step times, per SSD settings family its yields and its policy, and per (K, budget) the batch
    sizes whose steps were timed."""
    costs: CostCurves = field(default_factory=CostCurves)
    policies: dict[SSD, LoadPolicy] = field(default_factory=dict)
    yields: dict[SSD, Yield] = field(default_factory=dict)
    timed_up_to: dict[tuple[int, int], int] = field(default_factory=dict)

    def policy(self, family: SSD) -> LoadPolicy:
        return self.policies.setdefault(family, LoadPolicy())

    def yield_of(self, settings: SSD) -> Yield:
        """What SSD rounds of requests with these settings produced."""
        if settings not in self.yields:
            self.yields[settings] = Yield(settings.prior_acceptance)
        return self.yields[settings]
