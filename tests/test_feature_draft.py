"""A feature draft (EAGLE-3) in SD and SSD (issue 19, items 1-3): built by the real build, run through real
ONNX Runtime engines.

A tiny random-weight target (3 layers) is paired with an EAGLE-3 head in the released layout reading its
layers 0, 1, 2. Checked: greedy SD chains, SD trees and SSD are token-identical to AR; the draft's proposals
in SD are exactly what an independent torch computation gives when every verified token carries the
target's features (and a planted off-by-one in the bookkeeping is caught); in SSD every token that carries
the target's features carries those of its verified predecessor, the others carry the draft's own, and no
token falls back to an ancestor's feature when the draft drafted everything (jit backup); sampling through
the engines follows the target's distribution (TV against the exact one, with the noise floor).
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

import ssd_trt
from ssd_trt_plugins.tree_attention.reference import causal_tree_mask
from ssd_trt.decoding import speculative as speculative_module
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.engines.feature_draft import FeatureDraftEngine
from ssd_trt import SD, SSD
from ssd_trt.runtime import RuntimeOptions
from tests.helpers import random_decoder, save_hf_checkpoint, tiny_config, write_recipe

PROMPTS = [[1, 5, 9, 33, 7], [1, 100, 3], [1, 42, 42, 42, 42, 8, 19], [1, 250], [1, 17, 18, 19, 20, 21, 22],
           [1, 64, 128, 192], [1, 77, 3, 77, 3, 77], [1, 11]]
GREEDY = SamplingParams(max_new_tokens=32, stop_on_eos=False)
HIDDEN, DRAFT_VOCAB, FEATURE_LAYERS = 64, 128, (0, 1, 2)


def write_feature_head(directory, target, seed: int = 7, layers: int = 1):
    """An EAGLE-3 head for ``target`` in the released layout (``layers`` > 1: with extra decoder layers), random
    weights; draft vocabulary: even token ids."""
    from ssd_trt.models.eagle3 import Eagle3Config, released_shapes
    c = target.config
    hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
          "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
          "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": layers,
          "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "vocab_size": c.vocab_size,
          "draft_vocab_size": DRAFT_VOCAB, "max_position_embeddings": c.max_position_embeddings,
          "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(FEATURE_LAYERS)}}
    config = Eagle3Config.from_hf_dict(hf, c.num_layers)
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in released_shapes(config).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
        elif name not in ("d2t", "t2d"):
            state[name] = torch.from_numpy(rng.standard_normal(shape) / math.sqrt(shape[-1])).float()
    target_ids = torch.arange(DRAFT_VOCAB) * 2
    state["d2t"] = target_ids - torch.arange(DRAFT_VOCAB)
    state["t2d"] = torch.zeros(c.vocab_size, dtype=torch.bool)
    state["t2d"][target_ids] = True
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(hf))
    return directory


def build_feature_pair(root, copy_weights: list[float] | None = None, layers: int = 1):
    """(build dir, torch target, torch draft) of a tiny target with an EAGLE-3 head of ``layers`` layers, built
    for max batch 64; with ``copy_weights`` the head's config also carries a copy component."""
    from ssd_trt.build import build
    from ssd_trt.models.eagle3 import load_eagle3_checkpoint
    target = random_decoder(tiny_config(layers=3), seed=5)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.5)     # several tokens carry mass, so sampling filters bite (TV test)
    head = write_feature_head(root / "head", target, layers=layers)
    if copy_weights is not None:
        config = json.loads((head / "config.json").read_text())
        (head / "config.json").write_text(json.dumps({**config, "copy_mixture": {"weights": copy_weights}}))
    recipe = write_recipe(root / "feature.yaml", save_hf_checkpoint(target, root / "target"), head,
                          name="tiny-feature", max_batch=64)
    data = yaml.safe_load(recipe.read_text())
    data["draft"]["kind"] = "eagle3"
    recipe.write_text(yaml.safe_dump(data))
    draft = load_eagle3_checkpoint(head, 3, target.embed_tokens.weight.detach()).eval()
    return build(recipe, root=root), target, draft


