"""Sampling is lossless: every mode's output distribution equals the target's, measured.

Target and draft are trigram models (tests/trigram.py) with exact sequence probabilities, run by the runtime's
own ``Generator.generate_ids`` (the engine step). Each check draws many independent sequences (one request per
row, each with its own random streams) of length L and compares the empirical joint distribution of the L tokens
with the exact one by total-variation distance. The threshold comes from the noise floor: E[TV] of an exact
sampler with n draws is ~ 0.5 * sum_i sqrt(2 p_i (1-p_i) / (pi n)), and the test allows 1.5x that plus a small
slack. A planted copy of the reference implementation's synchronous-mode bug (greedy acceptance, bonus sampled
from p instead of the residual) must fail the same check -- proof that the test can see a bias of that size.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from ssd_trt.decoding import round as round_module
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.sampling import Outcome, filter_logits
from ssd_trt.decoding.settings import AR, SD, SSD
from tests.sampling_reference import reference_probs
from tests.trigram import trigram_generator, blend, random_log_table

VOCAB, LENGTH, PROMPT = 5, 3, [0, 1]
ROWS, CALLS = 250, 32           # 8,000 draws, in requests of at most the engine's max batch


def exact_distribution(log_table: np.ndarray, temperature: float, top_k: int = 0,
                       top_p: float = 1.0) -> dict[tuple[int, ...], float]:
    """P(x_1..x_L | prompt) under the filtered softmax(log p / T), computed directly from the table with
    the plain dense filters of tests/sampling_reference.py."""
    cond = reference_probs(log_table, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        context, prob = list(PROMPT), 1.0
        for token in seq:
            prob *= cond[context[-2], context[-1], token]
            context.append(token)
        out[seq] = prob
    return out


def noise_floor(exact: dict, draws: int) -> float:
    p = np.array(list(exact.values()))
    return float(0.5 * np.sum(np.sqrt(2 * p * (1 - p) / (np.pi * draws))))


def total_variation(samples: list[tuple[int, ...]], exact: dict) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    return 0.5 * sum(abs(counts.get(k, 0) / n - v) for k, v in exact.items())


def draw(mode, temperature: float, seed: int, draft=None, **filters) -> tuple[list[tuple[int, ...]], list[dict]]:
    """``draft``: a maker of the draft engine (default: the trigram DRAFT), called again after a draft failure."""
    gen = trigram_generator(TARGET, DRAFT if draft is None else draft)
    samples, stats = [], []
    for call in range(CALLS):
        params = SamplingParams(max_new_tokens=LENGTH, temperature=temperature, seed=seed + call,
                                stop_on_eos=False, **filters)
        results = gen.generate_ids([PROMPT] * ROWS, params, mode=mode)
        samples += [tuple(r.token_ids) for r in results]
        stats.append(results[0].stats)
    return samples, stats


TARGET = random_log_table(VOCAB, seed=0)
DRAFT = blend(TARGET, random_log_table(VOCAB, seed=1), 0.6)   # related but different: partial acceptance


def sd_mode(tree_widths=None, draft_len=2):
    return SD(tree_widths=tuple(tree_widths)) if tree_widths else SD(draft_len=draft_len)


def ssd_mode(**config):
    return SSD(**{"draft_len": 2, "fan_out_budget": 4, **config})


def assert_lossless(mode, temperature: float, seed: int = 0, draft=None, **filters) -> list[dict]:
    exact = exact_distribution(TARGET, temperature, **filters)
    samples, stats = draw(mode, temperature, seed, draft, **filters)
    tv, floor = total_variation(samples, exact), noise_floor(exact, len(samples))
    assert tv < 1.5 * floor + 0.005, f"TV {tv:.4f} exceeds the noise-floor threshold ({floor:.4f})"
    return stats


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_autoregressive_sampling_matches_target(temperature):
    assert_lossless(AR(), temperature)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_chain_ratio_acceptance_is_lossless(temperature):
    stats = assert_lossless(sd_mode(), temperature)
    assert 0.2 < np.mean([s["acceptance_rate"] for s in stats]) < 0.95   # partial acceptance exercised


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_tree_verification_is_lossless(temperature):
    assert_lossless(sd_mode(tree_widths=[2, 2]), temperature)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_ssd_cache_hits_and_jit_misses_are_lossless(temperature):
    stats = assert_lossless(ssd_mode(backup="jit"), temperature)
    assert all(0 < s["cache_hit_rate"] < 1 for s in stats)        # both hits and misses happened
    assert all(s["backup_rounds"].get("jit", 0) > 0 for s in stats)


def test_adaptive_ssd_at_one_live_request_is_lossless():
    """SSD with nothing set, exactly one request live at a time (``max_running=1``): the load policy picks AR, SD
    or SSD rounds for each round and now and then explores the others, so consecutive requests run different
    kinds of rounds; every request draws from its own seed, and the output still follows the target."""
    from ssd_trt.batching.engine import LLMEngine
    gen = trigram_generator(TARGET, DRAFT)
    engine = LLMEngine(gen, max_running=1, max_waiting=ROWS * CALLS)
    ids = [engine.add_request(PROMPT, SamplingParams(max_new_tokens=LENGTH, temperature=1.0, seed=n,
                                                     stop_on_eos=False), "ssd")
           for n in range(ROWS * CALLS)]
    while engine.has_unfinished():
        engine.step()
        assert engine.metrics.active_batch <= 1
    samples = [tuple(engine.take_result(request_id).tokens) for request_id in ids]
    engine.close()
    exact = exact_distribution(TARGET, 1.0)
    tv, floor = total_variation(samples, exact), noise_floor(exact, len(samples))
    assert tv < 1.5 * floor + 0.005, f"TV {tv:.4f} exceeds the noise-floor threshold ({floor:.4f})"
    [policy] = gen.learned.policies.values()
    ran = {name for (_, name), slowdown in policy.slowdowns.items() if slowdown.rounds > 0}
    assert "ar" in ran and len(ran) >= 3, ran         # rounds with speculation off, and two kinds with it


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_ssd_ngram_backup_misses_are_lossless(temperature):
    stats = assert_lossless(ssd_mode(backup="ngram"), temperature)
    assert all(s["backup_rounds"].get("ngram", 0) > 0 for s in stats)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_saguaro_sampling_with_c_below_one_is_lossless(temperature):
    assert_lossless(ssd_mode(saguaro_c=0.3, backup="jit"), temperature)


@pytest.mark.parametrize("policy,lookup", [("geometric", 0), ("geometric", 3), ("confidence", 0)])
def test_every_fork_policy_is_lossless(policy, lookup):
    # the default (confidence + 3 lookup guesses) runs in every other SSD test here
    stats = assert_lossless(ssd_mode(fork_policy=policy, lookup_forks=lookup, saguaro_c=0.5, backup="jit"), 1.0)
    assert all(0 < s["cache_hit_rate"] < 1 for s in stats)


def test_non_uniform_fan_out_is_lossless():
    # a strongly geometric shape: acceptance prior far from uniform, budget larger than K+1
    stats = assert_lossless(ssd_mode(draft_len=3, fan_out_budget=9, prior_acceptance=0.2, saguaro_c=0.5,
                                    fork_policy="geometric"), 1.0)
    shapes = [s["fan_out"]["primary"]["shape"] for s in stats if "primary" in s["fan_out"]]
    assert shapes and all(len(set(shape)) > 1 for shape in shapes)


@pytest.mark.parametrize("policy", ["confidence", "geometric"])
def test_a_budget_below_k_plus_one_leaves_outcomes_to_the_backup_and_stays_lossless(policy):
    # K=3 with one guess a round: at least three of the four acceptance lengths have no branch, so their rounds
    # always miss and take the just-in-time backup; Saguaro's C < 1 reshapes q only where a guess sits
    stats = assert_lossless(ssd_mode(draft_len=3, fan_out_budget=1, saguaro_c=0.5, backup="jit", fork_policy=policy,
                                     lookup_forks=0), 1.0)
    assert all(0 < s["cache_hit_rate"] < 1 for s in stats)
    if policy == "geometric":
        shapes = [s["fan_out"]["primary"]["shape"] for s in stats if "primary" in s["fan_out"]]
        assert shapes and all(sum(shape) == 1 and shape.count(0) == 3 for shape in shapes)


FILTERS = {"top-k 3": dict(top_k=3), "top-p 0.8": dict(top_p=0.8), "top-k 4, top-p 0.9": dict(top_k=4, top_p=0.9)}
# every strategy with both filters at once (top-k's candidates, then their nucleus: the sparsest q and p), and each
# filter alone (its own path through filter_logits) with SSD's Saguaro proposals, where q is reshaped after filtering
FILTERED_STRATEGIES = [("sd chain", "top-k 4, top-p 0.9"), ("sd tree", "top-k 4, top-p 0.9"),
                       ("ssd ngram", "top-k 4, top-p 0.9")] + [("ssd jit, C=0.5", f) for f in sorted(FILTERS)]


@pytest.mark.parametrize("strategy, filters", FILTERED_STRATEGIES)
def test_top_k_and_top_p_sampling_is_lossless_in_every_strategy(strategy, filters):
    """With filters the proposal q is sparse (the draft's top-k / nucleus support) and the target's p too;
    verification must divide by exactly that q, and the residual must live on p's support."""
    run = {"sd chain": sd_mode(draft_len=3), "sd tree": sd_mode(tree_widths=[2, 2]),
           "ssd jit, C=0.5": ssd_mode(backup="jit", saguaro_c=0.5), "ssd ngram": ssd_mode(backup="ngram")}[strategy]
    stats = assert_lossless(run, 1.0, **FILTERS[filters])
    if strategy.startswith("ssd"):
        assert all(0 < s["cache_hit_rate"] < 1 for s in stats)


def test_saguaro_c_moves_bonus_tokens_into_the_cache():
    """Lower C should raise the cache hit rate (the point of Saguaro sampling), at T = 1."""
    rates = {}
    for c in (1.0, 0.2):
        _, stats = draw(ssd_mode(saguaro_c=c, backup="jit"), 1.0, seed=5)
        rates[c] = np.mean([s["cache_hit_rate"] for s in stats])
    assert rates[0.2] > rates[1.0]


def planted_reference_bug(draft_tokens, draft_q, target_logits, params, rng):
    """The reference code's synchronous-mode verification at T > 0: greedy acceptance, and the bonus
    drawn from p itself instead of norm(max(0, p - q)). Biased (TV ~ 0.06 in the paper's setting)."""
    p = filter_logits(target_logits, params)
    for i, token in enumerate(draft_tokens):
        if token != int(np.argmax(p[i].dense(target_logits.shape[-1]))):
            return Outcome(i, int(p[i].sample(rng)))
    return Outcome(len(draft_tokens), int(p[len(draft_tokens)].sample(rng)))


@pytest.mark.parametrize("strategy", ["sd", "ssd"])
def test_the_check_catches_the_reference_bias_bug(monkeypatch, strategy):
    """SD and SSD verify through one function (where the engine step verifies); planting the bias there must
    show."""
    monkeypatch.setattr(round_module, "verify_chain", planted_reference_bug)
    exact = exact_distribution(TARGET, 1.0)
    samples, _ = draw(sd_mode() if strategy == "sd" else ssd_mode(backup="jit"), 1.0, seed=0)
    tv, floor = total_variation(samples, exact), noise_floor(exact, len(samples))
    assert tv > 1.5 * floor + 0.005, f"planted bias went unnoticed: TV {tv:.4f}, floor {floor:.4f}"


def test_the_check_catches_saguaro_sampling_verified_against_the_unscaled_q(monkeypatch):
    """Negative control (issue 19): with C < 1 the tokens are drawn from sigma_{F,C}(q); verifying them against
    the plain q they were not drawn from must show as a bias."""
    from ssd_trt.decoding.saguaro import DraftWorker

    def unscaled(self, logits, fan_out, active=None):
        q = filter_logits(logits, self.params[0])       # one request: every row has its parameters and stream
        return q.boosted(np.asarray(fan_out) + 1, self.settings.saguaro_c).sample(self.rngs[0]), q

    monkeypatch.setattr(DraftWorker, "draw", unscaled)
    exact = exact_distribution(TARGET, 1.0)
    samples, _ = draw(ssd_mode(saguaro_c=0.2, backup="jit"), 1.0, seed=0)
    tv, floor = total_variation(samples, exact), noise_floor(exact, len(samples))
    assert tv > 1.5 * floor + 0.005, f"planted bias went unnoticed: TV {tv:.4f}, floor {floor:.4f}"


def shuffled_cache(pair_q_with_tokens: bool):
    """DraftWorker.speculate whose cache keys every branch's K tokens under the next branch's outcome (k, t*);
    with ``pair_q_with_tokens`` False the tokens also get another branch's distributions."""
    from ssd_trt.decoding.saguaro import DraftWorker
    original = DraftWorker.speculate

    def speculate(self, bonus, spec, shapes):
        cache = original(self, bonus, spec, shapes)
        keys = sorted(cache.entries)
        values = [cache.entries[key] for key in keys]
        moved = values[1:] + values[:1]                     # each key gets its neighbour's branch
        if not pair_q_with_tokens:
            moved = [dataclasses.replace(spec, dists=values[(i + 2) % len(values)].dists)
                     for i, spec in enumerate(moved)]
        cache.entries = dict(zip(keys, moved))
        return cache
    return speculate


@pytest.mark.parametrize("pair_q_with_tokens", [True, False], ids=["wrong key", "wrong key and q"])
def test_a_cache_keyed_on_the_wrong_outcome(monkeypatch, pair_q_with_tokens):
    """Negative control (issue 19). A cache entry looked up under the wrong outcome (k, t*) is a proposal
    drafted behind another prefix: verification with the distribution its tokens were drawn from is still
    exact (speculative sampling is lossless for any proposal q), so only the hit rate suffers. Served with
    another branch's q, the tokens are verified against a distribution they were not drawn from: biased."""
    from ssd_trt.decoding.saguaro import DraftWorker
    monkeypatch.setattr(DraftWorker, "speculate", shuffled_cache(pair_q_with_tokens))
    exact = exact_distribution(TARGET, 1.0)
    samples, stats = draw(ssd_mode(backup="jit", fan_out_budget=6), 1.0, seed=0)
    tv, floor = total_variation(samples, exact), noise_floor(exact, len(samples))
    assert all(s["cache_hit_rate"] > 0.5 for s in stats)          # the shuffled entries were served
    if pair_q_with_tokens:
        assert tv < 1.5 * floor + 0.005, f"TV {tv:.4f} exceeds the noise-floor threshold ({floor:.4f})"
    else:
        assert tv > 1.5 * floor + 0.005, f"planted bias went unnoticed: TV {tv:.4f}, floor {floor:.4f}"
