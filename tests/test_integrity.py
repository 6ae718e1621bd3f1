"""Artifact integrity: a build directory that is not exactly what its manifest describes is refused at
load time with one message naming the file and the fix; a build never mixes two recipes' artifacts.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ssd_trt
from ssd_trt.build import prepare_output_dir
from ssd_trt.errors import ArtifactError, RecipeError
from ssd_trt.manifest import SCHEMA_VERSION, artifact_entry
from ssd_trt.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def build(tiny_pairs, tmp_path) -> Path:
    """A private copy of the perturbed pair's build (target and draft differ, same file sizes)."""
    return Path(shutil.copytree(tiny_pairs["perturbed"], tmp_path / "build"))


def edit_manifest(build: Path, change) -> None:
    path = build / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def swap(a: Path, b: Path) -> None:
    tmp = a.with_suffix(".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def add_plan(build: Path, role: str) -> Path:
    """A stand-in TensorRT engine listed in the manifest, as a GPU build writes it."""
    plan = build / role / "engine.plan"
    plan.write_bytes(b"serialized-engine" * 64)
    edit_manifest(build, lambda m: m["artifacts"].append({"role": role, "flavour": "engine",
                                                          **artifact_entry(build, plan)}))
    return plan


# (how to damage the build, the file the message must name, what it must say)
DAMAGE = {
    "truncated target ONNX": (lambda b: truncate(b / "target/model.ort.onnx"), "target/model.ort.onnx",
                              "(truncated or replaced)"),
    "truncated draft weights": (lambda b: truncate(b / "draft/weights.bin"), "draft/weights.bin", "truncated"),
    "edited target ONNX": (lambda b: flip_byte(b / "target/model.ort.onnx"), "target/model.ort.onnx",
                           "does not match its sha256"),
    "edited target weights": (lambda b: flip_byte(b / "target/weights.bin"), "target/weights.bin", "sha256"),
    "target and draft weights swapped": (lambda b: swap(b / "target/weights.bin", b / "draft/weights.bin"),
                                         "target/weights.bin", "(edited, corrupt or swapped)"),
    "draft ONNX deleted": (lambda b: (b / "draft/model.ort.onnx").unlink(), "draft/model.ort.onnx", "missing"),
    "edited tokenizer": (lambda b: flip_byte(b / "tokenizer/tokenizer.json"), "tokenizer/tokenizer.json", "sha256"),
    "truncated tokenizer config": (lambda b: truncate(b / "tokenizer/tokenizer_config.json"),
                                   "tokenizer/tokenizer_config.json", "truncated"),
    "extra tokenizer file": (lambda b: (b / "tokenizer/special_tokens_map.json").write_text("{}"),
                             "tokenizer/special_tokens_map.json", "not among the manifest's artifacts"),
    "unlisted engine plan": (lambda b: (b / "draft/engine.plan").write_bytes(b"x"), "draft/engine.plan",
                             "left over from another build"),
    "ONNX entry removed from manifest": (
        lambda b: edit_manifest(b, lambda m: m.update(artifacts=[a for a in m["artifacts"]
                                                                 if a["path"] != "target/model.ort.onnx"])),
        "target/model.ort.onnx", "not among the manifest's artifacts"),
    "edited engine plan": (lambda b: flip_byte(add_plan(b, "target")), "target/engine.plan", "sha256"),
    "truncated engine plan": (lambda b: truncate(add_plan(b, "draft")), "draft/engine.plan", "truncated"),
    "manifest from a newer version": (
        lambda b: edit_manifest(b, lambda m: m.update(schema_version=SCHEMA_VERSION + 1)),
        "manifest.json", "written by a newer ssd-trt"),
    "manifest from an older version": (lambda b: edit_manifest(b, lambda m: m.update(schema_version=0)),
                                       "manifest.json", "written by an older ssd-trt (schema version 0"),
    "manifest without version": (lambda b: edit_manifest(b, lambda m: m.pop("schema_version")),
                                 "manifest.json", "schema version None"),
    "manifest not JSON": (lambda b: truncate(b / "manifest.json"), "manifest.json", "is corrupt"),
    "manifest not an object": (lambda b: (b / "manifest.json").write_text("[1, 2]"), "manifest.json",
                               "schema version None"),
    "manifest lacks artifacts": (lambda b: edit_manifest(b, lambda m: m.pop("artifacts")), "manifest.json",
                                 "field 'artifacts': Field required"),
    "manifest entry without sha256": (lambda b: edit_manifest(b, lambda m: m["artifacts"][0].pop("sha256")),
                                      "manifest.json", "field 'artifacts.0.sha256': Field required"),
    "manifest limits edited": (lambda b: edit_manifest(b, lambda m: m["recipe"]["engine"].update(max_batch="4")),
                               "manifest.json", "field 'recipe.engine.max_batch': Input should be a valid integer"),
    "manifest model config removed": (lambda b: edit_manifest(b, lambda m: m["models"].pop("draft")),
                                      "manifest.json", "models lacks ['draft']"),
    "no manifest": (lambda b: (b / "manifest.json").unlink(), "build", "is not an ssd-trt build"),
    "draft vocabulary differs": (
        lambda b: edit_manifest(b, lambda m: m["models"]["draft"]["config"].update(vocab_size=200)),
        "build", "draft vocabulary (200) differs from the target's (256)"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_build_is_refused_naming_the_file_and_the_fix(build, case):
    damage, file, message = DAMAGE[case]
    damage(build)
    with pytest.raises(ArtifactError) as error:
        ssd_trt.load(build)
    text = str(error.value)
    assert str(build / file) in text if file != "build" else str(build) in text, text
    assert message in text, text
    assert "rebuild" in text or "build it with" in text, text


def test_intact_copy_loads_and_generates(build):
    assert ssd_trt.load(build).generate("w5 w6", ssd_trt.SamplingParams(max_new_tokens=3))[0].token_ids


def test_tokenizer_that_cannot_be_parsed_is_refused(build):
    """Even with a matching checksum (a manifest edited to bless it), an unreadable tokenizer is refused."""
    (build / "tokenizer/tokenizer.json").write_text("{not json")
    edit_manifest(build, lambda m: [a.update(artifact_entry(build, build / a["path"]))
                                    for a in m["artifacts"] if a["path"] == "tokenizer/tokenizer.json"])
    with pytest.raises(ArtifactError, match="tokenizer in .* cannot be loaded .*; rebuild"):
        ssd_trt.load(build)


def test_cli_refuses_a_damaged_build_in_one_line(build):
    flip_byte(build / "draft/model.ort.onnx")
    result = subprocess.run([sys.executable, "-m", "ssd_trt.generate", str(build), "--prompt", "w5"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("ssd_trt.generate: error: artifact ") and "draft/model.ort.onnx" in line


# -- building never mixes two recipes' artifacts ----------------------------------------------------
def recipe_named(tmp_path: Path, name: str):
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\ntarget: {{source: a}}\ndraft: {{source: a}}\n")
    return load_recipe(path)


def test_building_into_another_recipes_dir_is_refused(build, tmp_path):
    with pytest.raises(RecipeError, match="holds artifacts of recipe 'tiny-perturbed', not 'other'; choose "
                                          "another output_dir or pass --force"):
        prepare_output_dir(build, recipe_named(tmp_path, "other"), force=False)
    assert (build / "manifest.json").is_file()           # nothing was touched


def test_building_into_a_dir_with_an_unreadable_manifest_is_refused(build, tmp_path):
    (build / "manifest.json").write_text("{broken")
    with pytest.raises(RecipeError, match="'<unreadable manifest>'"):
        prepare_output_dir(build, recipe_named(tmp_path, "tiny-perturbed"), force=False)


def test_force_clears_the_other_recipes_artifacts(build, tmp_path):
    prepare_output_dir(build, recipe_named(tmp_path, "other"), force=True)
    assert [p.name for p in build.iterdir()] == [".building"]      # only the new build's marker
    assert (build / ".building").read_text() == "other"


def test_rebuilding_the_same_recipe_first_withdraws_the_manifest(build, tmp_path):
    prepare_output_dir(build, recipe_named(tmp_path, "tiny-perturbed"), force=False)
    assert not (build / "manifest.json").exists()         # a half-finished rebuild never looks complete
    with pytest.raises(ArtifactError, match="not an ssd-trt build"):
        ssd_trt.load(build)


def test_an_interrupted_build_of_another_recipe_is_not_built_over(build, tmp_path):
    prepare_output_dir(build, recipe_named(tmp_path, "tiny-perturbed"), force=False)   # interrupted here
    with pytest.raises(RecipeError):
        prepare_output_dir(build, recipe_named(tmp_path, "other"), force=False)


def test_leftover_files_of_another_build_are_never_loaded(build, tmp_path):
    """Even when a build dir holds stray files (here: an interrupted build's tokenizer file), loading
    refuses anything the manifest does not list, so two builds can never be silently mixed."""
    (build / "tokenizer/added_tokens.json").write_text('{"<mixed>": 300}')
    with pytest.raises(ArtifactError, match="added_tokens.json is not among the manifest's artifacts"):
        ssd_trt.load(build)
