"""Structured output stays lossless under speculation (``decoding/grammar.py``): the target is masked at every verified
position by the grammar state along the path to it, the draft along its own proposals. Greedy output under a JSON
schema is AR's in every mode and always parses and validates; sampled output under a small grammar follows the masked
target distribution (TV against the exact one, computed here from the torch decoder and llguidance's own matcher
walked one token at a time); masking the draft raises acceptance and changes no token."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

import ssd_trt
from ssd_trt import AR, SD, SSD
from ssd_trt.decoding.grammar import Grammar, apply_mask
from ssd_trt.errors import RequestError
from tests.sampling_reference import reference_probs
from tests.test_sampling_lossless_ort import check

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                         "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]}}}
PROMPTS = ["Describe a person as JSON:", "The capital of France is", "def fibonacci(n):", "Once upon a time",
           "List three colours.", "Tell me about Tokyo."]
DIGITS = Grammar("regex", "[0-9][0-9]")        # two tokens on this tokenizer (one per digit)
SAMPLES = 960                                   # per mode


@pytest.fixture(scope="module")
def generator(smollm2_build):
    return ssd_trt.load(smollm2_build)


def test_masks_along_a_chain_and_a_tree_are_the_matcher_walked_one_token_at_a_time(generator):
    grammars = generator.grammars
    text = json.dumps({"name": "Ana", "age": 7, "city": "Lima"})
    ids = generator.tokenizer.encode(text, add_special_tokens=False)
    state = grammars.state(Grammar.json_schema(PERSON))
    # a chain (prefixes), then paths that branch off and a path that leaves the grammar
    paths = [ids[:k] for k in range(len(ids) + 1)] + [ids[:3], ids[:2] + [ids[5]], ids[:4]]
    masks = state.masks_along(paths)
    for path, mask in zip(paths, masks):
        fresh = grammars.state(Grammar.json_schema(PERSON))
        if not all(fresh.matcher.consume_token(t) for t in path):
            assert mask is None, path
            continue
        assert mask is not None and np.array_equal(mask, fresh.masks_along([[]])[0]), path
    assert masks[len(ids)] is not None and np.flatnonzero(masks[len(ids)]).tolist() == sorted(generator.eos_ids)
    assert state.masks_along([[]])[0].sum() == 1            # rolled back: the start again (only '{"' fits)


@pytest.mark.parametrize("grammar, words", [
    (Grammar("json", '{"type": "bogus"}'), "Invalid type"),
    (Grammar("json", "{not json"), "not valid JSON"),
    (Grammar("regex", "(["), "regex"),
    (Grammar("lark", "start: missing_rule"), "missing_rule"),
    (Grammar("choice", "[]"), "non-empty list"),
])
def test_a_bad_grammar_is_refused_at_the_request_check_saying_what_is_wrong(generator, grammar, words):
    params = ssd_trt.SamplingParams(max_new_tokens=4, grammar=grammar)
    with pytest.raises(RequestError, match="grammar|schema|choice") as caught:
        generator.check_request([generator.encode("Hi")], params, "ar")
    assert words in str(caught.value)


def test_choice_regex_and_gbnf_grammars_hold_in_greedy_ssd(generator):
    ids = generator.encode("Is the sky blue? Answer:")
    for grammar, valid in [(Grammar.choice(["yes", "no", "it depends"]), lambda t: t in ("yes", "no", "it depends")),
                           (Grammar("regex", r"[0-9]{3}-[a-z]{2,4}"), None),
                           (Grammar("lark", 'root ::= "A" | "B" | "C"'), lambda t: t in "ABC")]:
        params = ssd_trt.SamplingParams(max_new_tokens=16, grammar=grammar)
        [ar] = generator.generate_ids([ids], params, mode=AR())
        [ssd] = generator.generate_ids([ids], params, mode=SSD(draft_len=3))
        assert ssd.token_ids == ar.token_ids
        import re
        assert (valid(ar.text) if valid else re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", ar.text)), ar.text
        assert ar.stats["finish_reason"] == "stop"


@pytest.mark.slow
def test_greedy_json_under_a_schema_is_ar_in_every_mode_and_always_validates(generator):
    params = ssd_trt.SamplingParams(max_new_tokens=64, grammar=Grammar.json_schema(PERSON))
    ids = [generator.encode(p) for p in PROMPTS]
    ar = generator.generate_ids(ids, params, mode=AR())
    texts = set()
    for result in ar:
        jsonschema.validate(json.loads(result.text), PERSON)
        assert result.stats["finish_reason"] == "stop"
        texts.add(result.text)
    assert len(texts) >= 3                      # the prompts steer the values: the mask does not fix the output
    for mode in (SD(draft_len=3), SSD(draft_len=2), SSD(draft_len=3, fan_out_budget=12)):
        out = generator.generate_ids(ids, params, mode=mode)
        assert [r.token_ids for r in out] == [r.token_ids for r in ar], mode


@pytest.mark.slow
def test_greedy_json_under_a_schema_in_sd_token_trees_is_ar_on_the_fp32_build(smollm2_fp32_build):
    """Trees keep the grammar state per branch (the draft's children masked after their parent's path, the target's
    nodes masked along their ancestors); on the fp32 build, where trees are exact (the int8 build's tree defect:
    tests/test_speculative_greedy.py)."""
    gen = ssd_trt.load(smollm2_fp32_build)
    params = ssd_trt.SamplingParams(max_new_tokens=64, grammar=Grammar.json_schema(PERSON))
    ids = [gen.encode(p) for p in PROMPTS[:4]]          # (this build's max batch)
    ar = gen.generate_ids(ids, params, mode=AR())
    for result in ar:
        jsonschema.validate(json.loads(result.text), PERSON)
    for mode in (SD(tree_widths=(2, 2)), SD(tree_widths=(3, 2, 1))):
        out = gen.generate_ids(ids, params, mode=mode)
        assert [r.token_ids for r in out] == [r.token_ids for r in ar], mode
        assert all(r.stats["acceptance_rate"] > 0 for r in out)


@pytest.mark.slow
def test_masking_the_draft_raises_acceptance_and_changes_no_token(generator):
    ids = [generator.encode(p) for p in PROMPTS[:4]]
    accepted = {}
    for mask_draft in (False, True):
        params = ssd_trt.SamplingParams(max_new_tokens=48, grammar=Grammar.json_schema(PERSON), mask_draft=mask_draft)
        [ar] = [generator.generate_ids(ids, params, mode=AR())]
        for name, mode in {"sd": SD(draft_len=3), "ssd": SSD(draft_len=2)}.items():
            out = generator.generate_ids(ids, params, mode=mode)
            assert [r.token_ids for r in out] == [r.token_ids for r in ar]
            accepted[name, mask_draft] = np.mean([r.stats["acceptance_rate"] for r in out])
    for name in ("sd", "ssd"):
        assert accepted[name, True] > accepted[name, False] + 0.1, accepted


@pytest.mark.slow
@pytest.mark.parametrize("build, mode", [("smollm2_build", AR()), ("smollm2_build", SD(draft_len=3)),
                                         ("smollm2_build", SSD(draft_len=2, backup="jit", fan_out_budget=8)),
                                         ("smollm2_fp32_build", SD(tree_widths=(2, 2)))],
                         ids=["ar", "sd", "ssd", "sd-tree-fp32"])
def test_sampled_tokens_under_a_grammar_follow_the_masked_target_distribution(request, build, mode):
    """Two digits after a prompt, sampled: the exact distribution comes from the target engine's own logits, fed by
    hand one prefix at a time, masked by a fresh matcher walked by hand (no runtime decoding code involved). SD token
    trees run on the fp32 build: on the int8 one their verification is not exact (a known open defect,
    tests/test_speculative_greedy.py)."""
    from ssd_trt.engines.feeding import feed_rows
    generator = ssd_trt.load(request.getfixturevalue(build))
    settings = dict(temperature=1.0, top_k=50)
    params = ssd_trt.SamplingParams(max_new_tokens=2, grammar=DIGITS, **settings)
    prompt = generator.encode("The year was 19")
    generator.generate_ids([prompt], ssd_trt.SamplingParams(max_new_tokens=1), mode=AR())   # (allocates the cache)
    view = generator.engine("target").rows(0, 1)
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(2):
        longer = {}
        for prefix, mass in joint.items():
            view.rollback(np.zeros(1, dtype=np.int32))
            logits = feed_rows(view, [prompt + list(prefix)])[0, -1]
            state = generator.grammars.state(DIGITS)
            assert all(state.matcher.consume_token(t) for t in prefix)
            probs = reference_probs(apply_mask(logits, state.masks_along([[]])[0]), params)
            for token in np.flatnonzero(probs > 0):
                longer[prefix + (int(token),)] = mass * float(probs[token])
        joint = longer
    view.rollback(np.zeros(1, dtype=np.int32))
    assert len(joint) > 20
    rows = min(16, generator.limits.max_batch)
    samples = []
    for call in range(SAMPLES // rows):
        request_params = ssd_trt.SamplingParams(max_new_tokens=2, seed=1000 + call, grammar=DIGITS, **settings)
        samples += [tuple(r.token_ids) for r in generator.generate_ids([prompt] * rows, request_params, mode=mode)]
    for what, tv, threshold in check(joint, samples):
        assert tv < threshold, f"{mode.name} {what}: TV {tv:.4f} >= {threshold:.4f}"
