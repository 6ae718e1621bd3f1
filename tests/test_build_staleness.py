"""`python -m ssd_trt.build --if-stale`: a build dir is reused only while it matches the recipe and
the model files it was built from (a retrained draft or an edited recipe always triggers a rebuild)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ssd_trt.build import build, stale_reason
from tests.helpers import random_decoder, save_hf_checkpoint, tiny_config, write_recipe

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def tiny_build(tmp_path):
    target = save_hf_checkpoint(random_decoder(tiny_config(), seed=0), tmp_path / "target")
    draft = save_hf_checkpoint(random_decoder(tiny_config(layers=1), seed=1), tmp_path / "draft")
    recipe = write_recipe(tmp_path / "tiny.yaml", target, draft, name="tiny-stale")
    return recipe, build(recipe, root=tmp_path), draft, target


def test_fresh_build_is_current_and_records_source_fingerprints(tiny_build):
    recipe, out, _, _ = tiny_build
    assert stale_reason(recipe, root=recipe.parent) is None
    models = json.loads((out / "manifest.json").read_text())["models"]
    assert all(len(models[role]["source_sha256"]) == 64 for role in ("target", "draft"))


def test_changed_draft_weights_make_the_build_stale(tiny_build):
    recipe, _, draft, _ = tiny_build
    save_hf_checkpoint(random_decoder(tiny_config(layers=1), seed=2), draft)   # "retrained" draft
    reason = stale_reason(recipe, root=recipe.parent)
    assert reason is not None and "draft model files changed" in reason


def test_a_model_card_next_to_the_weights_does_not_make_it_stale(tiny_build):
    recipe, _, draft, _ = tiny_build
    (draft / "README.md").write_text("# model card, edited\n")
    assert stale_reason(recipe, root=recipe.parent) is None


def test_edited_recipe_makes_the_build_stale(tiny_build):
    recipe, _, draft, target = tiny_build
    write_recipe(recipe, target, draft, name="tiny-stale", max_batch=2)
    reason = stale_reason(recipe, root=recipe.parent)
    assert reason is not None and "different version of recipe" in reason


def test_missing_build_is_stale_and_cli_rebuilds_only_when_needed(tiny_build):
    recipe, out, draft, _ = tiny_build
    cmd = [sys.executable, "-m", "ssd_trt.build", str(recipe), "--if-stale"]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0 and "up to date" in first.stdout, first.stderr
    save_hf_checkpoint(random_decoder(tiny_config(layers=1), seed=3), draft)
    second = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0 and "rebuilding: the draft model files changed" in second.stderr
    assert stale_reason(recipe, root=recipe.parent) is None
    (out / "manifest.json").unlink()
    assert "unfinished build" in stale_reason(recipe, root=recipe.parent)


def test_first_build_says_it_is_the_first_not_a_rebuild(tmp_path):
    target = save_hf_checkpoint(random_decoder(tiny_config(), seed=0), tmp_path / "target")
    recipe = write_recipe(tmp_path / "tiny.yaml", target, target, name="tiny-first")
    cmd = [sys.executable, "-m", "ssd_trt.build", str(recipe), "--if-stale"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "first build of this recipe" in result.stderr and "rebuilding" not in result.stderr, result.stderr
    assert "Warning" not in result.stderr and "warn" not in result.stderr.lower(), result.stderr
    summary = result.stdout
    assert "logits vs transformers AutoModelForCausalLM: max |diff|" in summary and "None" not in summary, summary
