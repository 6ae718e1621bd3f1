"""The draft's copy component (engines/copy_mixture.py): its math, its context tracking in every step
shape the strategies use, that it stays lossless, and that a malformed one is refused at build time."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from ssd_trt.ngram import longest_match, lookup_followers
from ssd_trt.engines.feeding import feed_rows
from ssd_trt.decoding.sampling import softmax
from ssd_trt.engines.copy_mixture import CopyMixture, CopyMixtureEngine
from ssd_trt.errors import ArtifactError
from tests.helpers import random_decoder, save_hf_checkpoint, tiny_config
from tests.test_sampling_lossless import DRAFT, assert_lossless
from tests.trigram import TrigramEngine

ROOT = Path(__file__).resolve().parents[1]
STRONG = CopyMixture((0.5, 0.7, 0.9))   # large weights, so the copy component changes what gets drafted


def test_longest_match_is_the_first_lookup_follower():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        context = rng.integers(0, 4, rng.integers(1, 30))
        found = lookup_followers(list(context), max_ngram=5, limit=1)
        assert longest_match(context, 5) == (found[0] if found else None)
    #            the suffix "7 8" occurred twice; the most recent occurrence was followed by 5
    assert longest_match(np.array([7, 8, 1, 7, 8, 5, 2, 7, 8]), 4) == (5, 2)
    assert longest_match(np.array([1, 2, 3]), 4) is None


def test_mixture_is_the_stated_distribution():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(50)
    logits[40:] = -np.inf                                  # a reduced head: q = 0 off the head
    context = np.array([3, 41, 9, 3, 41])                  # "3 41" recurs, followed by 9 (in the head)
    mixed = STRONG.apply(logits.copy(), context)
    expected = 0.3 * softmax(logits)
    expected[9] += 0.7
    np.testing.assert_allclose(softmax(mixed), expected, atol=1e-12)
    # a follower outside the head gets exactly lam
    off_head = STRONG.apply(logits.copy(), np.array([5, 44, 5]))
    assert softmax(off_head)[44] == pytest.approx(0.5)
    # no recurring suffix, or lam = 0: the draft's own logits
    np.testing.assert_array_equal(STRONG.apply(logits.copy(), np.array([1, 2, 3])), logits)
    np.testing.assert_array_equal(CopyMixture((0.0,)).apply(logits.copy(), context), logits)


@pytest.mark.parametrize("config", [{"weights": []}, {"weights": [1.0]}, {"weights": [-0.1]}, {"weights": "x"},
                                    {"lam": [0.1]}])
def test_malformed_weights_are_refused(config):
    with pytest.raises(ArtifactError, match="copy_mixture must look like"):
        CopyMixture.from_config({"copy_mixture": config}, where="draft/config.json")
    assert CopyMixture.from_config({}, where="x") is None


def test_engine_tracks_contexts_through_ragged_tree_rollback_and_keep():
    """Every logits row must equal the mixture applied with that token's true context."""
    wrapped, plain = CopyMixtureEngine(TrigramEngine(DRAFT), STRONG), TrigramEngine(DRAFT)
    for engine in (wrapped, plain):
        engine.reset(2)

    def check(got, inner, contexts):
        for (row, i), context in contexts.items():
            np.testing.assert_allclose(got[row, i], STRONG.apply(inner[row, i].copy(), np.array(context)))

    rows = [[1, 2, 3, 1, 2], [4, 4, 4]]                    # ragged: row 1 is right-padded
    # logits of each row's last 3 tokens: positions 2..4 of row 0, 0..2 of row 1 (per-row logit_indices)
    check(feed_rows(wrapped, rows, tail=3), feed_rows(plain, rows, tail=3),
          {(r, i): rows[r][:len(rows[r]) - 3 + i + 1] for r in range(2) for i in range(3)})
    # a tree step: node 0 is the root, nodes 1 and 2 its children, node 3 a child of node 2
    ids = np.array([[3, 1, 2, 3], [4, 0, 4, 4]])
    mask = np.zeros((2, 4, 4), dtype=bool)
    for i, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 2, 3]]):
        mask[:, i, ancestors] = True
    positions = wrapped.lengths[:, None] + np.array([0, 1, 1, 2])[None]
    got, inner = wrapped.forward(ids, positions, mask), plain.forward(ids, positions, mask)
    check(got, inner, {(r, i): rows[r] + [int(ids[r, a]) for a in anc]
                       for r in range(2) for i, anc in enumerate([[0], [0, 1], [0, 2], [0, 2, 3]])})
    # keep the path root -> node 2 -> node 3 in row 0, drop the tree in row 1, then continue both
    for engine in (wrapped, plain):
        engine.keep(0, len(rows[0]), [0, 2, 3])
        engine.rollback(np.array([len(rows[0]) + 3, len(rows[1])], dtype=np.int32))
    kept = [rows[0] + [3, 2, 3], rows[1]]
    step = np.array([[1], [4]])
    got, inner = wrapped.forward(step, wrapped.lengths[:, None]), plain.forward(step, plain.lengths[:, None])
    check(got, inner, {(r, 0): kept[r] + [int(step[r, 0])] for r in range(2)})


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_sampling_with_the_copy_component_is_lossless(mode):
    from ssd_trt.decoding.settings import SD, SSD

    settings = SD(draft_len=2) if mode == "sd" else SSD(draft_len=2, fan_out_budget=4, backup="jit")
    assert_lossless(settings, 1.0, draft=lambda: CopyMixtureEngine(TrigramEngine(DRAFT, name="draft"), STRONG))