@pytest.fixture(scope="module")
def feature_pair(tmp_path_factory):
    return build_feature_pair(tmp_path_factory.mktemp("feature"))


def test_the_build_records_a_feature_pair(feature_pair):
    from ssd_trt.manifest import read_manifest
    build, _, _ = feature_pair
    manifest = read_manifest(build)
    assert manifest.recipe.draft.kind == "eagle3"
    assert manifest.validation["draft"]["passed"] and manifest.validation["target"]["passed"]
    assert manifest.tensorrt.status == "skipped"        # backend: ort (plans: tests/test_tensorrt_rtx.py)
    gen = ssd_trt.load(build)
    assert gen.engine("target").has_features
    assert isinstance(gen.engine("draft"), FeatureDraftEngine)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("mode", [
    SD(draft_len=3), SD(draft_len=2, tree_widths=(2, 2, 1)), SSD(draft_len=2, backup="jit", fan_out_budget=8),
    SSD(draft_len=3, backup="ngram", fan_out_budget=8)],
    ids=["sd-chain", "sd-tree", "ssd-jit", "ssd-ngram"])
def test_greedy_with_a_feature_draft_equals_autoregressive(feature_pair, batch, mode):
    build, _, _ = feature_pair
    gen = ssd_trt.load(build)
    rounds = []
    for first in range(0, len(PROMPTS), batch):
        prompts = PROMPTS[first:first + batch]
        reference = [r.token_ids for r in gen.generate_ids(prompts, GREEDY, mode="ar")]
        results = gen.generate_ids(prompts, GREEDY, mode=mode)
        assert [r.token_ids for r in results] == reference
        rounds.append(results[0].stats["rounds"])
    assert min(rounds) > 0                   # the draft proposed in every request (a random head: few accepted)


def reference_target_features(target, ids: list[int]) -> np.ndarray:
    """The torch target's features (inputs of FEATURE_LAYERS) of every token of ``ids`` [T, 3H]."""
    from ssd_trt.models.decoder import with_target_features
    model = with_target_features(random_decoder(target.config, seed=0), FEATURE_LAYERS)
    model.load_state_dict(target.state_dict(), strict=False)
    length = len(ids)
    caches = model.empty_caches(1, length)
    with torch.no_grad():
        out = model(torch.tensor([ids]), torch.arange(length)[None], torch.from_numpy(causal_tree_mask(1, length)),
                    torch.zeros(1, dtype=torch.int32), *caches)
    return out[-1][0].numpy()


def reference_proposals(target, draft, committed: list[int], count: int) -> list[int]:
    """What the EAGLE-3 draft proposes behind ``committed`` when every committed token carries the target's
    features of its predecessor (the first none) and each drafted token the draft's output for the one before."""
    features = reference_target_features(target, committed)
    length = len(committed)
    carried = np.zeros((length, features.shape[1]), dtype=np.float32)
    carried[1:] = features[:-1]
    keys, values = draft.empty_caches(1, length + count)
    proposals = []
    with torch.no_grad():
        logits, hidden, keys, values = draft(
            torch.tensor([committed]), torch.arange(length)[None], torch.from_numpy(causal_tree_mask(1, length)),
            torch.zeros(1, dtype=torch.int32), torch.from_numpy(carried)[None], torch.zeros(1, length, HIDDEN),
            torch.ones(1, length, dtype=torch.bool), keys, values)
        for step in range(count):
            proposals.append(int(logits[0, -1].argmax()))
            if step + 1 == count:
                break
            position = length + step
            logits, hidden, keys, values = draft(
                torch.tensor([[proposals[-1]]]), torch.tensor([[position]]),
                torch.from_numpy(causal_tree_mask(1, 1)), torch.tensor([position], dtype=torch.int32),
                torch.zeros(1, 1, features.shape[1]), hidden[:, -1:], torch.zeros(1, 1, dtype=torch.bool), keys, values)
    return proposals


