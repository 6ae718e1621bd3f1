"""``python -m ssd_trt.serve.triton load-bench BUILD_DIR``: serving under load, against a real tritonserver.

Exports the build to a temporary model repository, starts tritonserver on 127.0.0.1, and measures with the
example client (``client.py bench``, run in the serving venv):

* the sweep: for ar / sd / ssd and concurrency 1, 2, 4, 8, 16, closed-loop clients (each sends its requests
  one after another) over the report prompt set, each request generating ``--max-tokens`` tokens (EOS
  ignored, so that every mode and load does the same work): throughput, p50 / p99 latency and time to
  first token;
* the mixed workload, over plain HTTP: 8 requests of ``--max-tokens`` tokens (EOS ignored) alternating ssd / ar and,
  by pairs, greedy / seeded T=0.7 top-p 0.95, sent all at once and then one at a time (aggregate throughput of each,
  their ratio, and whether the greedy and the seeded AR requests gave the same tokens both ways), and the same 8
  requests all in ar and all in ssd, sent at once.

The whole sweep and the mixed workload run ``--passes`` times (default 2); each point pools its passes
(throughput: all tokens over all wall time).

Writes a JSON artifact (``--out``), a PNG beside it, and prints the markdown table of docs/serving.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ssd_trt.bench.artifact import pyplot, write_artifact
from ssd_trt.bench.prompts import DEFAULT_PROMPTS, load_prompts

CONCURRENCIES = (1, 2, 4, 8, 16)
MODES = ("ar", "sd", "ssd")


MIXED_KINDS = ("mixed", "ar", "ssd")


def mixed_specs(prompts: list[str], max_tokens: int, kind: str = "mixed") -> list[dict[str, Any]]:
    """8 requests of ``max_tokens`` tokens (EOS ignored): request i in ssd when i is even, ar when odd (``kind`` mixed;
    ar / ssd: all of them in that mode), greedy for i = 0, 1, 4, 5, seeded T=0.7 top-p 0.95 for i = 2, 3, 6, 7."""
    specs = []
    for i in range(8):
        mode = ("ssd" if i % 2 == 0 else "ar") if kind == "mixed" else kind
        t = 0.7 if (i // 2) % 2 else 0.0
        specs.append({"prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "mode": mode, "temperature": t,
                      "top_p": 0.95 if t else 1.0, "seed": 100 + i if t else None, "ignore_eos": True})
    return specs


def unchanged(together: dict[str, Any], alone: dict[str, Any], specs: list[dict[str, Any]]) -> bool:
    """Whether every greedy request and every seeded AR request gave the same tokens sent at once as one at a time
    (a seeded SSD request may not: how adaptive SSD runs depends on the load, and so do its draws)."""
    return all(a["token_ids"] == b["token_ids"] for a, b, spec in zip(together["results"], alone["results"], specs)
               if spec["temperature"] == 0.0 or spec["mode"] == "ar")


def run_client(server, *args: str) -> dict[str, Any]:
    """``client.py bench`` in the serving venv; its JSON summary."""
    source_root = str(Path(__file__).resolve().parents[3])
    path = os.pathsep.join(filter(None, (source_root, os.environ.get("PYTHONPATH"))))
    proc = subprocess.run([str(server.env.python), "-m", "ssd_trt.serve.triton.client", "bench",
                           "--grpc-url", server.grpc_url, "--http-url", server.http_url, *args], capture_output=True,
                          text=True,
                          env={**os.environ, "PYTHONPATH": path}, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"client bench printed nothing (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def measure(server, prompts: list[str], max_tokens: int, requests_per_point: int, passes: int,
            concurrencies: tuple[int, ...] = CONCURRENCIES) -> dict[str, Any]:
    from tqdm import tqdm
    # modes interleaved at each concurrency, and the whole sweep run ``passes`` times: the machine's speed drifts
    # over minutes, so the modes are compared side by side and every point sees the drift of the whole run
    points = [(mode, c) for c in concurrencies for mode in MODES]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {point: [] for point in points}
    mixed: dict[str, list[dict[str, Any]]] = {"concurrent": [], "one_at_a_time": [], "all_ar": [], "all_ssd": []}
    specs_mixed = {kind: mixed_specs(prompts, max_tokens, kind) for kind in MIXED_KINDS}
    same: list[bool] = []

    def mixed_run(kind: str, *how: str) -> dict[str, Any]:
        return run_client(server, "--protocol", "http", "--full", "--specs", json.dumps(specs_mixed[kind]), *how)
    with tqdm(total=passes * (len(points) + 4), desc="load bench", unit="point") as progress:
        for _ in range(passes):
            for mode, concurrency in points:
                specs = [{"prompt": p, "max_tokens": max_tokens, "mode": mode, "ignore_eos": True} for p in prompts]
                repeat = max(4, requests_per_point // concurrency)     # clients keep the engine full, then drain
                runs[(mode, concurrency)].append(run_client(server, "--specs", json.dumps(specs), "--concurrency",
                                                            str(concurrency), "--repeat", str(repeat)))
                progress.update()
            mixed["concurrent"].append(mixed_run("mixed", "--concurrency", "8"))
            mixed["one_at_a_time"].append(mixed_run("mixed", "--concurrency", "1", "--repeat", "8"))
            same.append(unchanged(mixed["concurrent"][-1], mixed["one_at_a_time"][-1], specs_mixed["mixed"]))
            mixed["all_ar"].append(mixed_run("ar", "--concurrency", "8"))
            mixed["all_ssd"].append(mixed_run("ssd", "--concurrency", "8"))
            progress.update(4)
    for run in (r for kind in mixed.values() for r in kind):
        run.pop("results")                     # (the tokens were compared above; the artifact keeps the summaries)
    pooled_mixed = {kind: pooled(runs_of_kind) for kind, runs_of_kind in mixed.items()}
    rate = {kind: point["throughput_tok_s"] for kind, point in pooled_mixed.items()}
    return {"passes": passes, "sweep": [pooled(runs[point]) for point in points],
            "mixed": {**pooled_mixed, "throughput_ratio": rate["concurrent"] / rate["one_at_a_time"],
                      "vs_better_variant": rate["concurrent"] / max(rate["all_ar"], rate["all_ssd"]),
                      "outputs_unchanged": same}}


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One point over its passes: throughput = all tokens / all wall time; p50s averaged, p99s the worst pass's;
    errors of every pass; each pass's own summary kept under ``passes``."""
    first = runs[0]
    out = {key: first[key] for key in ("concurrency", "mode", "max_tokens") if key in first}
    tokens, wall = sum(r["generated_tokens"] for r in runs), sum(r["wall_s"] for r in runs)
    out.update(requests=sum(r["requests"] for r in runs), wall_s=wall, generated_tokens=tokens,
               throughput_tok_s=tokens / wall, errors=[e for r in runs for e in r["errors"]],
               latency_p50_s=sum(r["latency_p50_s"] for r in runs) / len(runs),
               latency_p99_s=max(r["latency_p99_s"] for r in runs),
               passes=runs)
    ttfts = [(r["ttft_p50_s"], r["ttft_p99_s"]) for r in runs]
    known = None not in (t for pair in ttfts for t in pair)      # (plain HTTP answers once: no first token to time)
    out.update(ttft_p50_s=sum(p50 for p50, _ in ttfts) / len(runs) if known else None,
               ttft_p99_s=max(p99 for _, p99 in ttfts) if known else None)
    return out


