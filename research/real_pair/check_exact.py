"""The quantized real pair's greedy SD and SSD equal its own AR, token for token.

Twenty prompts (pair.jsonl, pair_tuning.jsonl and the first five chat prompts of default.jsonl; chat template
applied), 48 new tokens past EOS. AR runs them in calls of 4 prompts (continuous batching, the reference) and the
first 4 one at a time; every speculative mode does the same, and each row is compared with the reference.

    python research/real_pair/check_exact.py build/qwen2.5-coder-1.5b --out docs/bench/real_pair/exact.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ssd_trt  # noqa: E402
from ssd_trt import SD, SSD  # noqa: E402
from record import build_info, default_chat_prompts, header, pair_prompts, write  # noqa: E402

MODES = {"sd (build default)": "sd", "sd K=2": SD(draft_len=2), "ssd (default, adaptive)": "ssd",
         "ssd K=1 B=2": SSD(draft_len=1, fan_out_budget=2), "ssd K=3 B=1": SSD(draft_len=3, fan_out_budget=1),
         "ssd K=4 B=2": SSD(draft_len=4, fan_out_budget=2), "sd tree (2, 2)": SD(tree_widths=(2, 2)),
         "sd tree (3, 2, 1)": SD(tree_widths=(3, 2, 1))}
STAT_KEYS = ("mode", "draft_len", "rounds", "mean_accepted", "acceptance_rate", "cache_hit_rate", "backup_rounds",
             "draft_failures", "fallback", "policy", "fan_out", "tokens_per_s", "elapsed_s")


def run(gen, mode, prompt_ids: list[list[int]], params, batch: int) -> tuple[list[list[int]], list[dict]]:
    """Every prompt's tokens, in calls of ``batch`` prompts; each call's statistics (shared by its rows)."""
    tokens, calls = [], []
    for start in range(0, len(prompt_ids), batch):
        results = gen.generate_ids(prompt_ids[start:start + batch], params, mode=mode)
        tokens += [list(r.token_ids) for r in results]
        calls.append({key: results[0].stats[key] for key in STAT_KEYS if key in results[0].stats}
                     | {"rows": len(results)})
    return tokens, calls


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def compare(prompts: list[dict], reference: list[list[int]], tokens: list[list[int]], tokenizer) -> dict:
    rows = []
    for prompt, ref, got in zip(prompts, reference, tokens):
        at = first_difference(ref, got)
        row = {"id": prompt["id"], "identical": at is None}
        if at is not None:
            row.update(first_difference=at, reference_token=ref[at] if at < len(ref) else None,
                       got_token=got[at] if at < len(got) else None,
                       reference_text=tokenizer.decode(ref[at:at + 8]), got_text=tokenizer.decode(got[at:at + 8]))
        rows.append(row)
    differing = [row for row in rows if not row["identical"]]
    return {"identical": len(rows) - len(differing), "total": len(rows),
            "first_differing": differing[0] if differing else None, "per_prompt": rows}


def weighted(calls: list[dict], key: str) -> float | None:
    """A statistic over every call, each call weighted by its rounds."""
    pairs = [(c[key], c.get("rounds") or 0) for c in calls if c.get(key) is not None]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("build_dir", type=Path)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--single", type=int, default=4, help="prompts also run one at a time (the first ones)")
    p.add_argument("--out", type=Path, default=Path("docs/bench/real_pair/exact.json"))
    args = p.parse_args()
    record = header()
    started = time.perf_counter()
    gen = ssd_trt.load(args.build_dir)
    prompts = pair_prompts() + default_chat_prompts(5)
    prompt_ids = [gen.encode(row["prompt"], chat=True) for row in prompts]
    params = ssd_trt.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0, stop_on_eos=False)
    single = slice(0, args.single)

    t = time.perf_counter()
    reference, ar_calls = run(gen, "ar", prompt_ids, params, args.batch)
    ar_single, _ = run(gen, "ar", prompt_ids[single], params, 1)
    print(f"ar: {time.perf_counter() - t:.0f} s", flush=True)
    results = {"ar": {"resolved": repr(gen.resolve("ar", params).settings),
                      "batch_1_vs_batch_%d" % args.batch: compare(prompts[single], reference[single], ar_single,
                                                                  gen.tokenizer),
                      "tokens_per_s_per_call": [c["tokens_per_s"] for c in ar_calls]}}
    for name, mode in MODES.items():
        t = time.perf_counter()
        resolved = gen.resolve(mode, params)
        batched, calls = run(gen, mode, prompt_ids, params, args.batch)
        one, one_calls = run(gen, mode, prompt_ids[single], params, 1)
        out = {"resolved": repr(resolved.settings), "adaptive": resolved.adaptive,
               f"batch_{args.batch}": compare(prompts, reference, batched, gen.tokenizer),
               "batch_1": compare(prompts[single], reference[single], one, gen.tokenizer),
               "mean_accepted": weighted(calls, "mean_accepted"), "cache_hit_rate": weighted(calls, "cache_hit_rate"),
               "mean_accepted_batch_1": weighted(one_calls, "mean_accepted"),
               "cache_hit_rate_batch_1": weighted(one_calls, "cache_hit_rate"),
               "calls": calls + one_calls, "wall_s": round(time.perf_counter() - t, 1)}
        results[name] = out
        print(f"{name}: batch {args.batch} {out[f'batch_{args.batch}']['identical']}/{out[f'batch_{args.batch}']['total']}"
              f", batch 1 {out['batch_1']['identical']}/{out['batch_1']['total']}, accepted/round "
              f"{out['mean_accepted']}, hit rate {out['cache_hit_rate']} ({out['wall_s']} s)", flush=True)
    record.update(
        build=str(args.build_dir), build_manifest=build_info(args.build_dir), target=gen.manifest.model("target").source,
        draft=gen.manifest.model("draft").source,
        what="greedy SD / SSD tokens against the same build's greedy AR (batched AR is the reference; every row "
             "compared), chat template applied, no EOS stop",
        max_new_tokens=args.max_new_tokens, batch=args.batch, single_prompts=[row["id"] for row in prompts[single]],
        prompts=[{"id": row["id"], "file": row["file"], "category": row["category"], "prompt_tokens": len(ids)}
                 for row, ids in zip(prompts, prompt_ids)],
        reference_tokens={row["id"]: ref for row, ref in zip(prompts, reference)},
        summary={name: {"identical": r[f"batch_{args.batch}"]["identical"], "total": r[f"batch_{args.batch}"]["total"],
                        "identical_batch_1": r["batch_1"]["identical"], "total_batch_1": r["batch_1"]["total"],
                        "mean_accepted": r["mean_accepted"], "cache_hit_rate": r["cache_hit_rate"]}
                 for name, r in results.items() if name != "ar"},
        results=results, wall_s=round(time.perf_counter() - started, 1))
    write(args.out, record)
    failed = [name for name, s in record["summary"].items()
              if s["identical"] != s["total"] or s["identical_batch_1"] != s["total_batch_1"]]
    ar_ok = results["ar"][f"batch_1_vs_batch_{args.batch}"]
    if ar_ok["identical"] != ar_ok["total"]:
        failed.append("ar batch 1 vs batched")
    print("all identical" if not failed else f"differences in: {', '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
