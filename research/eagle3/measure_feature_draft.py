"""A draft's first-token agreement and the exactness of greedy SD / SSD on the real pair, measured.

    python research/eagle3/measure_feature_draft.py build/smollm2-135m-eagle3 --out docs/bench/eagle3.json

* agreement: greedy SD with K = 1 on the target's own path: every round proposes one token and the target
  accepts it exactly when it is the target's greedy token, so the pooled acceptance over all rounds is the
  draft's first-token agreement on the generated path (issue 19's acceptance measure). Over the shipped
  prompt set (``ssd_trt/bench/prompts/default.jsonl``) with the chat template, and as plain text (the same
  prompts, no template: text continued as a new user would) plus its ``prose`` category alone.
* exactness: greedy AR, SD and SSD (the build's defaults) on the first N prompts (round robin over the
  categories), chat template, T new tokens each: every SD and SSD output must equal AR's, token for token.

Timing is not measured here (``python -m ssd_trt.bench`` does that); the runs may share the machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def pooled_acceptance(stats: list[dict]) -> tuple[float, int]:
    """Accepted tokens per round pooled over every round of every request (K = 1: the agreement)."""
    stats = [s for s in stats if s["rounds"]]        # a request that ended at its first token had no round
    rounds = sum(s["rounds"] for s in stats)
    return sum(s["mean_accepted"] * s["rounds"] for s in stats) / max(rounds, 1), rounds


def agreement(gen, prompts, chat: bool, new_tokens: int, label: str) -> dict:
    import ssd_trt
    params = ssd_trt.SamplingParams(max_new_tokens=new_tokens)
    stats, by_category = [], {}
    for prompt in tqdm(prompts, desc=f"agreement {label}", unit="prompt", file=sys.stderr):
        [result] = gen.generate_ids([gen.encode(prompt.prompt, chat=chat)], params, mode="sd")
        stats.append(result.stats)
        by_category.setdefault(prompt.category, []).append(result.stats)
    value, rounds = pooled_acceptance(stats)
    return {"prompts": len(prompts), "chat_template": chat, "new_tokens": new_tokens, "first_token_agreement": value,
            "rounds": rounds, "per_category": {c: pooled_acceptance(s)[0] for c, s in sorted(by_category.items())}}


def exactness(gen, prompts, new_tokens: int) -> dict:
    import ssd_trt
    params = ssd_trt.SamplingParams(max_new_tokens=new_tokens, stop_on_eos=False)
    differing = {"sd": [], "ssd": []}
    hits, rounds, accepted = [], [], []
    for index, prompt in enumerate(tqdm(prompts, desc="exactness", unit="prompt", file=sys.stderr)):
        ids = gen.encode(prompt.prompt, chat=True)
        [reference] = gen.generate_ids([ids], params, mode="ar")
        for mode in differing:
            [result] = gen.generate_ids([ids], params, mode=mode)
            if result.token_ids != reference.token_ids:
                differing[mode].append(index)
            if mode == "ssd":
                hits.append(result.stats["cache_hit_rate"])
                rounds.append(result.stats["rounds"])
                accepted.append(result.stats["mean_accepted"])
    return {"prompts": len(prompts), "new_tokens": new_tokens, "chat_template": True,
            "differing_from_ar": differing, "exact": not any(differing.values()),
            "ssd_cache_hit_rate_mean": sum(h for h in hits if h is not None) / max(1, len(hits)),
            "ssd_mean_accepted": sum(a * r for a, r in zip(accepted, rounds) if r) / max(1, sum(rounds))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--agreement-tokens", type=int, default=64)
    parser.add_argument("--agreement-prompts", type=int, default=None, help="the first N of each category (default: all)")
    parser.add_argument("--exact-prompts", type=int, default=50)
    parser.add_argument("--exact-tokens", type=int, default=64)
    parser.add_argument("--skip", default="", help="comma list of parts to skip: agreement, exactness")
    args = parser.parse_args()
    import ssd_trt
    from ssd_trt.bench.prompts import load_prompts, round_robin
    from ssd_trt.runtime import RuntimeOptions
    started = time.time()
    prompts = load_prompts()
    if args.agreement_prompts:        # round robin: the first N of each category
        prompts = round_robin(args.agreement_prompts * len({p.category for p in prompts}), prompts)
    result: dict = {"build": str(args.build), "command": " ".join(sys.argv)}
    if "agreement" not in args.skip:
        gen = ssd_trt.load(args.build, RuntimeOptions(draft_len=1))
        result["agreement"] = {
            "chat": agreement(gen, prompts, True, args.agreement_tokens, "chat"),
            "plain": agreement(gen, prompts, False, args.agreement_tokens, "plain"),
            "plain_prose": agreement(gen, [p for p in prompts if p.category == "prose"], False,
                                     args.agreement_tokens, "prose")}
    if "exactness" not in args.skip:
        result["exactness"] = exactness(ssd_trt.load(args.build), round_robin(args.exact_prompts), args.exact_tokens)
    result["seconds"] = round(time.time() - started, 1)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if result.get("exactness", {}).get("exact", True) else 1


if __name__ == "__main__":
    sys.exit(main())
