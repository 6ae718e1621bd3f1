"""``python -m ssd_trt.tune``: decoding defaults chosen by measurement, recorded in the manifest, used per regime."""
from __future__ import annotations

import shutil
import sys

import ssd_trt
from ssd_trt.manifest import TunedDecoding, read_manifest, write_manifest
from ssd_trt.recipe import DecodingDefaults
from ssd_trt.tune import grid, main as tune_main

GREEDY = ssd_trt.SamplingParams(max_new_tokens=4)
SAMPLED = ssd_trt.SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9)


def _copy(build, tmp_path):
    out = tmp_path / "build"
    shutil.copytree(build, out)
    return out


def test_tune_records_the_fastest_measured_point_per_regime(tiny_pairs, tmp_path, capsys):
    build = _copy(tiny_pairs["perturbed"], tmp_path)
    assert read_manifest(build).tuned_decoding is None
    assert tune_main([str(build), "--prompts", "1", "--max-new-tokens", "6", "--rounds", "1", "--sd-k", "1,2",
                      "--ssd-k", "1,2", "--ssd-budget", "3,4"]) == 0
    tuned = read_manifest(build).tuned_decoding
    for regime in ("greedy", "sampled"):
        m = tuned.measurement[regime]
        points = {(p["mode"], p["draft_len"], p["fan_out_budget"]): p["tokens_per_s"] for p in m["points"]}
        assert set(points) == {("ar", None, None), ("sd", 1, None), ("sd", 2, None), ("ssd", 1, 3), ("ssd", 1, 4),
                               ("ssd", 2, 3), ("ssd", 2, 4)}
        chosen = getattr(tuned, regime)
        # the winners are the measured maxima, not defaults carried over
        assert points[("sd", chosen.sd_draft_len, None)] == max(v for k, v in points.items() if k[0] == "sd")
        assert points[("ssd", chosen.ssd_draft_len, chosen.ssd_fan_out_budget)] == \
            max(v for k, v in points.items() if k[0] == "ssd")
    assert "recorded in" in capsys.readouterr().out
    assert (build / "tuning.png").read_bytes()[:4] == b"\x89PNG"     # every point, plotted
    # --if-missing leaves a tuned build alone
    assert tune_main([str(build), "--if-missing"]) == 0
    assert read_manifest(build).tuned_decoding == tuned


def test_requests_get_their_regimes_tuned_defaults_unless_they_set_k(tiny_pairs, tmp_path):
    build = _copy(tiny_pairs["perturbed"], tmp_path)
    manifest = read_manifest(build)
    recipe_default = manifest.recipe.decoding
    tuned = TunedDecoding(greedy=DecodingDefaults(sd_draft_len=2, ssd_draft_len=1, ssd_fan_out_budget=5),
                          sampled=DecodingDefaults(sd_draft_len=1, ssd_draft_len=3, ssd_fan_out_budget=4),
                          measurement={})
    write_manifest(build, manifest.model_copy(update={"tuned_decoding": tuned}))
    gen = ssd_trt.load(build)
    assert gen.resolve("sd", GREEDY).settings.draft_len == 2 and gen.resolve("sd", SAMPLED).settings.draft_len == 1
    assert (gen.resolve("ssd", GREEDY).settings.draft_len, gen.resolve("ssd", GREEDY).settings.fan_out_budget) == (1, 5)
    assert (gen.resolve("ssd", SAMPLED).settings.draft_len, gen.resolve("ssd", SAMPLED).settings.fan_out_budget) == (3, 4)
    # a request's stats say what ran
    [result] = gen.generate("w1 w2", SAMPLED, mode="ssd")
    assert result.stats["draft_len"] == 3
    # the caller's K wins over any default
    own = ssd_trt.SD(draft_len=4)
    assert gen.resolve(own, GREEDY).settings.draft_len == 4 and gen.resolve(own, SAMPLED).settings.draft_len == 4
    # an untuned build uses the recipe's decoding
    untuned = ssd_trt.load(tiny_pairs["perturbed"])
    assert untuned.resolve("sd", SAMPLED).settings.draft_len == recipe_default.sd_draft_len


def test_the_grid_stays_within_the_engine_limits(tiny_pairs):
    limits = read_manifest(tiny_pairs["perturbed"]).recipe.engine
    points = grid([1, 2, limits.max_draft_len + 1], [1, 2], [2, 4, 10_000], limits)
    assert ("sd", limits.max_draft_len + 1) not in points and ("ar",) in points
    # budgets below K+1 stay as they are (an unlikely outcome may go to the backup); trees larger than the engine
    # allows are left out
    assert ("ssd", 2, 2) in points and ("ssd", 2, 4) in points
    assert not any(p[0] == "ssd" and p[2] == 10_000 for p in points)


def test_without_matplotlib_tune_records_its_choice_and_says_the_plot_needs_the_extra(tiny_pairs, tmp_path, capsys,
                                                                                      monkeypatch):
    build = _copy(tiny_pairs["perturbed"], tmp_path)
    (build / "tuning.png").write_bytes(b"an earlier tuning's plot")
    monkeypatch.setitem(sys.modules, "matplotlib", None)            # `import matplotlib` now fails
    monkeypatch.delitem(sys.modules, "ssd_trt.bench.plots", raising=False)
    assert tune_main([str(build), "--prompts", "1", "--max-new-tokens", "4", "--rounds", "1", "--sd-k", "1",
                      "--ssd-k", "1", "--ssd-budget", "2"]) == 0
    assert read_manifest(build).tuned_decoding is not None
    assert not (build / "tuning.png").exists()                     # no plot, and not the earlier one either
    assert "no plot: matplotlib is not installed (pip install -e '.[plots]')" in capsys.readouterr().out
