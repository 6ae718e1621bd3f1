#!/usr/bin/env python
"""Measure the build of a real-size pair on this host: time, peak resident memory, what was checked.

Writes random-weight checkpoints of a real pair's exact shapes (sharded bf16 safetensors, as released
checkpoints come), a recipe, runs ``python -m ssd_trt.build`` on it under ``/usr/bin/time -v`` and records
the build's wall time, its peak resident set (the kernel's count for the whole build process, TensorRT for RTX
included) against the checkpoint's bytes, the manifest's memory plan, checks and artifact sizes, in one JSON.

    python research/real_size/measure_real_size_build.py --pair llama-1b --out docs/bench/real_size/llama_1b_ort.json
    python research/real_size/measure_real_size_build.py --pair llama-1b --tensorrt rtx --out .../llama_1b_rtx.json
    python research/real_size/measure_real_size_build.py --pair llama-3.1-8b \
        --out docs/bench/real_size/llama_8b_ort.json
    python research/real_size/measure_real_size_build.py --pair llama-1b --tensorrt rtx --tensor-parallel 2 --out ...

``--tensor-parallel N`` splits the target over N ranks (``engine.tensor_parallel``: a step graph, weight file and
plan per rank; research/real_size/compare_tp_build.py runs 1 and 2 back to back).

``--record-only`` reads a finished ``--work`` directory (its ``build.log`` from the same command) instead of
building again. Pairs: ``llama-1b`` (the Llama-3.2-1B body with SmolLM2's 49152-token vocabulary, 3 shards;
its draft: its own first 2 layers), ``llama-3.1-8b`` (recipes/gpu/llama31-8b_llama32-1b.yaml's pair: the
Llama-3.1-8B and Llama-3.2-1B configs, 4 shards + 1).
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from paper_pair_gpu_bench import PRESETS  # noqa: E402  (this folder's GPU bench: the pair shapes)
from ssd_trt.models.checkpoint import Checkpoint  # noqa: E402
from tests.helpers import LLAMA_1B_BODY, cut_copy, write_random_checkpoint  # noqa: E402

PAIRS = {"llama-1b": (LLAMA_1B_BODY, None, 3), "llama-3.1-8b": (*PRESETS["llama-3.1-8b/llama-3.2-1b"], 4)}


def write_pair(pair: str, work: Path) -> None:
    target_config, draft_config, shards = PAIRS[pair]
    write_random_checkpoint(target_config, work / "target", shards=shards, seed=0)
    if draft_config is None:
        cut_copy(work / "target", work / "draft", layers=2)
    else:
        write_random_checkpoint(draft_config, work / "draft", shards=1, seed=1)


def write_recipe(pair: str, work: Path, tensorrt: str, tensor_parallel: int = 1) -> Path:
    engine = ({"backend": "ort", "max_batch": 2, "max_context": 512, "max_draft_len": 4, "max_tree_size": 64}
              if pair == "llama-1b" else
              {"backend": "auto", "max_batch": 8, "max_context": 4096, "max_draft_len": 6, "max_tree_size": 64})
    engine.update({"tensorrt": tensorrt, "trt_precision": "bf16"})
    if tensorrt == "rtx":
        engine["backend"] = "auto"
    if tensor_parallel > 1:
        engine["tensor_parallel"] = tensor_parallel
    recipe = {"name": f"{pair}-random", "output_dir": str(work / "build"),
              "target": {"source": str(work / "target"), "weights": "int4", "activations": "int8"},
              "draft": {"source": str(work / "draft"), "weights": "int8" if pair == "llama-1b" else "int4",
                        "activations": "int8"},
              "engine": engine,
              "decoding": {"sd_draft_len": 2, "ssd_draft_len": 1, "ssd_fan_out_budget": 8} if pair == "llama-1b"
              else {"sd_draft_len": 4, "ssd_draft_len": 4, "ssd_fan_out_budget": 8}}
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def time_log_fields(text: str) -> dict:
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text).group(1)
    seconds = sum(float(part) * 60 ** i for i, part in enumerate(reversed(wall.split(":"))))
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    status = int(re.search(r"Exit status: (\d+)", text).group(1))
    return {"wall_seconds": round(seconds, 1), "peak_rss_bytes": rss_kb * 1024, "exit_status": status}


def record(pair: str, work: Path, command: str, tensorrt: str, tensor_parallel: int = 1) -> dict:
    log = (work / "build.log").read_text()
    measured = time_log_fields(log)
    checkpoint = Checkpoint.open(work / "target")
    draft = Checkpoint.open(work / "draft")
    checkpoint_bytes = sum(p.stat().st_size for p in (work / "target").glob("*.safetensors"))
    pair_bytes = checkpoint_bytes + sum(p.stat().st_size for p in (work / "draft").glob("*.safetensors"))
    result = {"pair": pair, "command": command, "tensorrt": tensorrt, "tensor_parallel": tensor_parallel,
              "host": platform.processor() or platform.machine(),
              "cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                           if line.startswith("model name")), None),
              "target_params": checkpoint.num_params, "draft_params": draft.num_params,
              "target_checkpoint_bytes": checkpoint_bytes, "pair_checkpoint_bytes": pair_bytes,
              "target_shards": len(checkpoint.shards), **measured,
              "peak_rss_over_target_checkpoint": round(measured["peak_rss_bytes"] / checkpoint_bytes, 2),
              "peak_rss_over_pair_checkpoints": round(measured["peak_rss_bytes"] / pair_bytes, 2)}
    manifest_path = work / "build" / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        result.update(
            build_seconds_in_manifest=manifest["build_seconds"], host_memory=manifest["host_memory"],
            validation={k: {f: v.get(f) for f in ("passed", "max_abs_error", "scope", "shapes", "ort_graph")}
                        for k, v in manifest["validation"].items()},
            parity={role: {f: m["parity_vs_transformers"].get(f) for f in ("max_abs_diff", "logit_scale", "scope")}
                    for role, m in manifest["models"].items()},
            quantization={role: m["quantization"] for role, m in manifest["models"].items()},
            tensorrt={k: v for k, v in manifest["tensorrt"].items() if k != "plans"},
            plans=[{f: p.get(f) for f in ("role", "rank", "edition", "bytes", "precision", "compute_capabilities",
                                          "build_seconds", "collective_layers")}
                   for p in manifest["tensorrt"]["plans"]],
            tensor_parallel_split=manifest.get("tensor_parallel"),
            artifacts={a["path"]: a["bytes"] for a in manifest["artifacts"] if a["role"] != "tokenizer"})
    else:
        result["error_tail"] = log[-3000:]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), required=True)
    parser.add_argument("--tensorrt", choices=("none", "rtx", "datacenter"), default="none",
                        help="TensorRT flavour to export too (rtx: and build its plans here, on the CPU)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="split the target over N ranks (engine.tensor_parallel)")
    parser.add_argument("--work", type=Path, help="where checkpoints and the build go (default /tmp/ssd-trt-<pair>)")
    parser.add_argument("--record-only", action="store_true", help="record a finished --work directory")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    work = args.work or Path(f"/tmp/ssd-trt-{args.pair}")
    command = f"python research/real_size/measure_real_size_build.py --pair {args.pair} --tensorrt {args.tensorrt}" + \
        (f" --tensor-parallel {args.tensor_parallel}" if args.tensor_parallel > 1 else "")
    if not args.record_only:
        work.mkdir(parents=True, exist_ok=True)
        started = time.time()
        if not (work / "target").is_dir():
            write_pair(args.pair, work)
        print(f"checkpoints ready in {time.time() - started:.0f} s", file=sys.stderr)
        recipe = write_recipe(args.pair, work, args.tensorrt, args.tensor_parallel)
        with open(work / "build.log", "w") as log:
            subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "ssd_trt.build", str(recipe), "--force"],
                           stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    result = record(args.pair, work, command, args.tensorrt, args.tensor_parallel)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("wall_seconds", "peak_rss_bytes", "exit_status",
                                             "peak_rss_over_target_checkpoint")}))
    return result["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
