"""The SSD load policy (``batching/policy.py``): the cost model ranks the options, each option's measured slowdown
against the model corrects it (at the nearest load measured until its own is), and the runner-up is re-measured
now and then, the more rarely the further behind it is."""
from __future__ import annotations

import pytest

from ssd_trt import SSD
from ssd_trt.batching.costs import CostCurves
from ssd_trt.batching.policy import Choice, LoadPolicy, Option, Yield, batch_bucket, options


def curves(verify_growth: float) -> CostCurves:
    """Step seconds: the target's step grows with rows x tokens by ``verify_growth``; the draft is 10x cheaper."""
    costs = CostCurves()
    for rows in (1, 2, 4, 8, 16):
        for tokens in (1, 2, 3):
            costs.seconds[("target", rows, tokens)] = 0.01 * (1 + verify_growth * rows * (tokens - 1))
        for tokens in (1, 2, 3, 4, 5, 7, 10, 18):
            costs.seconds[("draft", rows, tokens)] = 0.001 * (1 + 0.05 * rows * tokens)
    return costs


SETTINGS = SSD(draft_len=2, fan_out_budget=4)


def test_the_model_prefers_speculation_when_verifying_costs_little_and_not_when_it_costs_much():
    measured = Yield(prior_acceptance=0.6)
    cheap = options(SETTINGS, 4, curves(0.0), measured)
    assert max(cheap, key=lambda n: cheap[n].estimate).startswith("ssd")
    dear = options(SETTINGS, 16, curves(1.0), measured)
    assert max(dear, key=lambda n: dear[n].estimate) == "ar"
    # a miss stalls the whole batch for a just-in-time draft with probability 1 - p_hit^b
    measured.hit_rate = 0.5
    few, many = options(SETTINGS, 1, curves(0.0), measured), options(SETTINGS, 16, curves(0.0), measured)
    assert few["ssd K=2 jit"].estimate / few["ssd K=2 ngram"].estimate > \
        many["ssd K=2 jit"].estimate / many["ssd K=2 ngram"].estimate


def ran(name: str, option: Option) -> Choice:
    """A round of ``option`` (as if the policy had chosen it)."""
    return Choice(name, option.settings, {}, option)


def run(policy: LoadPolicy, batch: int, costs: CostCurves, measured: Yield, slowdown: dict[str, float],
        rounds: int) -> list[str]:
    """``rounds`` rounds chosen by ``policy``, each taking the model's time x ``slowdown[option]`` (1 if unset);
    the options chosen."""
    names = []
    for _ in range(rounds):
        choice = policy.choose(SETTINGS, batch, costs, measured)
        policy.observe(choice, choice.option.seconds * slowdown.get(choice.name, 1.0))
        names.append(choice.name)
    return names


def test_measured_slowdowns_correct_the_model_and_the_runner_up_is_re_measured():
    policy, costs, measured = LoadPolicy(), curves(0.0), Yield(prior_acceptance=0.6)
    assert policy.choose(SETTINGS, 16, costs, measured).name.startswith("ssd")     # the model's pick
    # every option measured: speculation's rounds take 20x what the model says (only AR is fast)
    slow = {name: 20.0 for name in options(SETTINGS, 16, costs, measured) if name != "ar"}
    for name, option in options(SETTINGS, 16, costs, measured).items():
        policy.last = None        # (no switch round)
        for _ in range(LoadPolicy.MEASURED_AFTER):
            policy.observe(ran(name, option), option.seconds * slow.get(name, 1.0))
        assert policy.slowdown(batch_bucket(16), name) == pytest.approx(slow.get(name, 1.0))
    scores = policy.choose(SETTINGS, 16, costs, measured).scores
    best, runner_up = sorted(scores, key=lambda n: -scores[n])[:2]
    assert best == "ar"
    interval = policy.explore_interval(scores[runner_up], scores[best])
    names = run(policy, 16, costs, measured, slow, 8 * interval)
    explored = [i for i, name in enumerate(names) if name != "ar"]
    assert {names[i] for i in explored} == {runner_up}
    starts = [i for i in explored if i == 0 or names[i - 1] == "ar"]
    assert all(names[i:i + LoadPolicy.EXPLORE_ROUNDS] == [runner_up] * LoadPolicy.EXPLORE_ROUNDS for i in starts)
    # each exploration that leaves AR the best doubles the spacing: the policy's price at a steady load shrinks
    assert [b - a for a, b in zip(starts, starts[1:])] == [2 * interval, 4 * interval]
    assert policy.confirmed[batch_bucket(16)] == 3
    # the runner-up turns out fast (as if measured so for long): it becomes the pick, and the spacing starts over
    policy.slowdowns[(batch_bucket(16), runner_up)].ratio = 0.5
    assert run(policy, 16, costs, measured, {}, 1) == [runner_up] and policy.confirmed[batch_bucket(16)] == 0
    # a close runner-up is explored as often as EXPLORE_EVERY allows
    assert policy.explore_interval(0.99, 1.0) == LoadPolicy.EXPLORE_EVERY
    assert batch_bucket(3) == batch_bucket(4) == 4 and batch_bucket(9) == 16