def record_sd_rounds(monkeypatch, every_row: bool = False) -> list[tuple[list[int], list[int]]]:
    """(committed tokens, the draft's K proposals) of every chain draft loop's first row (``every_row``: of each
    row it fed: greedy rows it did not draft for take the argmax too, so they show the same computation)."""
    rounds = []
    original = speculative_module.draft_tokens

    def recording(draft, pending, num_tokens, draw):
        committed = [[int(t) for t in draft.cached_tokens(r)] + list(pending[r]) for r in range(len(pending))]
        tokens, dists = original(draft, pending, num_tokens, draw)
        for r in range(len(pending) if every_row else 1):
            rounds.append((committed[r], [int(t) for t in tokens[r]]))
        return tokens, dists

    monkeypatch.setattr(speculative_module, "draft_tokens", recording)
    return rounds


@pytest.mark.parametrize("planted", [False, True], ids=["as-built", "planted-off-by-one"])
def test_sd_proposals_are_the_drafts_with_the_targets_features_of_verified_tokens(feature_pair, monkeypatch, planted):
    """Every SD round's K proposals equal the independent torch computation (all verified tokens carry the
    target's features of their predecessor). Planted: verified tokens carry their own position's features
    instead (off by one), and the comparison must fail."""
    build, target, draft = feature_pair
    if planted:
        original = FeatureDraftEngine.receive_target_features
        monkeypatch.setattr(FeatureDraftEngine, "receive_target_features",
                            lambda self, row, first, features: original(self, row, first,
                                                                        np.roll(features, -1, axis=0)))
    rounds = record_sd_rounds(monkeypatch)
    gen = ssd_trt.load(build)
    for prompt in PROMPTS[:2 if planted else 4]:
        gen.generate_ids([prompt], SamplingParams(max_new_tokens=24, stop_on_eos=False), mode=SD(draft_len=3))
    assert len(rounds) > (10 if planted else 20)
    mismatched = [r for r in rounds if reference_proposals(target, draft, r[0], 3) != r[1]]
    if planted:
        assert len(mismatched) > len(rounds) // 4, "an off-by-one in the features went unnoticed"
    else:
        assert not mismatched, f"{len(mismatched)} of {len(rounds)} rounds differ, first: {mismatched[0]}"


def test_the_engine_step_relays_features_to_requests_that_join_leave_and_change_kind(feature_pair, monkeypatch):
    """Requests of every kind join and leave an engine step over the feature pair (their draft rows move, new
    ones start mid-run, an adaptive SSD request may pause its draft and resume it): every request's tokens are
    AR's, and every proposal of every draft loop is what the torch draft gives with the target's features of
    every verified token (each request's features are kept, and handed to its draft row whenever it lacks them).
    """
    from ssd_trt.batching.engine import LLMEngine
    build, target, draft = feature_pair
    gen = ssd_trt.load(build)
    reference = [r.token_ids for r in gen.generate_ids(PROMPTS, GREEDY, mode="ar")]
    rounds = record_sd_rounds(monkeypatch, every_row=True)
    modes = [SD(draft_len=3), "ssd", SSD(draft_len=2, backup="jit", fan_out_budget=6), "ar",
             SD(draft_len=2, tree_widths=(2, 2, 1)), SD(draft_len=2), "ssd", SSD(draft_len=3, backup="ngram")]
    schedule = {0: [0, 1], 2: [2, 3, 4], 9: [5, 6], 14: [7]}
    engine = LLMEngine(gen)
    step = 0
    while engine.has_unfinished() or step <= max(schedule):
        for i in schedule.get(step, []):
            engine.add_request(PROMPTS[i], GREEDY, modes[i], request_id=str(i))
        engine.step()
        step += 1
    for i in range(len(PROMPTS)):
        assert engine.take_result(str(i)).tokens == reference[i], (i, modes[i])
    engine.close()
    assert len(rounds) > 40
    mismatched = [r for r in rounds if reference_proposals(target, draft, r[0], len(r[1])) != r[1]]
    assert not mismatched, f"{len(mismatched)} of {len(rounds)} proposals differ, first: {mismatched[0]}"


