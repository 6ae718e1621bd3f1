"""The target's logprobs of what a request emits (``decoding/logprobs.py``): the target's own distribution at each
position, the same in every decoding mode, and the same as scoring the whole text afterwards (the prompt's logprobs of
prompt + output, one forward): a token accepted from the draft carries the target's logprob, not the draft's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ssd_trt
from ssd_trt.decoding.logprobs import MAX_TOP_LOGPROBS, token_logprobs
from ssd_trt.errors import RequestError

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
MAX_TOKENS = 16


def test_token_logprobs_are_the_log_softmax_with_the_top_alternatives_most_likely_first():
    logits = np.random.default_rng(0).normal(size=(5, 300)).astype(np.float32) * 4
    tokens = [3, 17, 299, 0, 42]
    out = token_logprobs(logits, tokens, top=4)
    reference = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1).numpy()
    for row, (entry, token) in enumerate(zip(out, tokens)):
        assert entry.token == token and entry.logprob == pytest.approx(reference[row, token], abs=1e-9)
        assert [t for t, _ in entry.top] == list(np.argsort(-reference[row], kind="stable")[:4])
        assert [lp for _, lp in entry.top] == pytest.approx(sorted(reference[row], reverse=True)[:4], abs=1e-9)
    assert all(entry.top == () for entry in token_logprobs(logits, tokens, top=0))


@pytest.mark.parametrize("value", [-1, MAX_TOP_LOGPROBS + 1, True, 1.5])
def test_a_logprobs_count_outside_0_to_20_is_refused(value):
    with pytest.raises(RequestError, match="logprobs must be an integer in 0..20"):
        ssd_trt.SamplingParams(logprobs=value)
    with pytest.raises(RequestError, match="prompt_logprobs must be an integer in 0..20"):
        ssd_trt.SamplingParams(prompt_logprobs=value)


@pytest.fixture(scope="module")
def generator(smollm2_build):
    return ssd_trt.load(smollm2_build)


def scored(generator, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """The target's logprobs of ``output_ids`` after ``prompt_ids``, from one forward over both (prompt logprobs)."""
    [result] = generator.generate_ids([prompt_ids + output_ids], ssd_trt.SamplingParams(max_new_tokens=1,
                                                                                        prompt_logprobs=0), mode="ar")
    assert len(result.prompt_logprobs) == len(prompt_ids) + len(output_ids) - 1
    return [entry.logprob for entry in result.prompt_logprobs[len(prompt_ids) - 1:]]


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, seed=3)],
                         ids=["greedy", "sampled"])
def test_every_mode_reports_the_targets_own_logprobs_of_what_it_emits(generator, sampling):
    accepted = 0
    for prompt in PROMPTS:
        ids = generator.encode(prompt)
        params = ssd_trt.SamplingParams(max_new_tokens=MAX_TOKENS, logprobs=3, **sampling)
        [ar] = generator.generate_ids([ids], params, mode="ar")
        for mode in ("ar", "sd", "ssd"):
            [out] = generator.generate_ids([ids], params, mode=mode)
            if sampling["temperature"] == 0 or mode == "ar":
                assert out.token_ids == ar.token_ids, (prompt, mode)
            assert [e.token for e in out.logprobs] == out.token_ids
            reference = scored(generator, ids, out.token_ids)
            # temperature and top-p do not enter: the raw distribution's logprobs (vLLM's default)
            assert [e.logprob for e in out.logprobs] == pytest.approx(reference, abs=1e-4), (prompt, mode)
            for entry in out.logprobs:
                assert len(entry.top) == 3 and entry.top[0][1] >= entry.logprob - 1e-9
                if sampling["temperature"] == 0:
                    assert entry.top[0][0] == entry.token
            if mode != "ar":
                accepted += sum(k * count for k, count in out.stats["accepted_histogram"].items())
    assert accepted > 0, "no drafted token was accepted: the draft's path was not exercised"