def test_a_new_load_starts_from_the_slowdowns_measured_at_the_nearest_one():
    """An option measured at one batch bucket is scored at another, never run there, by the slowdown measured
    at the nearest: speculation that measured 3x slower than modelled at 4 rows is not the pick at 8 rows either."""
    policy, costs, measured = LoadPolicy(), curves(0.0), Yield(prior_acceptance=0.6)
    slow = {name: 3.0 for name in options(SETTINGS, 4, costs, measured) if name != "ar"}
    names = run(policy, 4, costs, measured, slow, 200)
    first = names[0]
    assert first.startswith("ssd") and names[-20:].count("ar") >= 20 - LoadPolicy.EXPLORE_ROUNDS   # once measured
    assert policy.slowdown(batch_bucket(8), first) == pytest.approx(3.0)    # (borrowed from 4)
    at_eight = run(policy, 8, costs, measured, slow, 40)
    assert at_eight[0] == "ar" and at_eight.count("ar") >= 40 - LoadPolicy.EXPLORE_ROUNDS
    # without what 4 rows measured, 8 rows would start on the model's pick
    assert run(LoadPolicy(), 8, costs, measured, slow, 1)[0] != "ar"


def test_a_switch_round_is_charged_to_exploring_not_to_the_option():
    """The round after a switch pays a one-off (the draft catching up): it is kept out of the option's slowdown
    and spaces the explorations out instead; a slowdown is the mean of its first rounds, not the last few."""
    policy, costs, measured = LoadPolicy(), curves(0.0), Yield(prior_acceptance=0.6)
    ar, ssd = (options(SETTINGS, 1, costs, measured)[name] for name in ("ar", "ssd K=1 jit"))
    for name, option, seconds in (("ar", ar, ar.seconds), ("ssd K=1 jit", ssd, 1.2 * ssd.seconds),
                                  ("ar", ar, ar.seconds)):
        for _ in range(4):        # (the first round after a switch to an option never measured is dropped)
            policy.observe(ran(name, option), seconds)
    policy.observe(ran("ssd K=1 jit", ssd), 1.2 * ssd.seconds + 0.030)     # the switch: 30 ms of catch-up
    policy.observe(ran("ssd K=1 jit", ssd), 1.6 * ssd.seconds)
    slowdown = policy.slowdowns[(1, "ssd K=1 jit")]
    assert slowdown.rounds == 4 and slowdown.ratio == pytest.approx((3 * 1.2 + 1.6) / 4)
    # two switches: back to AR cost nothing, to SSD 30 ms (a running average: 0.8 x 0 + 0.2 x 30 ms)
    assert policy.switch_s[1] == pytest.approx(0.006)
    assert policy.switch_rounds(1, 0.01) == pytest.approx(1.2)       # an exploration's 2 switches, in 10 ms rounds
    # ... and at least what the draft's catching up on its backlog costs (the model's prefill time for it)
    assert policy.switch_rounds(1, 0.01, catch_up_s=0.05) == pytest.approx(5.0)
    assert policy.switch_rounds(1, 0.01, catch_up_s=0.001) == pytest.approx(1.2)
    # exploring a runner-up 10% behind: 4 x 0.1 rounds of gap + 1.2 rounds of switching, within a 1% budget
    assert policy.explore_interval(0.9, 1.0, policy.switch_rounds(1, 0.01)) == 160
    assert policy.explore_interval(0.9, 1.0) == 40


def test_the_drafts_backlog_spaces_explorations_out():
    """After autoregressive rounds the draft has to feed every token it missed before the rows can speculate: the
    policy prices that from the cost curves, so 16 rows that each missed 73 tokens are explored more rarely."""
    costs, measured = curves(0.0), Yield(prior_acceptance=0.6)
    slow = {name: 2.0 for name in options(SETTINGS, 16, costs, measured) if name != "ar"}     # AR is the best
    explorations = []
    for backlog in (0, 16 * 73):
        policy = LoadPolicy()
        for _ in range(3000):
            choice = policy.choose(SETTINGS, 16, costs, measured, backlog)
            policy.observe(choice, choice.option.seconds * slow.get(choice.name, 1.0))
        explorations.append(sum(policy.measured_rounds(16, name) for name in slow))
    assert explorations[1] < explorations[0]


def test_a_curve_never_timed_is_an_error_not_a_guess():
    with pytest.raises(KeyError, match="no target step was timed"):
        CostCurves().cost("target", 4, 2)
    costs = CostCurves({("target", 2, 2): 0.02, ("target", 8, 2): 0.08})
    assert costs.cost("target", 4, 2) == pytest.approx(0.04)     # interpolated between measured row counts
    assert costs.cost("target", 4, 4) == pytest.approx(0.08)     # scaled from the nearest measured tokens


def test_a_family_sharing_its_batch_with_autoregressive_rows_counts_only_its_own_gains():
    """A mixed batch: the target verifies every row at the widest feed, so the autoregressive rows pay for the
    family's speculation (padded to K'+1) and gain nothing from it. With 8 rows of the family speculation pays here;
    with 4 of its rows among 4 autoregressive ones it does not (the model once counted every row of the batch as the
    family's: a mixed batch then speculated where it should not)."""
    costs, measured = curves(0.04), Yield(prior_acceptance=0.6)
    alone = options(SETTINGS, 8, costs, measured)
    assert max(alone, key=lambda n: alone[n].estimate).startswith("ssd")
    mixed = options(SETTINGS, 8, costs, measured, rows=4)
    assert max(mixed, key=lambda n: mixed[n].estimate) == "ar"
    assert mixed["ar"].batch == 8 and mixed["ar"].estimate == pytest.approx(alone["ar"].estimate)
    assert LoadPolicy().choose(SETTINGS, 8, costs, measured, rows=4).name == "ar"
