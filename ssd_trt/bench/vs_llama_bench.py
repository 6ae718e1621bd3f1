"""``python -m ssd_trt.bench.vs_llama_bench BUILD_DIR``: this engine's decode speed against llama.cpp's own
``llama-bench``, interleaved round by round, so the ratio holds while a shared machine's speed drifts.

Each round runs, back to back: ``llama-bench -p 0 -n N -d D -r 1`` on 1 thread (core 0) and on 2 threads (both
cores); then this engine on the measured prompts (chat template, N new tokens each, EOS ignored): AR on one
thread (core 0) and on two, and SSD at the build's defaults with its default placement (target core 0, draft
core 1: both cores, so it is also held against llama-bench on 2 threads), greedy, T=0.7 / top-p 0.9 and
T=1 / top-k 50. This engine's figure is its decode rate, the tokens after the first over the time after the
first (llama-bench's ``-p 0`` times generation only); D is the prompts' mean length.
Reports every round and the median ratio; writes JSON (``--out``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import ssd_trt
from ssd_trt.bench import llama_bench
from ssd_trt.bench.prompts import DEFAULT_PROMPTS, load_prompts
from ssd_trt.bench.settings import EQUAL_CORES, PAPER_STYLE

ENGINE_ROWS = {   # label: (mode, options, sampling)
    "ar_1t": ("ar", ssd_trt.RuntimeOptions(target_cores=(0,), draft_cores=(0,)), {}),
    # AR alone on both cores: its session spins (as the bench's equal-cores AR)
    "ar_2t": ("ar", ssd_trt.RuntimeOptions(target_threads=2, target_cores=(0, 1), draft_cores=(0, 1), spin=True), {}),
    "ssd_greedy": ("ssd", ssd_trt.RuntimeOptions(), {}),
    "ssd_t0.7_p0.9": ("ssd", ssd_trt.RuntimeOptions(), {"temperature": 0.7, "top_p": 0.9}),
    "ssd_t1_k50": ("ssd", ssd_trt.RuntimeOptions(), {"temperature": 1.0, "top_k": 50}),
}


def decode_rate(generator, mode: str, prompts: list[list[int]], params) -> float:
    """Tokens after the first per second after the first, over all prompts."""
    tokens, seconds = 0, 0.0
    for ids in prompts:
        [result] = generator.generate_ids([ids], params, mode=mode)
        tokens += len(result.token_ids) - 1
        seconds += result.stats["elapsed_s"] - result.stats["ttft_s"]
    return tokens / seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ssd_trt.bench.vs_llama_bench", description=__doc__.splitlines()[0])
    p.add_argument("build_dir", type=Path)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompts", type=int, default=5, help="measured prompts (default.jsonl, in order)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("runs/vs_llama_bench.json"))
    args = p.parse_args(argv)
    reason = llama_bench.unavailable_reason("llama_bench")
    if reason:
        print(f"ssd_trt.bench.vs_llama_bench: error: {reason}", file=sys.stderr)
        return 2
    generators = {label: ssd_trt.load(args.build_dir, options) for label, (_, options, _) in ENGINE_ROWS.items()}
    any_gen = next(iter(generators.values()))
    gguf = Path(any_gen.manifest.model("target").source)
    prompts = [any_gen.encode(q.prompt, chat=True) for q in load_prompts(DEFAULT_PROMPTS)[:args.prompts]]
    depth = round(statistics.mean(len(ids) for ids in prompts))
    rounds = []
    for index in range(args.rounds + 1):           # round 0 warms every engine up and is not counted
        row = {f"llama_bench_{s.single_threads}t": llama_bench.run_llama_bench(gguf, s, args.new_tokens, depth)
               ["tokens_per_s"] for s in (PAPER_STYLE, EQUAL_CORES)}
        for label, (mode, _, sampling) in ENGINE_ROWS.items():
            params = ssd_trt.SamplingParams(max_new_tokens=args.new_tokens, stop_on_eos=False, seed=index, **sampling)
            row[label] = decode_rate(generators[label], mode, prompts, params)
        if index:
            rounds.append(row)
            print(f"round {index}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    ratios = {}
    for label in ENGINE_ROWS:
        base = "llama_bench_2t" if label == "ar_2t" else "llama_bench_1t"
        ratios[f"{label}_vs_{base}"] = statistics.median(r[label] / r[base] for r in rounds)
    ratios.update({f"{label}_vs_ar_1t": statistics.median(r[label] / r["ar_1t"] for r in rounds)
                   for label in ENGINE_ROWS if label.startswith("ssd")})
    ratios["ssd_greedy_vs_llama_bench_2t"] = statistics.median(r["ssd_greedy"] / r["llama_bench_2t"] for r in rounds)
    medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    report = {"build_dir": str(args.build_dir), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "prompts": args.prompts, "depth": depth, "new_tokens": args.new_tokens,
              "ssd_defaults": {"greedy": any_gen.decoding_defaults(ssd_trt.SamplingParams()).model_dump(),
                               "sampled": any_gen.decoding_defaults(ssd_trt.SamplingParams(temperature=1)).model_dump()},
              "median_tokens_per_s": medians, "median_ratios": ratios, "rounds": rounds}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    for key, value in ratios.items():
        print(f"{key:34s} {value:.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
