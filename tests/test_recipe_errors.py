"""A bad recipe exits non-zero with one readable paragraph naming the problem -- never a traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import random_decoder, save_hf_checkpoint, tiny_config

ROOT = Path(__file__).resolve().parents[1]


def run_build(recipe: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ssd_trt.build", str(recipe)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    small = save_hf_checkpoint(random_decoder(tiny_config(), seed=0), root / "a")
    other_vocab = save_hf_checkpoint(random_decoder(tiny_config(vocab=200), seed=1), root / "b")
    return small, other_vocab


def recipe(tmp_path: Path, data) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def good(checkpoints, tmp_path) -> dict:
    small, _ = checkpoints
    return {"name": "t", "output_dir": str(tmp_path / "out"), "target": {"source": str(small)},
            "draft": {"source": str(small)}, "engine": {"backend": "ort"}}


CASES = {
    "missing field": (lambda d: d.pop("target"), ["field 'target'", "required"]),
    "wrong type": (lambda d: d["engine"].update(max_batch="four"), ["engine.max_batch", "integer"]),
    "unknown backend": (lambda d: d["engine"].update(backend="cuda"), ["engine.backend", "'auto', 'ort', 'trt' or 'torch'"]),
    "unknown field": (lambda d: d["engine"].update(max_bacth=2), ["engine.max_bacth", "not a known field"]),
    "path does not exist": (lambda d: d["draft"].update(source="/nope/model"), ["/nope/model", "does not exist"]),
    "bad dtype": (lambda d: d["target"].update(dtype="int3"), ["target.dtype"]),
    "non-positive limit": (lambda d: d["engine"].update(max_context=0), ["engine.max_context"]),
    "default K over the engine's": (lambda d: d.update(decoding={"ssd_draft_len": 9}),
                                    ["decoding.ssd_draft_len (9) exceeds engine.max_draft_len (8)"]),
    "default budget zero": (lambda d: d.update(decoding={"ssd_draft_len": 4, "ssd_fan_out_budget": 0}),
                            ["decoding.ssd_fan_out_budget", "greater than or equal to 1"]),
    "default SSD tree over the engine's": (
        lambda d: d.update(decoding={"ssd_draft_len": 4, "ssd_fan_out_budget": 20}),
        ["feeds 85 tokens, more than engine.max_tree_size (64)", "lower the budget or raise the limit"]),
    "unknown decoding field": (lambda d: d.update(decoding={"fan_out": 3}), ["decoding.fan_out", "not a known field"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_recipe_is_one_clear_message(checkpoints, tmp_path, case):
    data = good(checkpoints, tmp_path)
    mutate, expected = CASES[case]
    mutate(data)
    result = run_build(recipe(tmp_path, data))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    for fragment in expected:
        assert fragment in result.stderr, result.stderr


def test_vocabulary_mismatch_is_refused(checkpoints, tmp_path):
    data = good(checkpoints, tmp_path)
    data["draft"]["source"] = str(checkpoints[1])
    result = run_build(recipe(tmp_path, data))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "different vocabularies" in result.stderr


@pytest.mark.parametrize("text", ["just a string", "name: [unclosed", ""])
def test_malformed_yaml_is_one_clear_message(tmp_path, text):
    result = run_build(recipe(tmp_path, text))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "recipe" in result.stderr


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_empty_recipe_says_it_is_empty(tmp_path, text):
    result = run_build(recipe(tmp_path, text))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "is empty" in result.stderr and "NoneType" not in result.stderr, result.stderr


def test_missing_recipe_file(tmp_path):
    result = run_build(tmp_path / "absent.yaml")
    assert result.returncode == 2 and "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_a_bad_recipe_is_told_before_torch_is_imported(tmp_path):
    """The runtime and the build CLI import torch, transformers and onnx only when they build or run a model, so a
    mistyped recipe (or ``import ssd_trt`` in a client) answers at once rather than after seconds of imports."""
    path = recipe(tmp_path, "name: t\n")
    probe = ("import sys, ssd_trt, ssd_trt.build, ssd_trt.serve.triton.client; "
             f"code = ssd_trt.build.main([{str(path)!r}]); "
             "print(code, sorted(m for m in ('torch', 'transformers', 'onnx') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.stdout.split("\n")[-2] == "2 []", (result.stdout, result.stderr[-2000:])
    assert "field 'target'" in result.stderr
