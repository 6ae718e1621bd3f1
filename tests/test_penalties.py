"""Logit bias, repetition / frequency / presence penalties and min-p stay lossless under speculation
(``decoding/penalties.py``): each verified position is adjusted by the output ahead of it on its path, so greedy SD
chains and trees and SSD give AR's tokens, and sampled ones follow the adjusted target distribution (TV against the
exact one, computed here from the torch decoder with the definitions written out plainly)."""
from __future__ import annotations

import numpy as np
import pytest

import ssd_trt
from ssd_trt import AR, SD, SSD
from ssd_trt.decoding.penalties import adjusted, chain_outputs, tree_outputs
from ssd_trt.errors import RequestError
from tests.sampling_reference import reference_probs
from tests.test_sampling_lossless_ort import PROMPT, check, draw, exact_tokens, pair  # noqa: F401 -- pair: the fixture

ADJUSTED = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)


def reference_adjusted(logits: np.ndarray, params: ssd_trt.SamplingParams, prompt: list[int],
                       output: list[int]) -> np.ndarray:
    """The definitions, one token at a time (vLLM's order): bias, repetition over prompt and output, then frequency
    and presence over the output."""
    z = np.asarray(logits, dtype=np.float64).copy()
    for token, bias in params.logit_bias:
        z[token] += bias
    r = params.repetition_penalty
    for token in set(prompt) | set(output):
        z[token] = z[token] / r if z[token] > 0 else z[token] * r
    for token in set(output):
        z[token] -= output.count(token) * params.frequency_penalty + params.presence_penalty
    return z


def reference_filtered(logits: np.ndarray, params: ssd_trt.SamplingParams) -> np.ndarray:
    probs = reference_probs(logits, params)
    if params.min_p > 0:
        probs = np.where(probs >= params.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


def test_the_adjustment_is_the_definition_at_every_position_of_a_chain_and_a_tree():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 50)).astype(np.float32) * 3
    params = ssd_trt.SamplingParams(logit_bias={7: 5.0, 3: -100.0}, **ADJUSTED)
    prompt, tokens, drafted = [1, 2, 7], [9, 9, 4], [4, 11, 9]
    outputs = chain_outputs(tokens, drafted)
    assert outputs == [[9, 9, 4], [9, 9, 4, 4], [9, 9, 4, 4, 11], [9, 9, 4, 4, 11, 9]]
    got = adjusted(logits, params, prompt, outputs)
    for row, output in enumerate(outputs):
        assert got[row] == pytest.approx(reference_adjusted(logits[row], params, prompt, output), abs=1e-5)
    # a tree (node 0 the root; 1, 2 its children; 3 under 1, 4 under 2): a node's history is its path below the root
    assert tree_outputs([9], [4, 10, 11, 12, 13], [-1, 0, 0, 1, 2]) == [[9], [9, 10], [9, 11], [9, 10, 12],
                                                                        [9, 11, 13]]


@pytest.mark.parametrize("field, value", [("min_p", 1.5), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
                                          ("repetition_penalty", 0.0), ("logit_bias", {5: 101.0}),
                                          ("logit_bias", {-1: 1.0})])
def test_out_of_range_adjustments_are_refused_naming_the_field(field, value):
    with pytest.raises(RequestError, match=field):
        ssd_trt.SamplingParams(**{field: value})


@pytest.fixture(scope="module")
def generator(smollm2_build):
    return ssd_trt.load(smollm2_build)


@pytest.mark.slow
def test_greedy_with_penalties_and_a_bias_is_ar_in_every_mode_and_the_adjustments_bite(generator):
    # (SD token trees are left out: on this build they can leave AR's output even without adjustments, a known open
    # defect: tests/test_speculative_greedy.py; the adjustment along a tree's paths is checked on the tiny pair below)
    modes = {"sd": SD(draft_len=3), "ssd": SSD(draft_len=2)}
    changed = 0
    for prompt in ["1, 2, 3, 4,", "The capital of France is", "def fibonacci(n):", "Once upon a time"]:
        ids = generator.encode(prompt)
        [plain] = generator.generate_ids([ids], ssd_trt.SamplingParams(max_new_tokens=24), mode=AR())
        banned = plain.token_ids[1]
        params = ssd_trt.SamplingParams(max_new_tokens=24, logit_bias={banned: -100.0}, **ADJUSTED)
        [ar] = generator.generate_ids([ids], params, mode=AR())
        assert banned not in ar.token_ids
        changed += ar.token_ids != plain.token_ids
        for name, mode in modes.items():
            [out] = generator.generate_ids([ids], params, mode=mode)
            assert out.token_ids == ar.token_ids, (prompt, name)
    assert changed == 4


@pytest.mark.slow
@pytest.mark.parametrize("mode", [AR(), SD(draft_len=3), SD(tree_widths=(2, 2)),
                                  SSD(draft_len=2, backup="jit", fan_out_budget=8)],
                         ids=["ar", "sd", "sd-tree", "ssd"])
def test_sampled_first_two_tokens_follow_the_adjusted_target_distribution(pair, mode):  # noqa: F811
    build, target = pair
    settings = dict(temperature=1.0, top_k=50, min_p=0.1, logit_bias={PROMPT[1]: 3.0}, **ADJUSTED)
    params = ssd_trt.SamplingParams(max_new_tokens=2, **settings)
    joint = exact_tokens(target, params, probs_of=lambda logits, prefix: reference_filtered(
        reference_adjusted(logits, params, PROMPT, prefix), params))
    assert len(joint) > 10
    samples, _ = draw(build, mode, settings)
    for what, tv, threshold in check(joint, samples):
        assert tv < threshold, f"{mode.name} {what}: TV {tv:.4f} >= {threshold:.4f}"