def test_ssd_feeds_target_features_for_verified_tokens_and_its_own_otherwise(feature_pair, monkeypatch):
    """Every token of every SSD draft step: carrying the target's features means carrying exactly the torch
    target's features of its predecessor on the committed sequence; both kinds occur; with the jit backup every
    draft-featured token finds its parent's output (no fallback), with prompt lookup some cannot."""
    from ssd_trt.engines.ort import OrtEngine
    build, target, _ = feature_pair
    steps = []
    original = OrtEngine.forward_rows

    def recording(self, start, stop, input_ids, position_ids, tree_mask=None, logit_indices=None, extra=None):
        if extra is not None:
            steps.append((position_ids.copy(), {k: v.copy() for k, v in extra.items()}))
        return original(self, start, stop, input_ids, position_ids, tree_mask, logit_indices, extra)

    monkeypatch.setattr(OrtEngine, "forward_rows", recording)
    for backup, fallbacks_expected in (("jit", False), ("ngram", True)):
        gen = ssd_trt.load(build)
        gen.engine("draft")                  # opened (and warmed up with a placeholder step) before recording
        fallbacks = 0
        for prompt in PROMPTS[:4]:
            steps.clear()
            [result] = gen.generate_ids([prompt], GREEDY, mode=SSD(draft_len=2, backup=backup, fan_out_budget=6))
            fallbacks += gen.engine("draft").fallbacks
            truth = reference_target_features(target, prompt + result.token_ids)
            kinds = set()
            for positions, extra in steps:
                for position, flag, feature in zip(positions[0], extra["from_target"][0], extra["features"][0]):
                    kinds.add(bool(flag))
                    if flag and position > 0:
                        # its predecessor's; a fallback (prompt lookup ran no network) carries an ancestor's
                        errors = np.abs(feature[None] - truth[:position]).max(axis=1)
                        nearest = errors[-1] if not fallbacks_expected else errors.min()
                        assert nearest < 1e-3, (backup, position)
            assert kinds == {True, False}
        assert (fallbacks > 0) == fallbacks_expected, (backup, fallbacks)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [SD(draft_len=3), SSD(draft_len=2, backup="jit", fan_out_budget=8)],
                         ids=["sd", "ssd"])
def test_sampling_with_a_feature_draft_follows_the_target_distribution(feature_pair, mode):
    """The first two tokens at T=1 top-k 50 through the engines vs the exact target distribution (the machinery
    and thresholds of tests/test_sampling_lossless_ort.py); the random head's flat q overlaps the target's p
    enough that proposals are accepted and rejected."""
    from tests import test_sampling_lossless_ort as tv
    build, target, _ = feature_pair
    params = tv.SETTINGS["t1-k50"]
    joint = tv.exact_tokens(target, SamplingParams(max_new_tokens=2, **params))
    assert len(joint) > 100
    samples, stats = tv.draw(build, mode, params)
    for what, distance, threshold in tv.check(joint, samples):
        assert distance < threshold, f"{mode.name} {what}: TV {distance:.4f} >= {threshold:.4f}"
    assert 0.02 < np.mean([s["mean_accepted"] for s in stats]) < mode.draft_len   # ~0.05: thousands of rounds


@pytest.mark.parametrize("mode", [SD(draft_len=2), SSD(draft_len=2)], ids=["sd", "ssd"])
def test_the_gpu_runtime_runs_a_feature_pair(feature_pair, mode):
    """The torch backend (DeviceStepEngine: what the GPU runtime and the TensorRT engine share; here on CPU, the
    Triton kernel interpreted) returns the target's features and feeds the draft's: greedy output == AR's."""
    from ssd_trt.engines.device_step import DeviceStepEngine
    build, _, _ = feature_pair
    reference = [r.token_ids for r in ssd_trt.load(build).generate_ids(PROMPTS[:2], GREEDY, mode="ar")]
    gen = ssd_trt.load(build, RuntimeOptions(backend="torch"))
    assert isinstance(gen.engine("draft").inner, DeviceStepEngine) and gen.engine("target").has_features
    assert [r.token_ids for r in gen.generate_ids(PROMPTS[:2], GREEDY, mode=mode)] == reference


