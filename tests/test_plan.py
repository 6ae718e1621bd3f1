"""``python -m ssd_trt.build RECIPE --plan``: every GPU's memory from the recipe and the models' config.json alone,
the verdict, and the recipe changes that would fit -- checked on the paper's pairs (their real configs, in
tests/data/configs) and on a tiny config counted by hand."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from ssd_trt.build import main as build_main
from ssd_trt.models.config import DecoderConfig
from ssd_trt.models.sharding import rank_split
from ssd_trt.recipe import load_recipe
from ssd_trt.sizing.advice import suggestions
from ssd_trt.sizing.configs import model_configs
from ssd_trt.sizing.fit import plan_fit, with_engine
from ssd_trt.sizing.formats import INT4_BYTES, engine_formats
from ssd_trt.sizing.memory import GIB, kv_cache_bytes, weight_bytes
from ssd_trt.sizing.report import render
from ssd_trt.sizing.shards import rank_params

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "data" / "configs"
LLAMA_70B = ROOT / "recipes" / "gpu" / "llama31-70b_llama32-1b.yaml"
GPU_RECIPES = [ROOT / "recipes" / "gpu" / name for name in
               ("llama31-70b_llama32-1b.yaml", "llama31-8b_llama32-1b.yaml", "qwen3-32b_qwen3-0.6b.yaml")]
# docs/bench artifact -> (recipes, --tensor-parallel override)
ARTIFACTS = {"plan_gpu_recipes.json": (GPU_RECIPES, None), "plan_gpu_recipes_tp1.json": (GPU_RECIPES[::2], 1)}
H100 = 80 * GIB


def tiny(**changes) -> DecoderConfig:
    config = DecoderConfig(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                           max_position_embeddings=1024, tie_word_embeddings=False)
    return replace(config, **changes)


def write_recipe(tmp_path: Path, **engine) -> Path:
    data = yaml.safe_load(LLAMA_70B.read_text())
    data["engine"].update(engine)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def llama_70b():
    recipe = load_recipe(LLAMA_70B)
    return recipe, model_configs(recipe, LLAMA_70B, CONFIGS)


def test_the_70b_pair_fits_80_gib_gpus_at_4_ranks_and_at_1_rank_suggests_4(llama_70b):
    recipe, models = llama_70b
    assert recipe.engine.tensor_parallel == 4
    plan = plan_fit(recipe, models, H100)
    assert plan.fits and [d.device for d in plan.devices] == [f"GPU {n}" for n in range(5)]
    assert [d.role for d in plan.devices] == ["target"] * 4 + ["draft"]
    whole = plan_fit(with_engine(recipe, tensor_parallel=1), models, H100)
    assert not whole.fits and not whole.role_fits("target") and whole.role_fits("draft")
    assert whole.devices[0].weights > 130 * GIB            # 70.6B parameters in bf16
    advice = {s.change: s for s in suggestions(whole)}
    assert advice["engine.tensor_parallel"].value == 4      # 2 is too few, 3 does not divide 64 heads
    assert advice["engine.tensor_parallel"].peak_bytes == plan.peak
    assert advice["engine.max_batch"].value is None         # nothing at one GPU holds 141 GB of weights


def test_a_ranks_weight_bytes_are_the_hand_count_of_a_tiny_config():
    split = rank_split(tiny(), 2)
    # per layer on a rank: q 64x32, k 64x16, v 64x16, o 32x64, gate 64x64, up 64x64, down 64x64 = 18432; two layers
    linear, small, embedding, head = 2 * 18432, 2 * 2 * 64 + 64, 100 * 64, 100 * 64
    params = rank_params(split)
    assert (params.linear, params.small, params.embedding, params.head) == (linear, small, embedding, head)
    recipe = load_recipe(LLAMA_70B)                         # TensorRT bf16: 2 bytes everything
    assert weight_bytes(params, engine_formats(recipe, "target")) == 2 * (linear + small + embedding + head)
    ort = with_engine(recipe, backend="ort")                # int4 blocks: 0.5 byte + an fp32 scale per 32
    assert INT4_BYTES == 0.625
    assert weight_bytes(params, engine_formats(ort, "target")) == 0.625 * (linear + head) + 4 * (small + embedding)


def test_one_rank_counts_the_parameters_the_decoder_has():
    import torch

    from ssd_trt.models.decoder import Decoder
    for config in (tiny(), tiny(tie_word_embeddings=True), tiny(model_type="qwen2", attention_bias=True),
                   tiny(model_type="qwen3", qk_norm=True)):
        with torch.device("meta"):
            decoder = Decoder(config)
        assert rank_params(rank_split(config, 1)).total == sum(p.numel() for p in decoder.parameters()), config


def test_kv_heads_fewer_than_ranks_are_replicated_one_a_rank(llama_70b):
    recipe, models = llama_70b
    config = models["target"].config                        # 8 KV heads
    formats = engine_formats(recipe, "target")
    for ranks, kv_heads, replicas in ((4, 2, 1), (8, 1, 1), (16, 1, 2), (64, 1, 8)):
        split = rank_split(config, ranks)
        assert (split.kv_heads, split.kv_replicas) == (kv_heads, replicas)
        e = recipe.engine
        assert kv_cache_bytes(split, recipe, formats) == e.max_batch * (e.max_context + 1) * 80 * kv_heads * 128 * 2 * 2
    assert kv_cache_bytes(rank_split(config, 16), recipe, formats) == kv_cache_bytes(rank_split(config, 8), recipe,
                                                                                     formats)


def test_a_tensor_parallel_that_does_not_split_the_heads_exits_2_naming_the_values_that_do(tmp_path, capsys):
    code = build_main([str(write_recipe(tmp_path, tensor_parallel=3)), "--plan", "--configs", str(CONFIGS)])
    error = capsys.readouterr().err
    assert code == 2
    assert "engine.tensor_parallel: 3 cannot split the target" in error and "64 attention heads" in error
    assert "[1, 2, 4, 8, 16, 32, 64]" in error and "Traceback" not in error


def test_exit_status_0_fits_1_does_not_2_bad_recipe_or_config(tmp_path, capsys):
    assert build_main([str(LLAMA_70B), "--plan", "--configs", str(CONFIGS)]) == 0
    assert "#### llama31-70b_llama32-1b: fits" in capsys.readouterr().out
    assert build_main([str(LLAMA_70B), "--plan", "--configs", str(CONFIGS), "--gpu-memory", "40"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "engine.tensor_parallel: 8 (9 GPUs with the draft's)" in out
    assert build_main([str(tmp_path / "missing.yaml"), "--plan"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert build_main([str(LLAMA_70B), "--plan"]) == 2           # /models/... is not here, no --configs
    assert "pass --configs DIR" in capsys.readouterr().err
    broken = tmp_path / "configs" / "Llama-3.1-70B-Instruct"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8192}))
    assert build_main([str(LLAMA_70B), "--plan", "--configs", str(tmp_path / "configs")]) == 2
    assert "does not describe a supported decoder (missing key 'num_attention_heads')" in capsys.readouterr().err


def test_plan_reads_no_weights_and_builds_nothing_from_the_command_line(tmp_path):
    recipe = write_recipe(tmp_path, tensor_parallel=4)
    done = subprocess.run([sys.executable, "-m", "ssd_trt.build", str(recipe), "--plan", "--json", "--configs",
                           str(CONFIGS)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)["plans"][0]
    assert plan["fits"] and len(plan["devices"]) == 5
    assert list(tmp_path.iterdir()) == [recipe]                  # no build/ directory


@pytest.mark.parametrize("artifact", sorted(ARTIFACTS))
def test_the_saved_plans_are_what_the_code_plans_now(artifact, monkeypatch, capsys):
    from ssd_trt.sizing.cli import run
    recipes, tensor_parallel = ARTIFACTS[artifact]
    monkeypatch.chdir(ROOT)                                      # the artifact names the configs relative to it
    code = run([r.relative_to(ROOT) for r in recipes], None, Path("tests/data/configs"), as_json=True,
               tensor_parallel=tensor_parallel)
    saved = json.loads((ROOT / "docs" / "bench" / artifact).read_text())
    assert json.loads(capsys.readouterr().out) == saved, f"regenerate docs/bench/{artifact} (docs/tensor_parallel.md)"
    assert code == (0 if all(plan["fits"] for plan in saved["plans"]) else 1)


def test_the_docs_tables_are_the_rendering_of_the_saved_plans():
    page = (ROOT / "docs" / "tensor_parallel.md").read_text()
    for artifact in ARTIFACTS:
        assert f"bench/{artifact}" in page
        for plan in json.loads((ROOT / "docs" / "bench" / artifact).read_text())["plans"]:
            missing = [line for line in render(plan).splitlines() if line.strip() and line not in page]
            assert not missing, f"docs/tensor_parallel.md lacks lines of {artifact}'s {plan['recipe']}: {missing[:2]}"
