"""Drafts with different weights on the same target: step time and SD acceptance.

    python research/cpu/measure_draft_weights.py build/smollm2-135m build/smollm2-135m-int4draft \
        --out docs/bench/draft_weights.json

Per build: the draft's decode (1 token) and 3-token step times on one core (research/cpu/measure_weights.py's
step timing) and greedy SD's mean accepted tokens per round over 30 round-robin prompts x 32 tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # measure_weights.py, next to this one
from measure_weights import step_times  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "draft_weights.json")
    args = parser.parse_args()
    import ssd_trt
    from ssd_trt.bench.prompts import round_robin
    report = {"date": time.strftime("%Y-%m-%d"), "prompts": 30, "tokens": 32, "builds": {}}
    for build in args.builds:
        steps = step_times(build, 1, role="draft")
        gen = ssd_trt.load(build)
        accepted = [gen.generate_ids([gen.encode(p.prompt, chat=True)], ssd_trt.SamplingParams(max_new_tokens=32),
                                     mode="sd")[0].stats["mean_accepted"] for p in round_robin(30)]
        report["builds"][str(build)] = {"draft_weights": gen.manifest.recipe.draft.weights,
                                        "draft_decode_ms": steps["decode_ms"], "draft_3_token_ms": steps["verify3_ms"],
                                        "sd_mean_accepted": float(np.mean(accepted))}
        print(build, report["builds"][str(build)], flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
