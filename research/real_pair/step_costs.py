"""Step times of a build's two models on one core against the bytes each reads per token: where the time of an SD
and an SSD round goes on this CPU (docs/real_pair.md, "Speed on this CPU").

    python research/real_pair/step_costs.py build/qwen2.5-coder-1.5b [OTHER_BUILD ...] --out docs/bench/real_pair/step_costs.json

Each model's step of T new tokens (T = 1, 2, 4, 8) on one row holding 128 tokens, median of 5, one thread pinned to
core 0 (the other core idle); bytes per token = the ONNX Runtime graph's weight bytes less the embedding (a step reads
one row of it), from the build's weights.bin and the manifest's quantization record."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import ssd_trt
from ssd_trt.batching.costs import timed_steps
from ssd_trt.manifest import read_manifest
from ssd_trt.runtime import RuntimeOptions

TOKENS = [1, 2, 4, 8]


def bytes_per_token(build: Path, role: str) -> int:
    """Bytes of the role's weight file less its fp32 embedding (only one row of which a step reads)."""
    config = read_manifest(build).model(role).config
    return (build / role / "weights.bin").stat().st_size - config.vocab_size * config.hidden_size * 4


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("builds", nargs="+", type=Path)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    os.sched_setaffinity(0, {0})
    record = {"command": "python research/real_pair/step_costs.py " + " ".join(sys.argv[1:]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": f"{platform.machine()} {platform.processor()}", "context": args.context, "builds": {}}
    for build in args.builds:
        gen = ssd_trt.load(build, RuntimeOptions(target_threads=1, draft_threads=1, target_cores=(0,),
                                                 draft_cores=(0,)))
        out = {}
        for role in ("target", "draft"):
            steps = timed_steps(gen.engine(role), 1, TOKENS, context=args.context, repeats=5)
            size = bytes_per_token(build, role)
            out[role] = {"seconds_by_tokens": steps, "weight_bytes_per_token": size,
                         "gb_per_s_at_one_token": size / steps[1] / 1e9,
                         "weights": read_manifest(build).recipe.model_dump()[role]["weights"]}
            print(f"{build.name} {role}: " + ", ".join(f"T={t} {s * 1e3:.1f} ms" for t, s in steps.items())
                  + f"; {size / 1e6:.0f} MB/token, {size / steps[1] / 1e9:.1f} GB/s", flush=True)
        out["draft_over_target_one_token"] = out["draft"]["seconds_by_tokens"][1] / out["target"]["seconds_by_tokens"][1]
        record["builds"][str(build)] = out
        del gen
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
