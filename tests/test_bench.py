"""`python -m ssd_trt.bench`: presets x settings, tuning on a split it does not report, results.json and plots."""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# run first in a child Python, every `import matplotlib` after it fails as if matplotlib were not installed
NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; "


def prompts_file(path: Path, words: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"{path.stem}-{i}", "category": "prose", "prompt": w}) + "\n"
                            for i, w in enumerate(words)))
    return path


def bench(build: Path, tmp_path: Path, measured: Path, tuning: Path, *extra: str,
          launch: tuple[str, ...] = ("-m", "ssd_trt.bench")) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *launch, str(build), "--prompts", str(measured),
                           "--tuning-prompts", str(tuning), "--settings", "paper", "--baselines", "none",
                           "--max-new-tokens", "6", "--sd-k", "1,2", "--ssd-k", "1,2", "--ssd-budget", "2,3",
                           "--sweep-prompts", "1", "--out", str(tmp_path / "out"), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_bench_reports_every_preset_tunes_on_the_tuning_split_and_plots(tiny_pairs, tmp_path):
    measured = prompts_file(tmp_path / "measured.jsonl", ["w1 w2 w3", "w4 w5 w6"])
    tuning = prompts_file(tmp_path / "tuning.jsonl", ["w7 w8 w9"])
    result = bench(tiny_pairs["perturbed"], tmp_path, measured, tuning, "--sampling", "greedy,t1-k50")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert report["config"]["tuning_prompts"] == 1 and report["config"]["prompts"] == 2
    assert set(report["presets"]) == {"greedy", "t1-k50"}
    assert report["presets"]["t1-k50"]["params"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 50}
    for name, preset in report["presets"].items():
        outcome = preset["settings"]["paper-style"]
        summary = outcome["summary"]
        assert set(summary) == {"ar", "sd", "ssd"}
        assert [p["value"] for p in outcome["sweeps"]["sd: K"]] == [1, 2]          # swept ...
        assert outcome["chosen"]["sd_k"] in (1, 2) and outcome["chosen"]["ssd_k"] in (1, 2)
        # ... and SSD's K and budget jointly: every pair, a budget below K+1 as it is (K 1,2 x budget 2,3 -> 4 pairs)
        grid = outcome["sweeps"]["ssd: K x fan-out budget"]
        assert [p["value"] for p in grid] == [[1, 2], [1, 3], [2, 2], [2, 3]]
        best = max(grid, key=lambda p: p["tokens_per_s"])["value"]
        assert [outcome["chosen"]["ssd_k"], outcome["chosen"]["ssd_budget"]] == best
        for mode in ("sd", "ssd"):
            assert summary[mode]["prompts"] == 2 and summary[mode]["mean_accepted"] is not None
            assert summary[mode]["draft_latency_s"] > 0 and summary[mode]["verify_latency_s"] > 0
        assert summary["ssd"]["cache_hit_rate"] is not None
        for mode in ("sd", "ssd"):   # the rounds alone (after the first token) against the same ceiling
            s = summary[mode]
            assert s["decode_tokens_per_s"] > 0 and s["ceiling_fraction"] > 0
            assert s["decode_ceiling_fraction"] == pytest.approx(s["decode_tokens_per_s"] / s["ceiling_tokens_per_s"])
        # exactness against AR is reported at T = 0 only (sampled modes draw from other random streams)
        assert all(s["exact_prompts"] == (2 if name == "greedy" else None) for s in summary.values())
        for plot in ("tokens_per_category", "ssd_timeline", "sweeps"):
            assert (tmp_path / "out" / f"{plot}_{name}_paper-style.png").read_bytes()[:4] == b"\x89PNG"
    assert "t1-k50, paper-style" in result.stdout and "exact" in result.stdout
    # the published tables are rendered from results.json, never typed
    rendered = subprocess.run([sys.executable, "-m", "ssd_trt.bench.report", str(tmp_path / "out" / "results.json")],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    assert "**greedy — paper-style**" in rendered.stdout and "**T=1, top-k 50 — paper-style**" in rendered.stdout
    ssd_row = next(line for line in rendered.stdout.splitlines() if line.startswith("| ssd |"))
    assert f"{report['presets']['greedy']['settings']['paper-style']['summary']['ssd']['tokens_per_s']:.1f}" in ssd_row
    assert all(s.get("two_token_latency_s", 0) > 0 for s in
               report["presets"]["greedy"]["settings"]["paper-style"]["summary"].values())


def test_bench_refuses_to_tune_on_the_prompts_it_reports(tiny_pairs, tmp_path):
    measured = prompts_file(tmp_path / "measured.jsonl", ["w1 w2 w3", "w4 w5 w6"])
    result = bench(tiny_pairs["perturbed"], tmp_path, measured, measured)
    assert result.returncode == 2 and "disjoint" in result.stderr and "Traceback" not in result.stderr
    result = bench(tiny_pairs["perturbed"], tmp_path, measured, prompts_file(tmp_path / "t.jsonl", ["w9"]),
                   "--sampling", "nucleus")
    assert result.returncode == 2 and "unknown --sampling preset" in result.stderr


def test_other_builds_of_the_same_target_run_ar_side_by_side(tiny_pairs, tmp_path):
    """--ar-builds adds a build's AR as a row with its agreement with this build's AR; a build of another
    target is refused before any work."""
    measured = prompts_file(tmp_path / "measured.jsonl", ["w1 w2 w3", "w4 w5 w6"])
    tuning = prompts_file(tmp_path / "tuning.jsonl", ["w7 w8 w9"])
    result = bench(tiny_pairs["perturbed"], tmp_path, measured, tuning, "--modes", "ar",
                   "--ar-builds", f"ar_self={tiny_pairs['self']}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "results.json").read_text())["presets"]["greedy"]["settings"][
        "paper-style"]["summary"]
    assert set(summary) == {"ar", "ar_self"}
    # the same target file, the same fp32 kernels: identical text
    assert summary["ar_self"]["agreement_with_ar"] == {"identical_prompts": 2, "prompts": 2,
                                                        "mean_agreeing_prefix": 1.0}
    from ssd_trt.build import build
    from tests.helpers import random_decoder, save_hf_checkpoint, tiny_config, write_recipe
    other_target = save_hf_checkpoint(random_decoder(tiny_config(), seed=3), tmp_path / "other-target")
    other = build(write_recipe(tmp_path / "other.yaml", other_target, other_target, name="tiny-other"), root=tmp_path)
    refused = bench(tiny_pairs["perturbed"], tmp_path, measured, tuning, "--ar-builds", f"other={other}")
    assert refused.returncode == 2 and "is built from another target" in refused.stderr, refused.stderr[-2000:]


def test_matplotlib_is_an_optional_extra_only_the_plots_module_needs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("matplotlib")]
    assert [d for d in project["optional-dependencies"]["plots"] if d.startswith("matplotlib")]
    # every module of the package imports without it, except the plots themselves
    probe = NO_MATPLOTLIB + """
import importlib, pkgutil, ssd_trt
for module in pkgutil.walk_packages(ssd_trt.__path__, "ssd_trt."):
    if module.name != "ssd_trt.__main__":      # the command-line dispatcher runs when imported
        try:
            importlib.import_module(module.name)
        except ImportError as error:
            if "matplotlib" in str(error):
                print(module.name)
"""
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ssd_trt.bench.plots"]


