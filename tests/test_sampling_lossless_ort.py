"""Sampling through the real ONNX Runtime engines is lossless at the settings people use.

A tiny random-weight pair built by the real build (target + a perturbed copy as draft, max batch 64) runs
ar, sd and ssd at T=0.7 top-p 0.9 and T=1 top-k 50; the empirical distribution of the first two generated
tokens is compared with the exact one, computed from the torch decoder's logits and the plain dense
filter (tests/sampling_reference.py) -- independent of the runtime's sparse, batched sampling. Thresholds
come from the noise floor (tests/test_sampling_lossless.py). The reference code's planted bias must fail
the same check.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ssd_trt
from ssd_trt.decoding import round as round_module
from ssd_trt import AR, SD, SSD
from ssd_trt.decoding.settings import Settings
from tests.helpers import perturbed, random_decoder, save_hf_checkpoint, tiny_config, write_recipe
from tests.sampling_reference import reference_probs
from tests.test_sampling_lossless import noise_floor, planted_reference_bug, total_variation

PROMPT = [5, 17, 42, 9]
ROWS, CALLS = 64, 80
SETTINGS = {"t0.7-p0.9": dict(temperature=0.7, top_p=0.9), "t1-k50": dict(temperature=1.0, top_k=50)}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from ssd_trt.build import build
    root = tmp_path_factory.mktemp("tv")
    # a head half as sharp as the other tiny pairs': several tokens carry mass, so the filters bite
    # (19 outcomes of the first two tokens at T=0.7 top-p 0.9, 2,500 at T=1 top-k 50)
    target = random_decoder(tiny_config(), seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.5)
    draft = perturbed(target, seed=4, amount=0.1)     # SD accepts ~0.6-0.8 of a token per round here
    recipe = write_recipe(root / "tv.yaml", save_hf_checkpoint(target, root / "target"),
                          save_hf_checkpoint(draft, root / "draft"), name="tv", max_batch=ROWS)
    return build(recipe, root=root), target


def exact_tokens(target, params: ssd_trt.SamplingParams, length: int = 2,
                 probs_of=None) -> dict[tuple[int, ...], float]:
    """P(t1..t_length | prompt) under the filtered target, from the torch decoder (no runtime code involved);
    ``probs_of(logits, prefix)``: the filtered distribution after ``prefix`` (default: ``reference_probs``)."""
    from ssd_trt.export.parity import decoder_logits
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        longer = {}
        for prefix, mass in out.items():
            logits = decoder_logits(target, torch.tensor([PROMPT + list(prefix)]))[0, -1].numpy()
            probs = reference_probs(logits, params) if probs_of is None else probs_of(logits, list(prefix))
            for token in np.flatnonzero(probs > 0):
                longer[prefix + (int(token),)] = mass * float(probs[token])
        out = longer
    return out


def draw(build, mode: Settings, params: dict, length: int = 2, prompt: list[int] = PROMPT, rows: int = ROWS,
         calls: int = CALLS) -> tuple[list, list[dict]]:
    """``calls`` requests of ``rows`` copies of ``prompt``, each with its own seed: every call draws the
    draft's and the target's random numbers from fresh, independent streams."""
    gen = ssd_trt.load(build)
    samples, stats = [], []
    for call in range(calls):
        request = ssd_trt.SamplingParams(max_new_tokens=length, seed=1000 + call, stop_on_eos=False, **params)
        results = gen.generate_ids([prompt] * rows, request, mode=mode)
        samples += [tuple(r.token_ids) for r in results]
        stats.append(results[0].stats)
    return samples, stats


def marginal(joint: dict, samples: list) -> tuple[dict, list]:
    first: dict[tuple[int], float] = {}
    for (t1, *_), p in joint.items():
        first[(t1,)] = first.get((t1,), 0.0) + p
    return first, [(s[0],) for s in samples]


def check(joint: dict, samples: list) -> list[tuple[str, float, float]]:
    """(what, TV, threshold) for the first token and for the whole sequence; passes when TV < threshold."""
    out = []
    for what, (exact, drawn) in (("first token", marginal(joint, samples)), ("all tokens", (joint, samples))):
        out.append((what, total_variation(drawn, exact), 1.5 * noise_floor(exact, len(drawn)) + 0.005))
    return out


CASES = [AR(), SD(draft_len=3), SD(tree_widths=(2, 2)), SSD(draft_len=2, backup="jit", fan_out_budget=8),
         SSD(draft_len=2, backup="ngram", fan_out_budget=8, saguaro_c=0.5)]


def drafted_per_round(mode: Settings) -> int:
    """Tokens a round can accept: K, or a tree's depth."""
    return len(mode.tree_widths) if getattr(mode, "tree_widths", None) else mode.draft_len


# each mode with one filter setting here, the other's turn alternating; every (mode, setting) pair but ngram's also
# runs batched in test_heterogeneous_requests_batched_in_the_engine_step_each_follow_their_distribution
MODE_SETTINGS = [(CASES[0], "t1-k50"), (CASES[1], "t0.7-p0.9"), (CASES[2], "t1-k50"), (CASES[3], "t0.7-p0.9"),
                 (CASES[4], "t0.7-p0.9"), (CASES[4], "t1-k50")]


@pytest.mark.slow
@pytest.mark.parametrize("mode, setting", MODE_SETTINGS,
                         ids=["ar-t1-k50", "sd-t0.7-p0.9", "sd-tree-t1-k50", "ssd-jit-t0.7-p0.9",
                              "ssd-ngram-c0.5-t0.7-p0.9", "ssd-ngram-c0.5-t1-k50"])