def table(result: dict[str, Any]) -> str:
    rows = ["| mode | concurrency | requests | throughput (tok/s) | vs AR at 1 | p50 latency (s) | p99 latency (s) "
            "| p50 TTFT (s) | p99 TTFT (s) | errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    base = next(s["throughput_tok_s"] for s in result["sweep"] if s["mode"] == "ar" and s["concurrency"] == 1)
    for s in sorted(result["sweep"], key=lambda s: (MODES.index(s["mode"]), s["concurrency"])):
        rows.append(f"| {s['mode']} | {s['concurrency']} | {s['requests']} | {s['throughput_tok_s']:.1f} | "
                    f"{s['throughput_tok_s'] / base:.2f}x | {s['latency_p50_s']:.2f} | {s['latency_p99_s']:.2f} | "
                    f"{s['ttft_p50_s']:.3f} | {s['ttft_p99_s']:.3f} | {len(s['errors'])} |")
    mixed = result["mixed"]
    rows.append("")
    errors = sum(len(mixed[kind]["errors"]) for kind in ("concurrent", "one_at_a_time", "all_ar", "all_ssd"))
    rows.append(f"Mixed (8 requests x {mixed['concurrent']['max_tokens']} tokens over plain HTTP, alternating ssd / ar "
                f"and greedy / seeded T=0.7): {mixed['concurrent']['throughput_tok_s']:.1f} tok/s all at once vs "
                f"{mixed['one_at_a_time']['throughput_tok_s']:.1f} tok/s one at a time = "
                f"**{mixed['throughput_ratio']:.2f}x**; the same 8 all-ar at once "
                f"{mixed['all_ar']['throughput_tok_s']:.1f}, all-ssd {mixed['all_ssd']['throughput_tok_s']:.1f} tok/s "
                f"(mixed / the better: {mixed['vs_better_variant']:.2f}); greedy and seeded-AR outputs unchanged in "
                f"{sum(mixed['outputs_unchanged'])} of {len(mixed['outputs_unchanged'])} passes; errors {errors}.")
    return "\n".join(rows)


def plot(result: dict[str, Any], path: Path) -> Path | None:
    lines = [(mode, "-", [s for s in result["sweep"] if s["mode"] == mode]) for mode in MODES]
    return plot_sweeps(lines, path, "concurrent clients", "Triton, continuous batching: one model instance, 2 CPU cores")


def plot_sweeps(lines: list[tuple[str, str, list[dict[str, Any]]]], path: Path, clients: str, title: str,
                legend_size: float | None = None) -> Path | None:
    """Throughput and p99 latency by concurrency, one line per (label, line style, sweep points); the serving load
    benches' figure (None without matplotlib, an optional extra)."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, style, points in lines:
        for ax, key in zip(axes, ("throughput_tok_s", "latency_p99_s")):
            ax.plot([s["concurrency"] for s in points], [s[key] for s in points], style, marker="o", label=label)
    for ax, what in zip(axes, ("throughput (tok/s)", "p99 latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(clients)
        ax.set_ylabel(what)
        ax.legend(fontsize=legend_size)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd_trt.serve.triton load-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("build_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/serving_load.json"))
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    parser.add_argument("--requests", type=int, default=32, help="requests per sweep point (at least 4 per client)")
    parser.add_argument("--runtime-options", default="{}", help="RuntimeOptions of the served model, as JSON "
                                                                "(`serve.triton export --runtime-options`)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts of the report set, cycled")
    parser.add_argument("--passes", type=int, default=2, help="times the whole sweep (and the mixed workload) runs")
    parser.add_argument("--concurrencies", type=int, nargs="+", default=list(CONCURRENCIES),
                        help="client counts of the sweep (the table's 'vs AR at 1' needs 1 among them)")
    args = parser.parse_args(argv)
    if 1 not in args.concurrencies or min(args.concurrencies) < 1:
        parser.error(f"--concurrencies must be positive and include 1 (the baseline), got {args.concurrencies}")
    from ssd_trt.serve.triton.environment import ensure_env
    from ssd_trt.serve.triton.repository import ExportOptions, export_repository
    from ssd_trt.serve.triton.server import ServerConfig, TritonServer, free_port
    prompts = [p.prompt for p in load_prompts(DEFAULT_PROMPTS)][::7][:args.prompts]
    with tempfile.TemporaryDirectory() as root:
        repo = export_repository(args.build_dir, Path(root) / "repo",
                                 ExportOptions(runtime_options=json.loads(args.runtime_options)))
        server = TritonServer(ServerConfig(repo, free_port(), free_port(), free_port(),
                                           log_file=Path(root) / "tritonserver.log"), ensure_env())
        try:
            server.start().wait_ready(timeout=900)
            result = measure(server, prompts, args.max_tokens, args.requests, args.passes,
                             tuple(sorted(set(args.concurrencies))))
            result["metrics"] = [line for line in server.metrics().splitlines() if line.startswith("ssd_trt_")]
        finally:
            server.stop()
    result.update({"build": str(args.build_dir), "max_tokens": args.max_tokens, "prompts": prompts,
                   "command": "python -m ssd_trt.serve.triton load-bench " + " ".join(argv or sys.argv[1:])})
    write_artifact(result, args.out, plot, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
