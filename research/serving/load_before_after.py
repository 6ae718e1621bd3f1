"""The OpenAI server's load bench at 1 and 16 clients, this checkout against an earlier commit, interleaved (issue 56's
acceptance: the serving loop's fault handling costs nothing measurable under load).

    python research/serving/load_before_after.py build/smollm2-135m --before 89227d1 \
        --out docs/bench/serving_load_before_after.json

Both servers serve the same build from their own source tree (``--before`` is checked out into a temporary git
worktree and put first on the server's ``PYTHONPATH``), both stay up for the whole run and idle while the other is
measured. Each round measures every point on both, in the order before/after on even rounds and after/before on odd
ones, so drift of the machine's speed (up to 2x within minutes here) falls on both alike. A point is the load bench's
closed loop (``ssd_trt.serve.openai.load_bench.bench``): ``c`` clients with the official ``openai`` client, streamed
completions, ``--max-tokens`` tokens with EOS ignored, greedy, server-default mode unless ``--modes`` names some.

The machine's noise is measured, not assumed: for each point, the spread of the same tree's rounds
(max/min of throughput over rounds). The verdict per point: the median ratio after/before and whether it lies within
that noise.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ssd_trt.bench.artifact import write_artifact  # noqa: E402
from ssd_trt.bench.prompts import DEFAULT_PROMPTS, load_prompts  # noqa: E402
from ssd_trt.serve.openai.load_bench import bench  # noqa: E402
from ssd_trt.serve.openai.process import OpenAIServer  # noqa: E402
from ssd_trt.serve.process import free_port  # noqa: E402

TREES = ("before", "after")


class TreeServer(OpenAIServer):
    """The OpenAI server run from a given source tree (its package first on the path)."""

    def __init__(self, tree: Path, build_dir: Path, port: int, log_file: Path) -> None:
        super().__init__(build_dir, port, ["--no-access-log"], log_file=log_file)
        self.tree = tree

    def environment(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.tree)}


def summary(point: dict[str, Any]) -> dict[str, Any]:
    keys = ("throughput_tok_s", "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s")
    return {**{k: point[k] for k in keys}, "requests": point["requests"], "errors": len(point["errors"])}


def verdicts(rounds: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """Per point: medians over rounds per tree, after/before, and the noise the rounds themselves show."""
    out: dict[str, Any] = {}
    for label in labels:
        tput = {t: [r[t][label]["throughput_tok_s"] for r in rounds] for t in TREES}
        ttft = {t: [r[t][label]["ttft_p50_s"] for r in rounds] for t in TREES}
        p50 = {t: [r[t][label]["latency_p50_s"] for r in rounds] for t in TREES}
        noise = max(max(v) / min(v) for v in tput.values())
        ratio = statistics.median(tput["after"]) / statistics.median(tput["before"])
        out[label] = {
            "throughput_tok_s": {t: statistics.median(v) for t, v in tput.items()},
            "ttft_p50_s": {t: statistics.median(v) for t, v in ttft.items()},
            "latency_p50_s": {t: statistics.median(v) for t, v in p50.items()},
            "throughput_after_over_before": ratio,
            "paired_ratios": [a / b for a, b in zip(tput["after"], tput["before"])],
            "noise_max_over_min_same_tree": noise,
            "within_noise": 1 / noise <= ratio,     # slower only by less than the same tree varies
        }
    return out


def table(result: dict[str, Any]) -> str:
    rows = ["| point | before tok/s | after tok/s | after/before | same-tree spread | p50 TTFT before / after (s) |",
            "|---|---|---|---|---|---|"]
    for label, v in result["verdicts"].items():
        rows.append(f"| {label} | {v['throughput_tok_s']['before']:.1f} | {v['throughput_tok_s']['after']:.1f} | "
                    f"{v['throughput_after_over_before']:.3f} | {v['noise_max_over_min_same_tree']:.3f} | "
                    f"{v['ttft_p50_s']['before']:.3f} / {v['ttft_p50_s']['after']:.3f} |")
    return "\n".join(rows)


def plot(result: dict[str, Any], path: Path) -> Path | None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = list(result["verdicts"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, label in enumerate(labels):
        for j, tree in enumerate(TREES):
            values = [r[tree][label]["throughput_tok_s"] for r in result["rounds"]]
            ax.scatter([i + (j - 0.5) * 0.25] * len(values), values, color=("tab:gray", "tab:blue")[j],
                       label=tree if i == 0 else None)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("tokens/s (each dot one round)")
    ax.set_title(f"OpenAI server load bench: {result['before']['commit'][:7]} vs {result['after']['commit'][:7]}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def commit_of(tree: Path) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True,
                          check=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("build_dir", type=Path)
    parser.add_argument("--before", default="89227d1", help="the commit to compare against (before issue 56)")
    parser.add_argument("--concurrencies", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--modes", nargs="+", default=[None], help="request modes (default: the server's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=16, help="requests per point (at least 4 per client)")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/serving_load_before_after.json"))
    args = parser.parse_args(argv)
    build = args.build_dir.resolve()
    prompts = [p.prompt for p in load_prompts(DEFAULT_PROMPTS)][::7][:8]
    points = [(mode, c) for c in args.concurrencies for mode in args.modes]

    def specs(mode: str | None) -> list[dict[str, Any]]:
        extra = {} if mode is None else {"mode": mode}
        return [{"prompt": p, "max_tokens": args.max_tokens, "ignore_eos": True, **extra} for p in prompts]

    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.before], cwd=ROOT, check=True,
                       capture_output=True)
        before_commit = commit_of(worktree)
        trees = {"before": worktree, "after": ROOT}
        servers = {t: TreeServer(trees[t], build, free_port(), Path(tmp) / f"{t}.log") for t in TREES}
        rounds: list[dict[str, Any]] = []
        try:
            for server in servers.values():
                server.start().wait_ready(timeout=900)
            for r in range(args.rounds):
                order = TREES if r % 2 == 0 else TREES[::-1]
                row: dict[str, Any] = {"order": list(order)}
                for tree in order:
                    row[tree] = {}
                    for mode, c in points:
                        repeat = max(4, args.requests // c)
                        point = bench(servers[tree].url, build.name, specs(mode), c, repeat)
                        row[tree][f"{mode or 'default'}-c{c}"] = summary(point)
                        print(f"round {r} {tree} {mode or 'default'} c={c}: {point['throughput_tok_s']:.1f} tok/s, "
                              f"{len(point['errors'])} errors", flush=True)
                rounds.append(row)
        finally:
            for server in servers.values():
                server.stop()
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
    labels = [f"{mode or 'default'}-c{c}" for mode, c in points]
    result = {"command": "python research/serving/load_before_after.py " + " ".join(argv or sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "build": str(args.build_dir), "max_tokens": args.max_tokens, "prompts": prompts,
              "before": {"ref": args.before, "commit": before_commit},
              "after": {"commit": commit_of(ROOT)}, "rounds": rounds, "verdicts": verdicts(rounds, labels)}
    write_artifact(result, args.out, plot, table)
    return 1 if any(p["errors"] for r in rounds for t in TREES for p in r[t].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
