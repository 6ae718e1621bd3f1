"""guidellm (vLLM's load generator, nobody on this project wrote it) against the OpenAI server: a concurrency sweep,
streamed, its TTFT and inter-token latency per point, beside the project's own load bench.

    .venv/bin/python research/serving/guidellm_sweep.py build/smollm2-135m --guidellm-venv /tmp/guidellm/venv \
        --seconds 60 --baseline docs/bench/serving_openai.json --out docs/bench/serving_guidellm.json

guidellm lives in its own venv (it pulls torch and transformers 5): ``python3.11 -m venv /tmp/guidellm/venv &&
/tmp/guidellm/venv/bin/pip install torch==2.13.0 guidellm==0.8.1``. The server (this checkout, ``--no-access-log``)
runs as a subprocess on a free port; guidellm runs its ``concurrent`` profile (``c`` streams, each sending its next
request when the last ends) for ``--seconds`` per point, the first ``--warmup`` of each left out of its statistics,
with synthetic prompts of ``--prompt-tokens`` tokens and ``--output-tokens`` tokens out (``ignore_eos``), over
``/v1/completions``. Offline it needs the build's own tokenizer (``--tokenizer model=BUILD/tokenizer``, else it asks
the Hub for the served model name) and ``HF_HUB_OFFLINE``. guidellm's ITL is per request
(last token - first token) / (output tokens - 1), so a chunk of several tokens counts as several; percentiles are
over the requests that completed (the ones the duration cut off are ``incomplete``, not errors).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ssd_trt.bench.artifact import write_artifact  # noqa: E402
from ssd_trt.serve.openai.process import OpenAIServer  # noqa: E402
from ssd_trt.serve.process import free_port  # noqa: E402


def guidellm_command(exe: Path, url: str, tokenizer: Path, args: argparse.Namespace, report: Path) -> list[str]:
    spec = {
        "--backend": {"kind": "openai_http", "target": url, "request_format": args.request_format},
        "--tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "--profile": {"kind": "concurrent", "streams": args.concurrencies[0], "warmup": args.warmup},
        "--data": {"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
                   "output_tokens": args.output_tokens},
        "--constraint": {"kind": "max_duration", "seconds": args.seconds},
        "--output": {"kind": "json", "path": str(report)},
    }
    sweep = ["--override", "profile.streams", ",".join(map(str, args.concurrencies))]   # one run per concurrency
    return [str(exe), "run", *[a for k, v in spec.items() for a in (k, json.dumps(v))], *sweep, "--disable-progress"]


def point(bench: dict[str, Any]) -> dict[str, Any]:
    """One guidellm benchmark (one concurrency) in the few numbers we keep."""
    m = bench["metrics"]

    def pct(name: str, q: str) -> float:
        return m[name]["successful"]["percentiles"][q]

    totals = m["request_totals"]
    return {"concurrency": bench["config"]["strategy"]["streams"], "duration_s": bench["duration"],
            "requests": totals["successful"], "errors": totals["errored"], "incomplete": totals["incomplete"],
            "output_tok_s": m["output_tokens_per_second"]["total"]["mean"],
            "total_tok_s": m["tokens_per_second"]["total"]["mean"],
            "ttft_p50_ms": pct("time_to_first_token_ms", "p50"), "ttft_p99_ms": pct("time_to_first_token_ms", "p99"),
            "itl_p50_ms": pct("inter_token_latency_ms", "p50"), "itl_p99_ms": pct("inter_token_latency_ms", "p99"),
            "request_latency_p50_s": pct("request_latency", "p50")}


def baseline_points(path: Path, concurrencies: list[int]) -> list[dict[str, Any]]:
    """The project's load bench (``serving_openai.json``) at the same concurrencies, the server's default mode."""
    bench = json.loads(path.read_text())
    return [{"concurrency": p["concurrency"], "mode": p["mode"], "max_tokens": p["max_tokens"],
             "ttft_p50_ms": 1000 * p["ttft_p50_s"], "ttft_p99_ms": 1000 * p["ttft_p99_s"],
             "throughput_tok_s": p["throughput_tok_s"]}
            for p in bench["openai"] if p["concurrency"] in concurrencies and p["mode"] == "ssd"]


def table(result: dict[str, Any]) -> str:
    rows = ["| c | requests | errors | incomplete | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |",
            "|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        rows.append(f"| {p['concurrency']} | {p['requests']} | {p['errors']} | {p['incomplete']} | "
                    f"{p['output_tok_s']:.1f} | {p['ttft_p50_ms']:.0f} / {p['ttft_p99_ms']:.0f} | "
                    f"{p['itl_p50_ms']:.1f} / {p['itl_p99_ms']:.1f} |")
    return "\n".join(rows)


def plot(result: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(10, 4))
    series = [("guidellm", result["points"], "tab:blue")]
    if result.get("baseline", {}).get("points"):
        series.append((f"project load bench ({result['baseline']['path']}, "
                       f"{result['baseline']['points'][0]['max_tokens']} tokens)", result["baseline"]["points"],
                       "tab:gray"))
    for label, points, color in series:
        c = [p["concurrency"] for p in points]
        ax_ttft.plot(c, [p["ttft_p50_ms"] for p in points], "o-", color=color, label=f"{label} p50")
        ax_ttft.plot(c, [p["ttft_p99_ms"] for p in points], "x--", color=color, label=f"{label} p99")
    c = [p["concurrency"] for p in result["points"]]
    ax_itl.plot(c, [p["itl_p50_ms"] for p in result["points"]], "o-", color="tab:blue", label="guidellm p50")
    ax_itl.plot(c, [p["itl_p99_ms"] for p in result["points"]], "x--", color="tab:blue", label="guidellm p99")
    for ax, name in ((ax_ttft, "TTFT (ms)"), (ax_itl, "inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    fig.suptitle(f"guidellm {result['guidellm_version']} against the OpenAI server ({result['build']}): "
                 f"{result['prompt_tokens']} in, {result['output_tokens']} out, streamed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("build_dir", type=Path)
    parser.add_argument("--guidellm-venv", type=Path, default=Path("/tmp/guidellm/venv"))
    parser.add_argument("--concurrencies", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--seconds", type=float, default=60, help="guidellm's max_duration per concurrency")
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of each point left out of the stats")
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--request-format", default="/v1/completions",
                        choices=["/v1/completions", "/v1/chat/completions"])
    parser.add_argument("--workers", type=int, default=2, help="guidellm's worker processes (its default: 10)")
    parser.add_argument("--baseline", type=Path, help="the project's load bench artifact (serving_openai.json)")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/serving_guidellm.json"))
    args = parser.parse_args(argv)
    build = args.build_dir.resolve()
    exe = args.guidellm_venv / "bin" / "guidellm"
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True,
                             check=True).stdout.split()[-1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GUIDELLM__MAX_WORKER_PROCESSES": str(args.workers)}
    with tempfile.TemporaryDirectory() as tmp:
        server = OpenAIServer(build, free_port(), ["--no-access-log"], log_file=Path(tmp) / "server.log")
        report = Path(tmp) / "benchmarks.json"
        command = guidellm_command(exe, server.url, build / "tokenizer", args, report)
        try:
            server.start().wait_ready(timeout=900)
            print("$ " + shlex.join(command), flush=True)
            code = subprocess.run(command, env=env, cwd=tmp).returncode   # cwd: it writes guidellm.log there
        finally:
            server.stop()
        if code != 0 or not report.exists():
            print(f"guidellm exited with {code}; server log:\n{(Path(tmp) / 'server.log').read_text()[-3000:]}",
                  file=sys.stderr)
            return 1
        raw = json.loads(report.read_text())
    points = sorted((point(b) for b in raw["benchmarks"]), key=lambda p: p["concurrency"])
    result = {"command": "python research/serving/guidellm_sweep.py " + shlex.join(argv or sys.argv[1:]),
              "guidellm_command": shlex.join(command), "guidellm_version": version,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "build": str(args.build_dir), "request_format": args.request_format,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
              "seconds_per_point": args.seconds, "warmup": args.warmup, "points": points}
    if args.baseline:
        result["baseline"] = {"path": str(args.baseline),
                              "points": baseline_points(args.baseline, args.concurrencies)}
    write_artifact(result, args.out, plot, table)
    return 1 if any(p["errors"] for p in points) else 0


if __name__ == "__main__":
    sys.exit(main())