def test_the_copy_component_changes_the_draft():
    """Guards the tests above against a wrapper that silently does nothing."""
    wrapped, plain = CopyMixtureEngine(TrigramEngine(DRAFT), STRONG), TrigramEngine(DRAFT)
    rows = [[1, 2, 1, 2, 1]]
    for engine in (wrapped, plain):
        engine.reset(1)
    assert not np.allclose(feed_rows(wrapped, rows, tail=5), feed_rows(plain, rows, tail=5))


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_greedy_with_the_copy_component_equals_autoregressive(tiny_pairs, mode):
    import ssd_trt
    from ssd_trt.decoding.params import SamplingParams

    gen = ssd_trt.load(tiny_pairs["perturbed"])
    gen.engines.copy_mixture = STRONG                          # what a draft config.json with copy_mixture gives
    prompts = [[5, 9, 5, 9, 5], [1, 2, 3, 1, 2, 3, 1], [7] * 6, [3, 14, 15, 92, 6, 3, 14]]
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    want = gen.generate_ids(prompts, params, mode="ar")
    got = gen.generate_ids(prompts, params, mode=mode)
    assert isinstance(gen.engine("draft"), CopyMixtureEngine)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_a_malformed_copy_component_fails_the_build(tmp_path):
    draft = save_hf_checkpoint(random_decoder(tiny_config(), seed=0), tmp_path / "d")
    config = json.loads((draft / "config.json").read_text())
    config["copy_mixture"] = {"weights": [0.2, 1.5]}
    (draft / "config.json").write_text(json.dumps(config))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "t", "output_dir": str(tmp_path / "out"), "target": {"source": str(draft)},
                                      "draft": {"source": str(draft)}, "engine": {"backend": "ort"}}))
    result = subprocess.run([sys.executable, "-m", "ssd_trt.build", str(recipe)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "copy_mixture must look like" in result.stderr and "config.json" in result.stderr


@pytest.mark.parametrize("fault", ["crash", "short", "nan"])
def test_a_failing_draft_under_the_copy_component_still_finishes_exactly(tiny_pairs, fault):
    """The wrapper passes the failure on (it never hides or garbles it): SSD finishes target-only."""
    import ssd_trt
    from ssd_trt.decoding.params import SamplingParams
    from tests.test_faults import FaultyEngine

    gen = ssd_trt.load(tiny_pairs["perturbed"])
    gen.engines.copy_mixture = STRONG
    prompts, params = [[5, 9, 5, 9, 5], [1, 2, 3, 1, 2, 3, 1]], SamplingParams(max_new_tokens=24, temperature=0.0)
    want = [r.token_ids for r in gen.generate_ids(prompts, params, mode="ar")]
    wrapped = gen.engine("draft")
    wrapped.inner = FaultyEngine(wrapped.inner, fault, at=3)
    results = gen.generate_ids(prompts, params, mode=ssd_trt.SSD(draft_len=2))
    assert [r.token_ids for r in results] == want
    if fault != "nan":   # NaN logits are not an error the runtime detects: they only draft tokens that get rejected
        assert results[0].stats["draft_failures"], "the injected fault went unreported"
