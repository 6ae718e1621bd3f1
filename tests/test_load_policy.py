"""The SSD load policy (``batching/policy.py``): the cost model ranks the options until they are measured, measured
rates then decide, and the runner-up is re-measured now and then, the more rarely the further behind it is."""
from __future__ import annotations

import pytest

from ssd_trt import SSD
from ssd_trt.batching.policy import CostCurves, LoadPolicy, Yield, batch_bucket, options


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
    assert max(cheap, key=lambda n: cheap[n][1]).startswith("ssd")
    dear = options(SETTINGS, 16, curves(1.0), measured)
    assert max(dear, key=lambda n: dear[n][1]) == "ar"
    # a miss stalls the whole batch for a just-in-time draft with probability 1 - p_hit^b
    measured.hit_rate = 0.5
    few, many = options(SETTINGS, 1, curves(0.0), measured), options(SETTINGS, 16, curves(0.0), measured)
    assert few["ssd K=2 jit"][1] / few["ssd K=2 ngram"][1] > many["ssd K=2 jit"][1] / many["ssd K=2 ngram"][1]


def test_measured_rates_replace_the_estimates_and_the_runner_up_is_re_measured():
    policy, costs, measured = LoadPolicy(), curves(0.0), Yield(prior_acceptance=0.6)
    assert policy.choose(SETTINGS, 16, costs, measured).name.startswith("ssd")     # the model's pick, untried
    for name in options(SETTINGS, 16, costs, measured):           # then every option measured: only AR is fast
        seconds = 0.05 if name == "ar" else 1.0
        for _ in range(LoadPolicy.MEASURED_AFTER + 1):
            policy.observe(16, name, tokens=16, seconds=seconds)
        assert policy.rates[(batch_bucket(16), name)].per_second == pytest.approx(16 / seconds)
    # "ar" leads by 95%: its runner-up still runs, EXPLORE_ROUNDS in a row, but only every ~380 rounds (1% budget)
    interval = policy.explore_interval(16 / 1.0, 16 / 0.05)
    assert interval == 380
    names = [policy.choose(SETTINGS, 16, costs, measured).name for _ in range(2 * interval + LoadPolicy.EXPLORE_ROUNDS)]
    runner_up = [i for i, name in enumerate(names) if name != "ar"]
    assert len(runner_up) == 2 * LoadPolicy.EXPLORE_ROUNDS and len({names[i] for i in runner_up}) == 1
    assert runner_up[LoadPolicy.EXPLORE_ROUNDS] - runner_up[0] == interval
    # a close runner-up is explored as often as EXPLORE_EVERY allows
    assert policy.explore_interval(0.99, 1.0) == LoadPolicy.EXPLORE_EVERY
    assert batch_bucket(3) == batch_bucket(4) == 4 and batch_bucket(9) == 16


def test_a_switch_round_is_charged_to_exploring_not_to_the_option():
    """The round after a switch pays a one-off (the draft catching up): it is kept out of the option's rate and
    spaces the explorations out instead; a rate is the mean of its first rounds, not the last few."""
    policy = LoadPolicy()
    for name, seconds in (("ar", 0.01), ("ssd K=1 jit", 0.012), ("ar", 0.01)):
        for _ in range(4):        # (the first round after a switch to an option never measured is dropped)
            policy.observe(1, name, tokens=1 if name == "ar" else 2, seconds=seconds)
    policy.observe(1, "ssd K=1 jit", tokens=2, seconds=0.042)       # the switch: 30 ms of catch-up
    policy.observe(1, "ssd K=1 jit", tokens=1, seconds=0.012)
    rate = policy.rates[(1, "ssd K=1 jit")]
    assert rate.rounds == 4 and rate.per_second == pytest.approx(7 / 0.048)
    # two switches: back to AR cost nothing, to SSD 30 ms (a running average: 0.8 x 0 + 0.2 x 30 ms)
    assert policy.switch_s[1] == pytest.approx(0.006)
    assert policy.switch_rounds(1, "ar") == pytest.approx(1.2)        # an exploration's 2 switches, in AR rounds
    # exploring a runner-up 10% behind: 4 x 0.1 rounds of gap + 1.2 rounds of switching, within a 1% budget
    assert policy.explore_interval(0.9, 1.0, policy.switch_rounds(1, "ar")) == 160
    assert policy.explore_interval(0.9, 1.0) == 40


def test_a_curve_never_timed_is_an_error_not_a_guess():
    with pytest.raises(KeyError, match="no target step was timed"):
        CostCurves().cost("target", 4, 2)
    costs = CostCurves({("target", 2, 2): 0.02, ("target", 8, 2): 0.08})
    assert costs.cost("target", 4, 2) == pytest.approx(0.04)     # interpolated between measured row counts
    assert costs.cost("target", 4, 4) == pytest.approx(0.08)     # scaled from the nearest measured tokens
