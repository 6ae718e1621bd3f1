"""research/eagle3/draft_frontier.py reads the three measurements each size has (the formats the measuring
scripts write: the shipped head's own artifacts in docs/bench) and reports, per mode, the size it is fastest
with."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "research" / "eagle3" / "draft_frontier.py"
BENCH = ROOT / "docs" / "bench"


def test_the_frontier_reads_each_sizes_measurements_and_picks_the_fastest_per_mode(tmp_path):
    out = tmp_path / "out"
    sizes = {"stage 1": ("eagle3_agreement_stage1.json", "eagle3_stage1_results.json"),
             "stage 2": ("eagle3_agreement_stage2.json", "eagle3_stage2_results.json")}
    command = [sys.executable, str(SCRIPT), "--out", str(out)]
    for label, (agreement, results) in sizes.items():
        command += ["--size", label, str(BENCH / agreement), str(BENCH / "eagle3_draft_cost.txt"), str(BENCH / results)]
    subprocess.run(command, check=True, capture_output=True)
    report = json.loads((out / "frontier.json").read_text())
    rows = {r["size"]: r for r in report["sizes"]}
    measured = json.loads((BENCH / "eagle3_agreement_stage2.json").read_text())["agreement"]
    assert rows["stage 2"]["agreement_chat"] == measured["chat"]["first_token_agreement"]
    assert rows["stage 2"]["cost_ratio"] == 0.103              # the 'fresh context' line
    bench = json.loads((BENCH / "eagle3_stage2_results.json").read_text())["presets"]["greedy"]["settings"]
    paper = rows["stage 2"]["bench"]["paper-style"]
    assert paper["ssd"]["tokens_per_s"] == bench["paper-style"]["summary"]["ssd"]["tokens_per_s"]
    assert paper["chosen"] == bench["paper-style"]["chosen"]
    for key, size in report["fastest_size"].items():
        mode, setting = key.split(" ")
        assert rows[size]["bench"][setting][mode]["speedup_vs_ar"] == \
            max(r["bench"][setting][mode]["speedup_vs_ar"] for r in rows.values())
    assert (out / "frontier.png").stat().st_size > 10_000


def test_a_cost_file_without_a_measurement_is_refused(tmp_path):
    bad = tmp_path / "draft_cost.txt"
    bad.write_text("nothing measured\n")
    with pytest.raises(ValueError, match="no 'CONTEXT context"):
        load_script(SCRIPT).draft_cost(bad)
