"""The SSD load policy (``batching/policy.py``): the cost model ranks the options until they are measured, measured
rates then decide, the runner-up is re-measured now and then, and a switch round is not recorded."""
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
    policy.observe(16, "ar", tokens=16, seconds=0.001)           # the round after a switch: not recorded
    assert policy.rates[(batch_bucket(16), "ar")].per_second == pytest.approx(16 / 0.05)
    names = [policy.choose(SETTINGS, 16, costs, measured).name for _ in range(4 * LoadPolicy.EXPLORE_EVERY)]
    # "ar" leads; the runner-up still runs now and then, EXPLORE_ROUNDS in a row (rarely: it is far behind)
    runner_up = [name for name in names if name != "ar"]
    assert 0 < len(runner_up) <= LoadPolicy.EXPLORE_ROUNDS and len(set(runner_up)) == 1
    assert batch_bucket(3) == batch_bucket(4) == 4 and batch_bucket(9) == 16


def test_a_curve_never_timed_is_an_error_not_a_guess():
    with pytest.raises(KeyError, match="no target step was timed"):
        CostCurves().cost("target", 4, 2)
    costs = CostCurves({("target", 2, 2): 0.02, ("target", 8, 2): 0.08})
    assert costs.cost("target", 4, 2) == pytest.approx(0.04)     # interpolated between measured row counts
    assert costs.cost("target", 4, 4) == pytest.approx(0.08)     # scaled from the nearest measured tokens