def test_first_two_tokens_follow_the_target_distribution_through_onnx_runtime(pair, mode, setting):
    build, target = pair
    params = SETTINGS[setting]
    joint = exact_tokens(target, ssd_trt.SamplingParams(max_new_tokens=2, **params))
    assert len(joint) > 10                                   # a distribution with real spread, not a point
    samples, stats = draw(build, mode, params)
    for what, tv, threshold in check(joint, samples):
        assert tv < threshold, f"{mode.name} {setting} {what}: TV {tv:.4f} >= {threshold:.4f}"
    if mode.name != "ar":      # the draft did real work: some of its tokens were accepted, some rejected
        accepted = np.mean([s["mean_accepted"] for s in stats])
        assert 0.1 < accepted < drafted_per_round(mode), accepted


@pytest.mark.slow
def test_ssd_cache_hits_follow_the_target_distribution_through_onnx_runtime(pair):
    """Three tokens at K=1: the second round verifies a speculation from the cache (or its backup), so
    the third token's distribution covers the hit path (two tokens cover only the first, backup round)."""
    build, target = pair
    params = SETTINGS["t0.7-p0.9"]       # 3-token outcomes at T=1 top-k 50 number 125,000: no usable floor
    joint = exact_tokens(target, ssd_trt.SamplingParams(max_new_tokens=3, **params), length=3)
    samples, stats = draw(build, SSD(draft_len=1, backup="jit", fan_out_budget=4), params, length=3)
    for what, tv, threshold in check(joint, samples):
        assert tv < threshold, f"ssd 3 tokens {what}: TV {tv:.4f} >= {threshold:.4f}"
    rates = [s["cache_hit_rate"] for s in stats if s["cache_hit_rate"] is not None]
    assert len(rates) == CALLS and 0 < np.mean(rates) < 1, rates


@pytest.mark.slow
def test_heterogeneous_requests_batched_in_the_engine_step_each_follow_their_distribution(pair):
    """One engine step runs rows of every mode and both filter settings together (joining in two waves, so
    rows start mid-round of others): each (mode, setting) group's first two tokens follow its own exact
    distribution -- per-row parameters and random streams, not the batch's."""
    from ssd_trt.batching.engine import LLMEngine
    build, target = pair
    gen = ssd_trt.load(build)
    modes = {"ar": AR(), "sd": SD(draft_len=3), "sd-tree": SD(tree_widths=(2, 2)),
             "ssd": SSD(draft_len=2, backup="jit", fan_out_budget=8)}
    groups = [(m, s) for m in sorted(modes) for s in sorted(SETTINGS)]
    samples: dict[tuple[str, str], list] = {g: [] for g in groups}
    for call in range(CALLS // 2):
        engine = LLMEngine(gen)
        for filler in range(4):      # greedy requests still running when the second wave joins
            engine.add_request(PROMPT, ssd_trt.SamplingParams(max_new_tokens=6, stop_on_eos=False),
                               modes[sorted(modes)[filler % len(modes)]])
        ids = {}
        for wave in range(2):
            for r in range(ROWS // 2 - 2):
                group = groups[(r + wave) % len(groups)]
                params = ssd_trt.SamplingParams(max_new_tokens=2, seed=50_000 + call * ROWS + wave * ROWS // 2 + r,
                                                stop_on_eos=False, **SETTINGS[group[1]])
                ids[engine.add_request(PROMPT, params, modes[group[0]])] = group
            engine.step()
        while engine.has_unfinished():
            engine.step()
        for request_id, group in ids.items():
            samples[group].append(tuple(engine.take_result(request_id).tokens))
        engine.close()
    for mode, setting in groups:
        joint = exact_tokens(target, ssd_trt.SamplingParams(max_new_tokens=2, **SETTINGS[setting]))
        for what, tv, threshold in check(joint, samples[(mode, setting)]):
            assert tv < threshold, f"batched {mode} {setting} {what}: TV {tv:.4f} >= {threshold:.4f}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", [CASES[1], CASES[3]], ids=["sd", "ssd-jit"])
def test_the_ort_check_catches_the_reference_bias_bug(pair, monkeypatch, mode):
    build, target = pair
    params = SETTINGS["t0.7-p0.9"]     # at T=1 top-k 50 the 2,500-outcome noise floor hides a bias this size
    monkeypatch.setattr(round_module, "verify_chain", planted_reference_bug)   # where the engine step verifies
    joint = exact_tokens(target, ssd_trt.SamplingParams(max_new_tokens=2, **params))
    samples, _ = draw(build, mode, params)
    failed = [(what, tv, threshold) for what, tv, threshold in check(joint, samples) if tv >= threshold]
    assert failed, f"planted bias went unnoticed: {check(joint, samples)}"


@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_sd_and_ssd_with_nothing_set_follow_the_target_distribution_at_batch_64(pair, setting, mode):
    """What users get with no flags: SD at the build's K, SSD at the build's defaults adapted by the load policy
    at 64 live rows."""
    build, target = pair
    params = SETTINGS[setting]
    joint = exact_tokens(target, ssd_trt.SamplingParams(max_new_tokens=2, **params))
    samples, _ = draw(build, mode, params)
    for what, tv, threshold in check(joint, samples):
        assert tv < threshold, f"{mode} (defaults) {setting} {what}: TV {tv:.4f} >= {threshold:.4f}"
