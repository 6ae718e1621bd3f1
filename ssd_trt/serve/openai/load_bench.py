"""``python -m ssd_trt.serve.openai load-bench BUILD_DIR``: the OpenAI server under load, beside the Triton frontend.

Both frontends serve the same build through the same serving loop (``serve/core.py``), one after the other on this
machine (never at once: they would share its cores). Each point is a closed loop: ``concurrency`` clients, each
sending its requests one after another (at least 4, ``--requests`` per point), streaming, ``--max-tokens`` tokens per
request with EOS ignored (every mode and load does the same work), greedy, over prompts of the report set:

* OpenAI: the official ``openai`` client in threads (one client object per thread), ``/v1/completions`` with
  ``stream=True``; TTFT = request sent to the first chunk with text, latency = to the end of the stream;
* Triton: the example client's gRPC streaming bench (``serve/triton/client.py``, run in the serving venv), the same
  numbers (first token, final response).

Writes a JSON artifact (``--out``, every point's summary and each request's result), a PNG beside it, and prints the
markdown table of docs/serving.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ssd_trt.bench.artifact import write_artifact
from ssd_trt.bench.prompts import DEFAULT_PROMPTS, load_prompts
from ssd_trt.serve.triton.client import Result, summarize

CONCURRENCIES = (1, 4, 16)
MODES = ("ar", "ssd")
FRONTENDS = ("openai", "triton")


def one_request(client, model: str, spec: dict[str, Any]) -> Result:
    """A streamed completion, timed as the Triton client times its requests."""
    out = Result()
    started = time.perf_counter()
    try:
        stream = client.completions.create(
            model=model, prompt=spec["prompt"], max_tokens=spec["max_tokens"], temperature=0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": spec.get("ignore_eos", False),
                        **({"mode": spec["mode"]} if spec.get("mode") else {})})     # absent: the server's default
        for chunk in stream:
            for choice in chunk.choices:
                if choice.text:
                    out.chunks += 1
                    out.text += choice.text
                    if out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - started
            if chunk.usage is not None:
                out.stats["generated_tokens"] = chunk.usage.completion_tokens
            out.stats.update((chunk.model_extra or {}).get("ssd_trt") or {})
    except Exception as exc:  # noqa: BLE001 -- an error is a result of the bench, counted
        out.error = f"{type(exc).__name__}: {exc}"
    out.latency_s = time.perf_counter() - started
    return out


def bench(url: str, model: str, specs: list[dict[str, Any]], concurrency: int, repeat: int) -> dict[str, Any]:
    """``concurrency`` threads, each with its own ``openai`` client, each sending ``repeat`` requests in turn."""
    import openai
    results: list[Result | None] = [None] * (concurrency * repeat)
    barrier = threading.Barrier(concurrency)

    def worker(index: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
        barrier.wait()
        for r in range(repeat):
            slot = index * repeat + r
            results[slot] = one_request(client, model, specs[slot % len(specs)])

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return summarize(results, time.perf_counter() - started, concurrency, specs)


def points(modes: tuple[str, ...], concurrencies: tuple[int, ...], requests: int) -> list[tuple[str, int, int]]:
    """(mode, concurrency, requests per client) of the sweep, modes interleaved at each concurrency."""
    return [(mode, c, max(4, requests // c)) for c in concurrencies for mode in modes]


def run_openai(build: Path, specs_of, sweep, log_dir: Path) -> list[dict[str, Any]]:
    from ssd_trt.serve.openai.process import OpenAIServer
    from ssd_trt.serve.process import free_port
    server = OpenAIServer(build, free_port(), ["--no-access-log"], log_file=log_dir / "openai.log")
    try:
        server.start().wait_ready(timeout=900)
        return [bench(server.url, build.resolve().name, specs_of(mode), c, repeat) for mode, c, repeat in sweep]
    finally:
        server.stop()


def run_triton(build: Path, specs_of, sweep, log_dir: Path) -> list[dict[str, Any]]:
    from ssd_trt.serve.process import free_port
    from ssd_trt.serve.triton.environment import ensure_env
    from ssd_trt.serve.triton.load_bench import run_client
    from ssd_trt.serve.triton.repository import export_repository
    from ssd_trt.serve.triton.server import ServerConfig, TritonServer
    repo = export_repository(build, log_dir / "repo")
    server = TritonServer(ServerConfig(repo, free_port(), free_port(), free_port(),
                                       log_file=log_dir / "tritonserver.log"), ensure_env())
    try:
        server.start().wait_ready(timeout=900)
        return [run_client(server, "--specs", json.dumps(specs_of(mode)), "--concurrency", str(c), "--repeat",
                           str(repeat), "--full") for mode, c, repeat in sweep]
    finally:
        server.stop()


def table(result: dict[str, Any]) -> str:
    rows = ["| frontend | mode | concurrency | requests | throughput (tok/s) | p50 latency (s) | p99 latency (s) | "
            "p50 TTFT (s) | p99 TTFT (s) | errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    for frontend in FRONTENDS:
        for s in result.get(frontend, []):
            rows.append(f"| {frontend} | {s['mode']} | {s['concurrency']} | {s['requests']} | "
                        f"{s['throughput_tok_s']:.1f} | {s['latency_p50_s']:.2f} | {s['latency_p99_s']:.2f} | "
                        f"{s['ttft_p50_s']:.3f} | {s['ttft_p99_s']:.3f} | {len(s['errors'])} |")
    if "same_text" in result:
        rows += ["", f"Greedy texts identical between the frontends at {sum(result['same_text'])} of "
                     f"{len(result['same_text'])} points."]
    return "\n".join(rows)


def plot(result: dict[str, Any], path: Path) -> Path | None:
    from ssd_trt.serve.triton.load_bench import plot_sweeps
    lines = [(f"{frontend} {mode}", style, [s for s in result[frontend] if s["mode"] == mode])
             for frontend, style in zip(FRONTENDS, ("-", "--"))
             for mode in sorted({s["mode"] for s in result.get(frontend, [])})]
    return plot_sweeps(lines, path, "concurrent streaming clients",
                       "OpenAI server vs Triton, one serving loop (continuous batching)", legend_size=8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd_trt.serve.openai load-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("build_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/serving_openai.json"))
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    parser.add_argument("--requests", type=int, default=16, help="requests per point (at least 4 per client)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts of the report set, cycled")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=["ar", "sd", "ssd"])
    parser.add_argument("--concurrencies", type=int, nargs="+", default=list(CONCURRENCIES))
    parser.add_argument("--frontends", nargs="+", default=list(FRONTENDS), choices=list(FRONTENDS),
                        help="triton needs the serving venv (python -m ssd_trt.serve.triton setup)")
    args = parser.parse_args(argv)
    if min(args.concurrencies) < 1 or args.requests < 1 or args.max_tokens < 1:
        parser.error("--concurrencies, --requests and --max-tokens must be >= 1")
    prompts = [p.prompt for p in load_prompts(DEFAULT_PROMPTS)][::7][:args.prompts]

    def specs_of(mode: str) -> list[dict[str, Any]]:
        return [{"prompt": p, "max_tokens": args.max_tokens, "mode": mode, "ignore_eos": True} for p in prompts]
    sweep = points(tuple(args.modes), tuple(sorted(set(args.concurrencies))), args.requests)
    result: dict[str, Any] = {"build": str(args.build_dir), "max_tokens": args.max_tokens, "prompts": prompts,
                              "command": "python -m ssd_trt.serve.openai load-bench " + " ".join(argv or sys.argv[1:])}
    runners = {"openai": run_openai, "triton": run_triton}
    with tempfile.TemporaryDirectory() as root:
        for frontend in args.frontends:
            result[frontend] = runners[frontend](args.build_dir, specs_of, sweep, Path(root))
    if set(FRONTENDS) <= set(args.frontends):   # greedy: both frontends gave every request the same text
        result["same_text"] = [[a["text"] for a in mine["results"]] == [b["text"] for b in theirs["results"]]
                               for mine, theirs in zip(result["openai"], result["triton"])]
    for summary in (s for frontend in args.frontends for s in result[frontend]):
        summary.pop("results")                  # (compared above; the artifact keeps the summaries)
    write_artifact(result, args.out, plot, table)
    return 1 if any(s["errors"] for frontend in args.frontends for s in result[frontend]) else 0
