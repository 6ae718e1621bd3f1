"""The published pages: the README's results are the benchmark's own rendering of its results file (no number
typed by hand), every relative link in the README and docs/ leads to a file that exists, and every artifact
kept under docs/ is cited by a page."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CARDS = sorted((ROOT / "recipes" / "drafts").glob("*/README.md"))     # model cards cite artifacts too
# a mention of something under docs/bench, from the repository root, from docs/ or through ../: a file, a folder
# (trailing slash) or a glob (`docs/bench/*.png`)
MENTION = re.compile(r"(?<![\w./-])(?:\.\./)*(?:docs/)?(bench/[\w.*/-]*[\w*/])")


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") and re.search(r"\d", line)]


def _report_rows(artifact: str) -> set[str]:
    rendered = subprocess.run([sys.executable, "-m", "ssd_trt.bench.report", str(ROOT / artifact)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    return set(_table_rows(rendered.stdout))


def test_the_readme_results_are_the_report_of_the_benchmark_results_file():
    readme = (ROOT / "README.md").read_text()
    results = readme[readme.index("## Results"):readme.index("## Documentation")]
    rows = _table_rows(results)
    assert len(rows) >= 3, "the README's results section has no table"
    # the embedded default's tables, and the real pair's (docs/real_pair.md)
    report_rows = _report_rows("docs/bench/results.json")
    pair_rows = _report_rows("docs/bench/real_pair/results.json")
    typed = [row for row in rows if row not in report_rows | pair_rows]
    assert not typed, f"README rows not in the report of docs/bench/results.json or real_pair/results.json: {typed[:2]}"
    # and the same holds for the full page of tables
    benchmarks = (ROOT / "docs/benchmarks.md").read_text()
    section = benchmarks[benchmarks.index("## Latest measured results"):benchmarks.index("**Equal total cores**")]
    typed = [row for row in _table_rows(section) if row not in report_rows]
    assert not typed, f"docs/benchmarks.md rows not in the report: {typed[:2]}"


def test_the_serving_table_is_the_rendering_of_the_load_bench_artifact():
    import json
    from ssd_trt.serve.triton.load_bench import table
    rendered = table(json.loads((ROOT / "docs/bench/serving_load.json").read_text()))
    page = (ROOT / "docs/serving.md").read_text()
    missing = [line for line in rendered.splitlines() if line.strip() and line not in page]
    assert not missing, f"docs/serving.md lacks lines of the load bench's table: {missing[:2]}"


def test_the_kernel_table_is_the_rendering_of_the_kernel_bench_artifact():
    import json
    from ssd_trt.bench.kernels import table
    rendered = table(json.loads((ROOT / "docs/bench/kernels/kernels.json").read_text()))
    page = (ROOT / "docs/kernels.md").read_text()
    missing = [line for line in rendered.splitlines() if line.strip() and line not in page]
    assert not missing, f"docs/kernels.md lacks lines of the kernel bench's table: {missing[:2]}"


def test_the_step_table_is_the_rendering_of_the_step_bench_artifact():
    import json
    from ssd_trt.bench.steps import table
    rendered = table(json.loads((ROOT / "docs/bench/steps/steps.json").read_text()))
    page = (ROOT / "docs/kernels.md").read_text()
    missing = [line for line in rendered.splitlines() if line.strip() and line not in page]
    assert not missing, f"docs/kernels.md lacks lines of the step bench's table: {missing[:2]}"


def test_the_load_bench_pools_its_passes_by_tokens_over_wall_time():
    from ssd_trt.serve.triton.load_bench import pooled
    point = {"concurrency": 4, "mode": "ssd", "max_tokens": 64, "requests": 32, "generated_tokens": 2048}
    passes = [{**point, "wall_s": 10.0, "errors": [], "latency_p50_s": 1.0, "latency_p99_s": 1.5, "ttft_p50_s": 0.1,
               "ttft_p99_s": 0.3},
              {**point, "wall_s": 6.0, "errors": ["boom"], "latency_p50_s": 0.6, "latency_p99_s": 0.9, "ttft_p50_s": 0.1,
               "ttft_p99_s": 0.2}]
    point = pooled(passes)
    assert point["throughput_tok_s"] == 4096 / 16.0 and point["requests"] == 64 and point["errors"] == ["boom"]
    assert point["latency_p50_s"] == 0.8 and point["latency_p99_s"] == 1.5 and point["ttft_p99_s"] == 0.3
    assert point["passes"] == passes and point["mode"] == "ssd" and point["concurrency"] == 4


def test_every_relative_link_in_the_pages_leads_to_a_file():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def _cites(mention: str, artifact: str) -> bool:
    """Whether a page's mention (relative to docs/) names the artifact: its path, a folder it is in (not
    bench/ itself), or a glob whose * stays within one folder."""
    if "*" in mention:
        return re.fullmatch(re.escape(mention).replace(r"\*", "[^/]*"), artifact) is not None
    folder = mention.rstrip("/")
    return artifact == mention or (folder != "bench" and artifact.startswith(folder + "/"))


def test_every_artifact_under_docs_is_cited_by_a_page():
    mentions = {m for page in [*PAGES, *CARDS] for m in MENTION.findall(page.read_text())}
    artifacts = [path.relative_to(ROOT / "docs").as_posix() for path in sorted((ROOT / "docs").rglob("*"))
                 if path.is_file() and path not in PAGES]
    orphans = [f"docs/{artifact}" for artifact in artifacts if not any(_cites(m, artifact) for m in mentions)]
    assert not orphans, f"artifacts no page cites (cite them, or move them to research/): {orphans}"
