"""Shared fixtures. Tiny random-weight pairs are built once per session through the real build."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import perturbed, random_decoder, save_hf_checkpoint, tiny_config, write_recipe

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_pairs(tmp_path_factory) -> dict[str, Path]:
    """Build dirs for three random-weight pairs: draft == target, a perturbed copy, an unrelated model."""
    from ssd_trt.build import build

    root = tmp_path_factory.mktemp("tiny")
    target = random_decoder(tiny_config(), seed=0)
    drafts = {"self": target, "perturbed": perturbed(target, seed=1, amount=0.05),
              "unrelated": random_decoder(tiny_config(layers=1, hidden=32), seed=2)}
    target_dir = save_hf_checkpoint(target, root / "target")
    builds = {}
    for name, draft in drafts.items():
        draft_dir = target_dir if draft is target else save_hf_checkpoint(draft, root / f"draft-{name}")
        recipe = write_recipe(root / f"{name}.yaml", target_dir, draft_dir, name=f"tiny-{name}")
        builds[name] = build(recipe, root=root)
    return builds


def _built(recipe: str) -> Path:
    """A shipped recipe's build dir, built here if missing or stale (a few minutes on 2 cores)."""
    subprocess.run([sys.executable, "-m", "ssd_trt.build", str(ROOT / "recipes" / recipe), "--if-stale"],
                   cwd=ROOT, check=True)
    return ROOT / "build" / Path(recipe).stem


@pytest.fixture(scope="session")
def smollm2_build() -> Path:
    """The embedded default: the GGUF's 4-bit blocks in the graph, int8 activations."""
    return _built("smollm2-135m.yaml")


@pytest.fixture(scope="session")
def smollm2_fp32_build() -> Path:
    """The embedded pair with fp32 weights and activations: the transformers-parity reference."""
    return _built("smollm2-135m-fp32.yaml")
