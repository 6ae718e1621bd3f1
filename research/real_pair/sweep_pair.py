"""Decoding settings of the real pair side by side, paper-style (target on core 0; SSD's draft on core 1), greedy:
tokens/s, accepted tokens per round, hit rate, and exactness against AR. Run on the tuning split
(ssd_trt/bench/prompts/pair_tuning.jsonl) to choose the recipe's defaults; the benchmark reports on pair.jsonl.

    python research/real_pair/sweep_pair.py build/qwen2.5-coder-1.5b --out docs/bench/real_pair/sweep_tuning.json
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import ssd_trt
from ssd_trt.bench.__main__ import load_prompts
from ssd_trt.bench.runner import LoadedBuilds, run_engine, summarise
from ssd_trt.bench.settings import SETTINGS
from ssd_trt.decoding.settings import SD, SSD, as_settings

MODES = {"ar": as_settings("ar"), "sd K=2": SD(draft_len=2), "sd K=3": SD(draft_len=3), "ssd (default)": as_settings("ssd"),
         "ssd K=1 B=2": SSD(draft_len=1, fan_out_budget=2), "ssd K=2 B=1": SSD(draft_len=2, fan_out_budget=1),
         "ssd K=2 B=2": SSD(draft_len=2, fan_out_budget=2), "ssd K=3 B=1": SSD(draft_len=3, fan_out_budget=1),
         "ssd K=4 B=1": SSD(draft_len=4, fan_out_budget=1)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("build_dir", type=Path)
    p.add_argument("--prompts", default="ssd_trt/bench/prompts/pair_tuning.jsonl")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--setting", default="paper")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    builds, setting = LoadedBuilds(), SETTINGS[args.setting]
    prompts = load_prompts(args.prompts)
    probe = builds.get(args.build_dir, setting, "ar")
    encoded = [probe.encode(x.prompt, chat=True) for x in prompts]
    params = ssd_trt.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0, stop_on_eos=False)
    names = args.modes.split(",")
    for name in names:       # untimed warm-up: sessions opened, the adaptive policy's steps timed
        run_engine(builds, args.build_dir, setting, MODES[name], prompts[:1], encoded[:1], replace(params, max_new_tokens=8))
    results: dict[str, list] = {name: [] for name in names}
    reference = None
    for run in range(args.runs):
        for name in (names if run % 2 == 0 else names[::-1]):
            runs = run_engine(builds, args.build_dir, setting, MODES[name], prompts, encoded, params, label=name)
            if name == "ar" and reference is None:
                reference = runs
            results[name].append(runs)
    out = {}
    for name in names:
        summary = [summarise(r, reference) for r in results[name]]
        # decode phase: tokens after the first over the time after the first (TTFT, the prefill, left out)
        decode = [sum(len(x.tokens) - 1 for x in r) / sum(x.seconds - x.ttft_s for x in r) for r in results[name]]
        out[name] = {"tokens_per_s": [s["tokens_per_s"] for s in summary], "decode_tokens_per_s": decode,
                     "mean_accepted": summary[0].get("mean_accepted"),
                     "cache_hit_rate": summary[0].get("cache_hit_rate"), "exact_prompts": summary[0].get("exact_prompts"),
                     "draft_latency_s": summary[0].get("draft_latency_s"), "verify_latency_s": summary[0].get("verify_latency_s")}
        ar = out["ar"]["tokens_per_s"] if "ar" in out else None
        if ar:
            out[name]["vs_ar"] = [t / a for t, a in zip(out[name]["tokens_per_s"], ar)]
            out[name]["decode_vs_ar"] = [t / a for t, a in zip(decode, out["ar"]["decode_tokens_per_s"])]
        print(f"{name:14s} " + " ".join(f"{k}={v}" for k, v in out[name].items()), flush=True)
    record = {"build": str(args.build_dir), "prompts": args.prompts, "setting": setting.description,
              "max_new_tokens": args.max_new_tokens, "runs": args.runs, "results": out,
              "command": "python research/real_pair/sweep_pair.py " + " ".join(sys.argv[1:])}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