def test_a_recipe_refuses_an_eagle3_draft_it_cannot_build(tmp_path):
    from ssd_trt.errors import RecipeError
    from ssd_trt.recipe import load_recipe
    path = tmp_path / "r.yaml"
    path.write_text("name: x\ntarget: {source: t}\ndraft: {source: d, kind: eagle3, tokenizer: other}\n")
    with pytest.raises(RecipeError, match="its tokenizer is the target's"):
        load_recipe(path)
    path.write_text("name: x\ntarget: {source: t}\ndraft: {source: d, kind: eagle4}\n")
    with pytest.raises(RecipeError, match="draft.kind"):
        load_recipe(path)



def test_the_copy_component_works_on_top_of_a_feature_draft(tmp_path):
    """Item 2: the copy component keeps working on a feature draft: it wraps the feature engine, moves the
    draft's distribution where a suffix recurs (and only there), and every mode stays exact."""
    from ssd_trt.engines.copy_mixture import CopyMixtureEngine
    from ssd_trt.ngram import longest_match
    build, _, _ = build_feature_pair(tmp_path, copy_weights=[0.9] * 4)
    with_copy, without = ssd_trt.load(build), ssd_trt.load(build, RuntimeOptions(draft_copy=False))
    draft = with_copy.engine("draft")
    assert isinstance(draft, CopyMixtureEngine) and isinstance(draft.inner, FeatureDraftEngine)
    assert isinstance(without.engine("draft"), FeatureDraftEngine)
    ids = np.array([[1, 77, 3, 77, 3, 77, 9]])
    logits = []
    for engine in (draft, without.engine("draft")):
        engine.reset(1)
        logits.append(engine.forward(ids, np.arange(ids.shape[1])[None])[0])
    moved = [not np.allclose(a, b) for a, b in zip(*logits)]
    assert moved == [longest_match(ids[0, :t + 1], 4) is not None for t in range(ids.shape[1])] and any(moved)
    for mode in (SD(draft_len=3), SSD(draft_len=2, backup="jit", fan_out_budget=8)):
        gen = ssd_trt.load(build)
        reference = [r.token_ids for r in gen.generate_ids(PROMPTS[:4], GREEDY, mode="ar")]
        assert [r.token_ids for r in gen.generate_ids(PROMPTS[:4], GREEDY, mode=mode)] == reference


def test_a_two_layer_feature_draft_builds_and_every_mode_stays_exact(tmp_path):
    """Item 5's larger draft: a head with an extra decoder layer exports with one cache pair per layer, its graph
    passes validation against the torch module, and SD chains, SD trees and SSD stay token-identical to AR."""
    from ssd_trt.manifest import read_manifest
    build, _, draft = build_feature_pair(tmp_path, layers=2)
    manifest = read_manifest(build)
    assert draft.config.layer.num_layers == 2
    assert manifest.model("draft").config.num_layers == 2 and manifest.validation["draft"]["passed"]
    for mode in (SD(draft_len=3), SD(draft_len=2, tree_widths=(2, 2, 1)),
                 SSD(draft_len=2, backup="jit", fan_out_budget=8)):
        gen = ssd_trt.load(build)
        assert gen.engine("draft").inner.spec.num_layers == 2
        reference = [r.token_ids for r in gen.generate_ids(PROMPTS, GREEDY, mode="ar")]
        results = gen.generate_ids(PROMPTS, GREEDY, mode=mode)
        assert [r.token_ids for r in results] == reference and results[0].stats["rounds"] > 0
