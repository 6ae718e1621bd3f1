#!/usr/bin/env python
"""The GPU session's one JSON and its one-screen summary, from the parts' results (``scripts/gpu_session.sh``).

Reads ``RESULTS/parts.tsv`` (one row per part: name, status, exit code, seconds, limit, why) and the parts' own JSON
files (``kernel.json``, ``runtime.json``, ``pair.json``), writes them as one document and prints what a reader needs
first. Standard library only, so it reports even when the install failed.

    python research/gpu/session_report.py --results gpu_results --json docs/bench/gpu/session.json [--smoke]

Exit code 0 when no part failed or timed out (with ``--smoke``: when every part passed), else 1.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PART_RESULTS = {"kernel": "kernel.json", "runtime": "runtime.json", "pair": "pair.json", "tp_bench": "tp_bench.json"}
OUTSIDE_BUDGET = {"tp_bench"}    # runs only on a host with several GPUs, after the one-GPU session


def read_parts(results: Path) -> dict[str, dict]:
    parts = {}
    for line in (results / "parts.tsv").read_text().splitlines():
        name, status, code, seconds, limit, why = (line.split("\t") + [""] * 6)[:6]
        parts[name] = {"status": status, "exit_code": int(code) if code.strip() else None,
                       "seconds": int(seconds or 0), "limit_s": int(limit or 0), "why": why or None,
                       "log": f"{name}.log" if (results / f"{name}.log").exists() else None}
    return parts


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode:
        return None
    return done.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def session(results: Path, smoke: bool, elapsed: int | None) -> dict:
    parts = read_parts(results)
    device = (results / "device.txt").read_text().strip() if (results / "device.txt").exists() else None
    report = {"smoke": smoke,
              "what": "CPU dry run of every part at toy sizes (code paths, not measurements)" if smoke else
                      "one-GPU session: kernel, runtime and pytest checks, the real pair through the torch backend",
              "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_commit": git_commit(), "gpu": device, "elapsed_s": elapsed,
              "time_limits_s": {name: part["limit_s"] for name, part in parts.items()},
              "time_limits_total_s": sum(part["limit_s"] for name, part in parts.items()
                                         if name not in OUTSIDE_BUDGET),
              "parts": parts}
    for name, file in PART_RESULTS.items():
        report[name] = read_json(results / file)
    pytest_log = results / "pytest_gpu.log"
    if pytest_log.exists():
        lines = [line for line in pytest_log.read_text().splitlines() if line.strip()]
        report["pytest_gpu"] = lines[-1] if lines else None
    bad = [name for name, part in parts.items() if part["status"] in ("failed", "timed out")
           or (smoke and part["status"] != "passed" and name != "install")]
    report["ok"] = not bad
    report["not_ok"] = bad
    report["not_run"] = [name for name, part in parts.items() if part["status"] == "not run"]
    return report


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def summary(report: dict) -> list[str]:
    lines = [f"GPU session{' (smoke, CPU)' if report['smoke'] else ''}: {report['gpu']}; commit {report['git_commit']}",
             f"{'part':<11} {'status':<10} {'s':>4} {'limit':>5}  why"]
    for name, part in report["parts"].items():
        lines.append(f"{name:<11} {part['status']:<10} {part['seconds']:>4} {part['limit_s']:>5}  "
                     f"{(part['why'] or '')[:90]}")
    lines.append(f"limits total {report['time_limits_total_s']} s, elapsed {report['elapsed_s']} s")
    kernel = report.get("kernel")
    if kernel:
        lines.append(f"kernel: {kernel['passed']}/{kernel['total']} checks on {kernel['device']}; "
                     f"CUDA graph: {kernel.get('cuda_graph')}")
    runtime = report.get("runtime")
    if runtime:
        parity, lossless = runtime.get("parity", {}), runtime.get("lossless", {})
        lines.append(f"runtime: parity {'ok' if parity.get('ok') else 'NOT ok'} (rel {fmt(parity.get('relative'), '.1e')}"
                     f"), lossless {'ok' if lossless.get('ok') else 'NOT ok'}; copy component "
                     f"{'used' if lossless.get('copy_component_used') else 'NOT used'}")
        for label, row in lossless.items():
            if isinstance(row, dict) and "sd_equals_ar" in row:
                speed = row["tokens_per_s_after_warmup"]
                lines.append(f"  {label[:28]:<28} SD acc {fmt(row['sd_mean_accepted'])}, SSD hit "
                             f"{fmt(row['ssd_cache_hit_rate'])}, tok/s AR {fmt(speed['ar'], '.0f')} SD "
                             f"{fmt(speed['sd'], '.0f')} SSD {fmt(speed['ssd'], '.0f')}")
        graphs = [row for row in runtime.get("timing", []) if row["cuda_graphs"] and row["step"] == "decode"]
        if graphs:
            lines.append("  decode step with CUDA graph: " + ", ".join(f"{row['model']} {row['device_ms']:.2f} ms"
                                                                     for row in graphs))
    if report.get("pytest_gpu"):
        lines.append(f"pytest -m gpu: {report['pytest_gpu']}")
    pair = report.get("pair")
    if pair and pair.get("modes"):
        place = pair.get("placement", {})
        lines.append(f"pair ({pair.get('device')}, {pair.get('prompts_run', '?')} prompts x {pair['new_tokens']} tokens,"
                     f" target prioritized: {place.get('target_prioritized')}; load {pair.get('load_s')} s)")
        lines.append(f"  {'mode':<4} {'tok/s':>8} {'x AR':>5} {'accepted':>8} {'hit':>5} {'draft ms':>8} "
                     f"{'verify ms':>9} {'== AR':>6}")
        for mode, row in pair["modes"].items():
            lines.append(f"  {mode:<4} {fmt(row['tokens_per_s'], '.1f'):>8} {fmt(row.get('speedup_vs_ar')):>5} "
                         f"{fmt(row['mean_accepted']):>8} {fmt(row['cache_hit_rate']):>5} "
                         f"{fmt(row['draft_ms_per_round'], '.1f'):>8} {fmt(row['verify_ms_per_round'], '.1f'):>9} "
                         f"{row['equal_to_ar']:>6}")
        if pair.get("truncated"):
            lines.append(f"  truncated: {pair['truncated']}")
    not_run = f"; not run here: {', '.join(report['not_run'])}" if report["not_run"] else ""
    lines.append("session: " + ("ok (no part failed" if report["ok"] else
                                f"NOT ok ({', '.join(report['not_ok'])}") + not_run + ")")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the GPU session's JSON and print its summary.")
    parser.add_argument("--results", type=Path, required=True, help="the parts' folder (parts.tsv, logs, JSONs)")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--elapsed", type=int, help="the session's seconds so far")
    args = parser.parse_args(argv)
    report = session(args.results, args.smoke, args.elapsed)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print("\n".join(summary(report)))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
