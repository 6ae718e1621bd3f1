"""SSD cache hit rate at temperature 0 on the project's prompt set, by draft length K and fan-out budget B.

    python research/draft/measure_hit_rate.py build/smollm2-135m --prompts 108 --tokens 64 --k 1,2 --budget 16,24

Greedy SSD on round-robin prompts of every category (chat template), one request at a time; prints
and writes (``--out``) the pooled hit rate (hits / rounds) and mean accepted tokens per round, with
the placement of the benchmark's paper-style setting (target on core 0, draft on core 1). Every
output is also checked token-identical to AR.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import ssd_trt  # noqa: E402
from ssd_trt.bench.prompts import round_robin  # noqa: E402
from ssd_trt.bench.runner import LoadedBuilds, run_engine  # noqa: E402
from ssd_trt.bench.settings import PAPER_STYLE  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build_dir", type=Path)
    ap.add_argument("--prompts", type=int, default=108, help="round-robin over categories (108: the whole set)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", default="1,2")
    ap.add_argument("--budget", default="16,24")
    ap.add_argument("--ssd", action="append", default=None, metavar="JSON",
                    help='SSD options to compare, e.g. \'{"fork_policy": "geometric", "lookup_forks": 0}\' '
                         '(repeatable; default: the build\'s own)')
    ap.add_argument("--out", type=Path, default=Path("runs/hit_rate.json"))
    a = ap.parse_args()
    prompts = round_robin(a.prompts)
    params = ssd_trt.SamplingParams(max_new_tokens=a.tokens)
    encoded = [ssd_trt.load(a.build_dir).encode(p.prompt, chat=True) for p in prompts]
    builds = LoadedBuilds()
    reference = run_engine(builds, a.build_dir, PAPER_STYLE, ssd_trt.AR(), prompts, encoded, params)
    rows = []
    variants = [json.loads(v) for v in a.ssd] if a.ssd else [{}]
    for variant, k, budget in itertools.product(variants, (int(x) for x in a.k.split(",")),
                                                (int(x) for x in a.budget.split(","))):
        started = time.perf_counter()
        runs = run_engine(builds, a.build_dir, PAPER_STYLE, ssd_trt.SSD(draft_len=k, fan_out_budget=budget, **variant),
                          prompts, encoded, params, label=f"ssd K={k} B={budget} {variant}")
        # pooled over rounds (hits / rounds), not a mean of per-prompt rates
        rounds = sum(r.stats["rounds"] for r in runs)
        hits = sum((r.stats["cache_hit_rate"] or 0.0) * r.stats["rounds"] for r in runs)
        accepted = sum((r.stats["mean_accepted"] or 0.0) * r.stats["rounds"] for r in runs)
        exact = sum(r.tokens == ref.tokens for r, ref in zip(runs, reference))
        rows.append({"k": k, "budget": budget, **variant, "cache_hit_rate": hits / rounds,
                     "mean_accepted": accepted / rounds, "rounds": int(rounds), "exact": f"{exact}/{len(prompts)}",
                     "seconds": round(time.perf_counter() - started, 1)})
        print(json.dumps(rows[-1]), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"prompts": len(prompts), "tokens": a.tokens, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
