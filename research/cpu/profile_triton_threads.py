"""Where the Triton model's threads spend their time under a closed load: py-spy samples of the backend's stub.

    python research/cpu/profile_triton_threads.py build/smollm2-135m --concurrency 1 \
        --out docs/bench/profiles/triton_threads_1_client.txt
    # the same load on another checkout's backend (e.g. before a change), the client and report from this one:
    python research/cpu/profile_triton_threads.py build/smollm2-135m --source /tmp/before --out before.txt

Exports the build (with ``--source``'s exporter, so the served ``model.py`` runs that tree's backend), starts
tritonserver, and for each mode runs ``client.py bench`` (``--concurrency`` closed-loop gRPC streams, 64 tokens per
request, EOS ignored) while ``py-spy record`` samples both stub processes (the streaming model's and its
non-streaming twin's; the report keeps the busy one). py-spy must be installed (``pip install py-spy``).

The report, per mode: the run's tokens/s (py-spy's sampling slows it a little), and per thread of the stub (the
step loop, the sender, the draft's worker) the share of its samples in which each of the main functions was on the
stack (inclusive: ONNX Runtime's ``run_with_iobinding``, the waits, the engine step's parts, the delivery of
responses). Shares, not seconds: the machine's speed moves between runs, a thread's split of its own time much less.
"""
from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ssd_trt.bench.prompts import DEFAULT_PROMPTS, load_prompts  # noqa: E402

THREADS = ("ssd-trt-step", "ssd-trt-send", "ssd-draft_0")
SHOWN = 14          # functions listed per thread (the busiest), and these whatever their share:
WATCHED = ("ServingCore._deliver", "LLMEngine._plan", "LoadPolicy.choose", "ServingCore._abort_cancelled",
           "ServingCore._send", "Detokenizer.push", "TritonMetrics.update")
SKIP = ("Thread.", "_bootstrap", "_worker (concurrent", "StepLoop._loop", "ServingCore._send_loop",
        "<module>", "WorkItem.run")


def profile(pids: list[str], seconds: float, out_dir: Path, tag: str) -> list[subprocess.Popen]:
    return [subprocess.Popen(["py-spy", "record", "--pid", pid, "--threads", "--idle", "--format", "raw",
                              "--rate", "200", "--duration", str(int(seconds)), "-o", str(out_dir / f"{tag}_{pid}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for pid in pids]


def thread_shares(path: Path) -> tuple[dict[str, int], dict[str, collections.Counter]]:
    """Samples per thread, and per thread the samples in which each function was on the stack."""
    totals: dict[str, int] = collections.Counter()
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0].split(": ")[-1].strip()
        totals[thread] += int(count)
        for name in {frame.split(" (")[0] + f" ({frame.split('(')[-1].split(':')[0].rsplit('/', 1)[-1]})"
                     for frame in frames[1:]}:
            inclusive[thread][name] += int(count)
    return totals, inclusive


def report(path: Path, tok_s: float, mode: str) -> list[str]:
    totals, inclusive = thread_shares(path)
    lines = [f"## {mode}: {tok_s:.1f} tok/s while sampled"]
    for thread in THREADS:
        if not totals.get(thread):
            continue
        lines.append(f"  thread {thread} ({totals[thread]} samples): share of samples with the function on the stack")
        ranked = [(name, n) for name, n in inclusive[thread].most_common() if not name.startswith(SKIP)]
        shown = ranked[:SHOWN] + [(name, n) for name, n in ranked[SHOWN:] if name.startswith(WATCHED)]
        lines += [f"    {n / totals[thread]:6.1%}  {name}" for name, n in shown]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("build_dir", type=Path)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=16, help="requests per mode")
    parser.add_argument("--modes", nargs="+", default=["ar", "sd", "ssd"])
    parser.add_argument("--source", type=Path, default=ROOT, help="the ssd_trt tree whose backend is served")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if shutil.which("py-spy") is None:
        parser.error("py-spy is not on PATH: pip install py-spy")
    from ssd_trt.serve.triton.environment import ensure_env
    from ssd_trt.serve.triton.load_bench import run_client
    from ssd_trt.serve.triton.server import ServerConfig, TritonServer, free_port
    prompts = [p.prompt for p in load_prompts(DEFAULT_PROMPTS)][::7][:8]
    source, build = args.source.resolve(), args.build_dir.resolve()
    lines = [f"# {' '.join(['python', 'research/cpu/profile_triton_threads.py', *(argv or sys.argv[1:])])}",
             f"# backend served from {source}; {args.concurrency} closed-loop client(s), {args.requests} requests of 64 "
             f"tokens per mode; py-spy at 200 Hz over each run"]
    with tempfile.TemporaryDirectory() as root:
        subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
                        "from ssd_trt.serve.triton.repository import export_repository; "
                        "export_repository(Path(sys.argv[2]), Path(sys.argv[3]))", str(source), str(build),
                        f"{root}/repo"], check=True)
        server = TritonServer(ServerConfig(Path(root) / "repo", free_port(), free_port(), free_port(),
                                           log_file=Path(root) / "tritonserver.log"), ensure_env())
        server.start().wait_ready(timeout=900)
        try:
            pids = subprocess.run(["pgrep", "-f", "triton_python_backend_stub"], capture_output=True,
                                  text=True).stdout.split()
            for mode in args.modes:
                specs = [{"prompt": p, "max_tokens": 64, "mode": mode, "ignore_eos": True} for p in prompts]
                repeat = max(1, args.requests // args.concurrency)
                client = ["--specs", json.dumps(specs), "--concurrency", str(args.concurrency), "--repeat", str(repeat)]
                unsampled = run_client(server, *client)       # how long the run takes: the sampling's duration
                spies = profile(pids, max(2.0, unsampled["wall_s"] - 1.0), Path(root), mode)
                sampled = run_client(server, *client)
                for spy in spies:
                    spy.wait()
                busiest = max((Path(root) / f"{mode}_{pid}.txt" for pid in pids),
                              key=lambda p: p.stat().st_size if p.exists() else -1)
                lines += [f"# {mode}: {unsampled['throughput_tok_s']:.1f} tok/s unsampled"]
                lines += report(busiest, sampled["throughput_tok_s"], mode)
        finally:
            server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
