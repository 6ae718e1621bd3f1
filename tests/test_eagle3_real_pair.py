"""Sampling with the real embedded feature pair through ONNX Runtime follows the target's distribution (issue 19).

The shipped recipe ``recipes/smollm2-135m-eagle3.yaml`` (the embedded target with its 4-bit blocks and int8
activations, the trained EAGLE-3 head with int8 blocks, the real tokenizer and chat template), built here for
ONNX Runtime only, at batch 64, on a plain-text prompt. At T=1 top-k 3 the first three generated tokens have at most 27 outcomes, so
their exact distribution is countable: it comes from the target engine's own logits, one prefix at a time at
batch 1, and the plain dense filter (tests/sampling_reference.py), never from the runtime's sampling code. SD
and SSD draw from 64 rows x 16 calls, each call with its own seed (fresh draft and target streams); the
threshold is the noise floor's (tests/test_sampling_lossless.py). Three tokens at SSD K=1 also cover rounds
served from the speculation cache. The draft must do real work: some of its tokens accepted, some rejected.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

import ssd_trt
from ssd_trt import SD, SSD
from tests.sampling_reference import reference_probs
from tests.test_sampling_lossless_ort import check, draw

ROOT = Path(__file__).resolve().parents[1]
ROWS, CALLS, LENGTH = 64, 16, 3
PARAMS = dict(temperature=1.0, top_k=3)
CASES = {"sd": SD(draft_len=2), "ssd": SSD(draft_len=1, backup="jit", fan_out_budget=4)}


@pytest.fixture(scope="module")
def real_feature_pair(tmp_path_factory) -> Path:
    from ssd_trt.build import build
    root = tmp_path_factory.mktemp("eagle3-real")
    recipe = yaml.safe_load((ROOT / "recipes" / "smollm2-135m-eagle3.yaml").read_text())
    recipe["draft"]["source"] = str(ROOT / "recipes" / recipe["draft"]["source"])
    recipe["output_dir"] = str(root / "build")
    # ONNX Runtime only: a feature pair's TensorRT for RTX plans are built by test_tensorrt_rtx.py
    recipe["engine"].update(backend="ort", tensorrt="none", max_batch=ROWS, max_context=256)
    path = root / "eagle3-ort.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return build(path, root=root)


def exact_tokens(build: Path, prompt: list[int], params: ssd_trt.SamplingParams) -> dict[tuple[int, ...], float]:
    """P(t1..t_LENGTH | prompt) under the filtered target: its engine's logits for every prefix, batch 1."""
    target = ssd_trt.load(build).engine("target")
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(LENGTH):
        longer = {}
        for prefix, mass in out.items():
            ids = np.array([prompt + list(prefix)], dtype=np.int64)
            target.reset(1)
            logits = target.forward(ids, np.arange(ids.shape[1])[None])[0, -1]
            probs = reference_probs(logits, params)
            for token in np.flatnonzero(probs > 0):
                longer[prefix + (int(token),)] = mass * float(probs[token])
        out = longer
    return out


@pytest.mark.slow
def test_sd_and_ssd_with_the_real_feature_pair_follow_the_target_distribution(real_feature_pair):
    gen = ssd_trt.load(real_feature_pair)
    # a plain-text prompt (a chat-templated one costs 7x the prefill); the first tokens have real spread
    prompt = gen.encode("The capital of France is")
    joint = exact_tokens(real_feature_pair, prompt, ssd_trt.SamplingParams(max_new_tokens=LENGTH, **PARAMS))
    assert len(joint) == 27 and max(joint.values()) < 0.5, sorted(joint.values())[-3:]
    for mode, settings in CASES.items():
        samples, stats = draw(real_feature_pair, settings, PARAMS, length=LENGTH, prompt=prompt, rows=ROWS,
                              calls=CALLS)
        for what, tv, threshold in check(joint, samples):
            assert tv < threshold, f"{mode} {what}: TV {tv:.4f} >= {threshold:.4f}"
        accepted = np.mean([s["mean_accepted"] for s in stats])
        assert 0.05 < accepted < settings.draft_len, (mode, accepted)
        if mode == "ssd":
            rates = [s["cache_hit_rate"] for s in stats if s["cache_hit_rate"] is not None]
            assert rates and 0 < np.mean(rates), rates
