"""Greedy speculative decoding is token-identical to autoregressive decoding, on random-weight pairs."""
from __future__ import annotations

import numpy as np
import pytest

import ssd_trt
from ssd_trt.decoding.params import SamplingParams

PROMPTS = [[1, 5, 9, 33, 7], [1, 100, 3], [1, 42, 42, 42, 42, 8, 19], [1, 250], [1, 17, 18, 19, 20, 21, 22],
           [1, 64, 128, 192], [1, 77, 3, 77, 3, 77], [1, 11]]


def batches(size: int) -> list[list[list[int]]]:
    return [PROMPTS[i:i + size] for i in range(0, len(PROMPTS), size)]


@pytest.mark.parametrize("pair", ["self", "perturbed", "unrelated"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_greedy_speculative_equals_autoregressive(tiny_pairs, pair, batch, mode):
    gen = ssd_trt.load(tiny_pairs[pair])
    params = SamplingParams(max_new_tokens=40, stop_on_eos=False)
    accepted = []
    # K set (the build's): at batch 4 the engine step's load policy would otherwise be free to turn
    # speculation off for a pair whose draft costs what its target costs
    settings = gen.resolve(mode).settings
    for prompts in batches(batch):
        reference = [r.token_ids for r in gen.generate_ids(prompts, params, mode="ar")]
        results = gen.generate_ids(prompts, params, mode=settings)
        assert [r.token_ids for r in results] == reference
        accepted.append(results[0].stats["mean_accepted"])
    mean = float(np.mean(accepted))
    # the pairs really differ in acceptance: everything / partial / almost nothing
    if pair == "self":
        assert mean > 3.5
    elif pair == "perturbed":
        assert 0.3 < mean < 3.9
    else:
        assert mean < 1.0


@pytest.mark.parametrize("pair", ["self", "perturbed"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("draft_len", [1, 3])
def test_greedy_ssd_chains_that_keep_the_drafted_branch_equal_autoregressive(tiny_pairs, monkeypatch, pair, batch,
                                                                              draft_len):
    """One guess a round (fan-out budget 1): the draft keeps the chain it drafted each speculation on
    (Speculation.held_logits), so after a hit the next glue decode feeds s_K alone; a miss gives the kept slots back
    and the backup drafts beside rows that hit. The output equals AR, and the one-token glue decodes really ran
    (the self pair's draft mostly guesses the outcome: random weights leave it unsure of its own tokens)."""
    from ssd_trt.decoding import saguaro
    from ssd_trt.decoding.settings import SSD

    widths: list[int] = []
    feed = saguaro.feed_rows

    def recording(engine, rows, tail=1):
        widths.append(max(len(r) for r in rows))
        return feed(engine, rows, tail)
    monkeypatch.setattr(saguaro, "feed_rows", recording)
    gen = ssd_trt.load(tiny_pairs[pair])
    params = SamplingParams(max_new_tokens=40, stop_on_eos=False)
    hits = []
    for prompts in batches(batch):
        reference = [r.token_ids for r in gen.generate_ids(prompts, params, mode="ar")]
        results = gen.generate_ids(prompts, params, mode=SSD(draft_len=draft_len, fan_out_budget=1))
        assert [r.token_ids for r in results] == reference
        hits += [r.stats["cache_hit_rate"] for r in results]
    assert np.mean(hits) > (0.3 if pair == "self" else 0.05)
    # every hit's next glue decode is one token wide (the rounds after misses re-feed the verified tokens)
    one_token = widths.count(1) / len(widths)
    assert one_token > (0.3 if pair == "self" else 0.05), f"one-token glue decodes: {one_token:.2f} of {len(widths)}"


@pytest.mark.parametrize("widths", [[2, 2, 1], [3, 1, 1, 1]])
def test_greedy_tree_verification_equals_autoregressive(tiny_pairs, widths):
    from ssd_trt.decoding.settings import SD

    gen = ssd_trt.load(tiny_pairs["perturbed"])
    params = SamplingParams(max_new_tokens=40, stop_on_eos=False)
    for prompts in batches(4):
        reference = [r.token_ids for r in gen.generate_ids(prompts, params, mode="ar")]
        results = gen.generate_ids(prompts, params, mode=SD(tree_widths=tuple(widths)))
        assert [r.token_ids for r in results] == reference
        assert results[0].stats["mean_accepted"] > 0


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_requests_at_the_context_limit_finish_exactly_or_are_refused_up_front(tiny_pairs, mode):
    from ssd_trt.errors import RequestError
    gen = ssd_trt.load(tiny_pairs["perturbed"])
    limit = gen.limits.max_context
    headroom = gen.resolve(mode).settings.headroom
    prompt = [1] + [5 + (i % 200) for i in range(150)]
    fits = SamplingParams(max_new_tokens=limit - len(prompt) - headroom, stop_on_eos=False)
    [expected] = gen.generate_ids([prompt], fits, mode="ar")
    [result] = gen.generate_ids([prompt], fits, mode=mode)
    assert result.token_ids == expected.token_ids and len(result.token_ids) == fits.max_new_tokens
    too_long = SamplingParams(max_new_tokens=fits.max_new_tokens + 1, stop_on_eos=False)
    with pytest.raises(RequestError, match=f"slots for {mode} speculation"):
        gen.generate_ids([prompt], too_long, mode=mode)


def test_a_second_sibling_in_a_token_tree_gets_the_logits_autoregressive_decoding_gives_it(smollm2_build):
    """Once a defect (ONNX Runtime's MatMulNBits with int8 activations gave a tree's second sibling logits up to 1.0
    away from AR's); the CPU kernel engine computes every token row-exactly, so the two are equal bit for bit."""
    from ssd_trt.decoding.speculative_tree import TokenTree
    from ssd_trt.engines.kernel_engine import KernelEngine
    gen = ssd_trt.load(smollm2_build)
    target = gen.engines.get("target")
    assert isinstance(target, KernelEngine)
    context = gen.encode("def fibonacci(n):") + [472, 2822, 79, 2871, 446, 216, 33, 472, 327, 2056, 281, 1845, 24, 94,
                                                  727, 448, 2822, 79, 2871, 446]
    start = len(context)

    def last_logits(tokens: list[int], positions: list[int], mask: np.ndarray | None) -> np.ndarray:
        target.reset(1)
        target.forward(np.array([context]), np.arange(start)[None])
        return target.forward(np.array([tokens]), start + np.array(positions)[None],
                              None if mask is None else mask[None])[0]
    chain = last_logits([2822, 24], [0, 1], None)[1]                  # AR: 24 right after the root
    tree = last_logits([2822, 79, 24], [0, 1, 1], TokenTree.of((2,)).mask)[2]   # 24 as the root's second child
    assert np.array_equal(tree, chain)


@pytest.mark.parametrize("widths", [(2, 2), (3, 2, 1)])
def test_greedy_token_trees_on_the_int8_build_equal_autoregressive(smollm2_build, widths):
    from ssd_trt.decoding.settings import SD
    gen = ssd_trt.load(smollm2_build)
    params = SamplingParams(max_new_tokens=48, stop_on_eos=False)
    prompts = [gen.encode(p) for p in ("def fibonacci(n):", "The three primary colours are", "import os\nimport",
                                       "Once upon a time", "SELECT name FROM", "Q: What is 7 * 8?\nA:")]
    reference = [r.token_ids for r in gen.generate_ids(prompts, params, mode="ar")]
    assert [r.token_ids for r in gen.generate_ids(prompts, params, mode=SD(tree_widths=widths))] == reference


def test_token_trees_are_refused_where_the_target_is_not_row_exact(smollm2_build):
    """The fallback engine (ONNX Runtime's int8 MatMulNBits) refuses SD trees with a clear error; chains still run."""
    from ssd_trt.decoding.settings import SD
    from ssd_trt.engines.ort import OrtEngine
    from ssd_trt.errors import RequestError
    gen = ssd_trt.load(smollm2_build, ssd_trt.RuntimeOptions(cpu_kernel=False))
    assert isinstance(gen.engines.get("target"), OrtEngine)
    params = SamplingParams(max_new_tokens=16, stop_on_eos=False)
    with pytest.raises(RequestError, match="SD token trees .* refused .* MatMulNBits"):
        gen.generate("def f(x):", params, mode=SD(tree_widths=(2, 2)))
    prompt = [gen.encode("def f(x):")]
    assert gen.generate_ids(prompt, params, mode="sd")[0].token_ids == \
        gen.generate_ids(prompt, params, mode="ar")[0].token_ids