def test_without_matplotlib_the_bench_measures_and_says_the_plots_need_the_extra(tiny_pairs, tmp_path):
    measured = prompts_file(tmp_path / "measured.jsonl", ["w1 w2 w3"])
    tuning = prompts_file(tmp_path / "tuning.jsonl", ["w7 w8 w9"])
    result = bench(tiny_pairs["perturbed"], tmp_path, measured, tuning, "--sampling", "greedy",
                   launch=("-c", NO_MATPLOTLIB + "from ssd_trt.bench.__main__ import main; sys.exit(main())"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines() if "pip install -e '.[plots]'" in line] == \
        ["ssd_trt.bench: matplotlib is not installed, so no plots (pip install -e '.[plots]')"]
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(report["presets"]["greedy"]["settings"]["paper-style"]["summary"]) == {"ar", "sd", "ssd"}
    assert not list((tmp_path / "out").glob("*.png"))
    assert "and plots" not in result.stdout


def test_interleaved_runs_alternate_the_modes_and_report_each_runs_ratio_to_ar(tiny_pairs, tmp_path):
    measured = prompts_file(tmp_path / "measured.jsonl", ["w1 w2 w3", "w4 w5 w6"])
    tuning = prompts_file(tmp_path / "tuning.jsonl", ["w7 w8 w9"])
    out = tmp_path / "interleaved.json"
    result = subprocess.run([sys.executable, "-m", "ssd_trt.bench.interleaved", str(tiny_pairs["perturbed"]),
                             "--prompts", str(measured), "--tuning-prompts", str(tuning), "--modes", "ar,sd,ssd",
                             "--sampling", "greedy,t1-k50", "--runs", "3", "--max-new-tokens", "6", "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["prompts"] == 2 and set(report["presets"]) == {"greedy", "t1-k50"}
    categories = {json.loads(line).get("category", "default") for line in measured.read_text().splitlines()}
    for preset in report["presets"].values():
        runs = preset["runs"]
        assert [r["order"] for r in runs] == [["ar", "sd", "ssd"], ["ssd", "sd", "ar"], ["ar", "sd", "ssd"]]
        for run in runs:
            assert run["vs_ar"] == {m: pytest.approx(run["tokens_per_s"][m] / run["tokens_per_s"]["ar"])
                                    for m in ("sd", "ssd")}
        assert preset["median_vs_ar"]["ssd"] == pytest.approx(sorted(r["vs_ar"]["ssd"] for r in runs)[1])
        for run in runs:       # each category's rates come from its own prompts (one a category here)
            assert set(run["by_category"]) == categories and all(
                set(rates) == {"ar", "sd", "ssd"} for rates in run["by_category"].values())
    assert out.with_suffix(".png").is_file()
    assert "| greedy |" in result.stdout


def test_interleaved_modes_name_a_default_mode_or_a_hand_picked_setting_and_nothing_else():
    from ssd_trt.bench.interleaved import mode_settings, parse
    from ssd_trt.decoding.settings import SD, SSD
    assert mode_settings("ssd") == SSD() and mode_settings("sd") == SD()
    assert mode_settings("ssd-k2-b1") == SSD(draft_len=2, fan_out_budget=1)
    assert mode_settings("sd-k3") == SD(draft_len=3)
    for wrong in ("ssd-k2", "sd-k2-b1", "ssd-2-1", "tree"):
        assert mode_settings(wrong) is None, wrong
    assert parse(["b", "--modes", "ar,ssd,ssd-k2-b1,sd-k2"]).modes == ["ar", "ssd", "ssd-k2-b1", "sd-k2"]
    with pytest.raises(SystemExit):
        parse(["b", "--modes", "ar,ssd-k2"])


def test_a_round_whose_speculating_rows_had_finished_leaves_no_timeline_entry():
    """``python -m ssd_trt.bench`` died in the speed model (IndexError on an empty ``source``) when an SSD round ran
    with its only speculating row already finished: such a round has nothing to plot."""
    from types import SimpleNamespace

    from ssd_trt.batching.metrics import EngineMetrics
    from ssd_trt.bench.speed_model import predicted_speedup
    from ssd_trt.decoding.round import RoundReport, RowResult

    speculation = SimpleNamespace(started=0.1, finished=0.4)
    metrics = EngineMetrics()
    finished = RoundReport(rows=[None], started=0.0, verify=(0.1, 0.5), collected=0.5, settled=0.5, width=2,
                           alone=False, speculations=[speculation], ssd_rows=[0])
    metrics.record([SimpleNamespace()], finished, origin=0.0)
    assert metrics.timeline == []
    live = RoundReport(rows=[RowResult([5, 6], "primary", 1, 1)], started=1.0, verify=(1.1, 1.5), collected=1.5,
                       settled=1.5, width=2, alone=False, speculations=[speculation], ssd_rows=[0])
    metrics.record([SimpleNamespace(stats=SimpleNamespace(record_round=lambda accepted: None))], live, origin=0.0)
    assert [entry["source"] for entry in metrics.timeline] == [["primary"]]
    model = predicted_speedup([SimpleNamespace(stats={"timeline": metrics.timeline})], ar_tokens_per_s=50.0)
    assert model["p_hit"] == 1.0 and model["E_hit"] == 2.0
