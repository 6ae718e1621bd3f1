"""research/eagle3/eagle3_gap.py: the feature draft's distance from issue 19's targets, from the repository's own
measurements. The fit, the data it would take and the speed bounds must be the formulas its docstring states,
applied to the numbers in the artifacts (not copies of them)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "research" / "eagle3" / "eagle3_gap.py"


def test_the_log_fit_recovers_a_known_line():
    gap = load_script(SCRIPT)
    positions = [1_000, 5_000, 20_000, 300_000]
    a0, slope = gap.log_fit(positions, [0.1 + 0.04 * math.log(n) for n in positions])
    assert a0 == pytest.approx(0.1) and slope == pytest.approx(0.04)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gap")
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True, capture_output=True)
    assert (out / "agreement_vs_data.png").stat().st_size > 10_000
    return json.loads((out / "gap.json").read_text())


def test_the_gap_reads_every_stage_and_extrapolates_to_the_target(report):
    measured = json.loads((ROOT / "docs/bench/eagle3_agreement.json").read_text())["agreement"]
    stages = report["stages"]
    rates, reachable = report["rates"], report["agreement"]["positions_within_budget"]

    def minutes(positions: float, already: float) -> float:       # new text + features, one training pass
        return (positions - already) / rates["data_positions_per_min"] + positions / rates["train_positions_per_min"]

    assert minutes(reachable["minutes_left"], stages[-1]["train_positions"]) == \
        pytest.approx(report["budget_minutes"] - report["spent_minutes"])
    assert minutes(reachable["whole_budget"], 0) == pytest.approx(report["budget_minutes"])
    assert [s["stage"] for s in stages] == [1, 2, 3, 4]
    assert [s["train_positions"] for s in stages] == sorted(s["train_positions"] for s in stages)
    for prompts, target in (("chat", 0.75), ("plain", 0.65)):
        body = report["agreement"][prompts]
        assert body["measured"] == measured[prompts]["first_token_agreement"]
        for fit in body["fits"].values():
            # the fitted line reaches the target exactly at the positions it says are needed
            at_needed = fit["a0"] + fit["slope_per_ln_positions"] * math.log(fit["positions_needed"])
            assert at_needed == pytest.approx(target)
            assert fit["times_the_data"] == pytest.approx(fit["positions_needed"] / stages[-1]["train_positions"])


def test_the_speed_bounds_follow_from_the_bench(report):
    bench = json.loads((ROOT / "docs/bench/eagle3/results.json").read_text())
    paper = bench["presets"]["greedy"]["settings"]["paper-style"]
    speed = report["speed"]
    k, t_v, t_d = speed["K"], speed["verify_s"], speed["draft_token_s"]
    assert k == paper["chosen"]["ssd_k"] and t_v == paper["speed_model"]["verify_latency_s"]
    assert speed["ssd_vs_sd"]["bound"] == pytest.approx(1 + k * t_d / t_v)
    assert speed["ssd_vs_sd"]["measured"] <= speed["ssd_vs_sd"]["bound"]
    needed = speed["ssd_vs_ar"]["accepted_per_round_needed"]
    a = speed["ssd_vs_ar"]["per_token_agreement_needed"]
    assert sum(a ** i for i in range(1, k + 1)) == pytest.approx(needed)
