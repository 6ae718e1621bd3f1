"""What masking the draft by the grammar buys: acceptance and time per request under a JSON schema, SD and SSD, with
the draft masked (the default) and with only the target masked (``SamplingParams(mask_draft=False)``), side by side,
interleaved in one run; every output checked equal to AR's (greedy).

    .venv/bin/python research/serving/structured_acceptance.py build/smollm2-135m \
        --out docs/bench/structured_acceptance.json
    .venv/bin/python research/serving/structured_acceptance.py build/qwen2.5-coder-1.5b --chat \
        --out docs/bench/structured_acceptance_real_pair.json

Each prompt runs alone (its own statistics), greedy, ``--max-tokens`` under the schema below. sd and ssd run with the
build's default K and budget set explicitly, so that SSD's load policy does not adapt them (or pause speculation)
from one run to the next: every run speculates every round, and the acceptances compare. ``ssd-default`` is what a
request gets with no flags: SSD under its load policy, which may pause speculation when it does not pay (its
acceptance counts the rounds that speculated). The order of (mode,
masked) alternates per prompt. Run it on an otherwise idle machine (the tok/s are side by side, not absolute).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import ssd_trt  # noqa: E402
from ssd_trt import SD, SSD  # noqa: E402
from ssd_trt.bench.artifact import write_artifact  # noqa: E402
from ssd_trt.decoding.grammar import Grammar  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "year", "genres", "rating"],
          "properties": {"title": {"type": "string", "maxLength": 40}, "year": {"type": "integer"},
                         "genres": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
                         "rating": {"type": "number"}}}
PROMPTS = ["Describe a classic science-fiction film as JSON.", "Give a film released in the 1990s as JSON.",
           "A comedy film, as a JSON object.", "Return JSON for an animated movie.",
           "A film about the sea, described as JSON.", "JSON for a thriller set in Paris.",
           "Describe a documentary as JSON.", "A musical film as JSON."]
MODES = ("sd", "ssd", "ssd-default")


def run(args: argparse.Namespace) -> dict[str, Any]:
    gen = ssd_trt.load(args.build)
    sd, ssd = gen.resolve("sd").settings, gen.resolve("ssd").settings
    modes = {"sd": SD(draft_len=sd.draft_len), "ssd": SSD(draft_len=ssd.draft_len, fan_out_budget=ssd.fan_out_budget),
             "ssd-default": "ssd"}
    warm = gen.encode("Hello", chat=args.chat)       # both engines opened and warm before anything is timed
    for mode in modes.values():
        gen.generate_ids([warm], ssd_trt.SamplingParams(max_new_tokens=8, grammar=Grammar.json_schema(SCHEMA)),
                         mode=mode)
    rows: list[dict[str, Any]] = []
    for index, prompt in enumerate(PROMPTS):
        ids = gen.encode(prompt, chat=args.chat)
        base = ssd_trt.SamplingParams(max_new_tokens=args.max_tokens, grammar=Grammar.json_schema(SCHEMA))
        [ar] = gen.generate_ids([ids], base, mode="ar")
        json.loads(ar.text)                          # (a schema-valid answer unless it ran out of tokens)
        order = [(mode, masked) for mode in MODES for masked in (True, False)]
        for mode, masked in order if index % 2 == 0 else order[::-1]:
            params = ssd_trt.SamplingParams(max_new_tokens=args.max_tokens, grammar=Grammar.json_schema(SCHEMA),
                                            mask_draft=masked)
            started = time.perf_counter()
            [out] = gen.generate_ids([ids], params, mode=modes[mode])
            seconds = time.perf_counter() - started
            rows.append({"prompt": index, "mode": mode, "draft_masked": masked, "seconds": seconds,
                         "tokens": len(out.token_ids), "equal_to_ar": out.token_ids == ar.token_ids,
                         "acceptance_rate": out.stats["acceptance_rate"], "mean_accepted": out.stats["mean_accepted"],
                         "cache_hit_rate": out.stats["cache_hit_rate"]})
            print(f"prompt {index} {mode} masked={masked}: acceptance {out.stats['acceptance_rate']}, "
                  f"{seconds:.2f}s, equal {rows[-1]['equal_to_ar']}", file=sys.stderr, flush=True)
    summary = {}
    for mode in MODES:
        for masked in (True, False):
            mine = [r for r in rows if r["mode"] == mode and r["draft_masked"] == masked]
            summary[f"{mode} draft {'masked' if masked else 'unmasked'}"] = {
                "acceptance_rate": statistics.mean(r["acceptance_rate"] or 0.0 for r in mine),
                "mean_accepted": statistics.mean(r["mean_accepted"] or 0.0 for r in mine),
                "tokens_per_s": sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine),
                "all_equal_to_ar": all(r["equal_to_ar"] for r in mine)}
    return {"build": Path(args.build).name, "settings": {name: repr(m) for name, m in modes.items()}, "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "machine": platform.processor() or platform.machine(), "max_tokens": args.max_tokens, "schema": SCHEMA,
            "prompts": PROMPTS, "summary": summary, "runs": rows}


def table(result: dict[str, Any]) -> str:
    lines = ["| mode, draft | acceptance | accepted / round | tok/s | equal to AR |", "|---|---|---|---|---|"]
    for name, s in result["summary"].items():
        lines.append(f"| {name} | {s['acceptance_rate']:.3f} | {s['mean_accepted']:.2f} | {s['tokens_per_s']:.1f} | "
                     f"{s['all_equal_to_ar']} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], png: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(result["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, key, label in ((axes[0], "acceptance_rate", "acceptance rate"), (axes[1], "tokens_per_s", "tokens / s")):
        values = [result["summary"][n][key] for n in names]
        ax.bar(range(len(names)), values, color=["tab:blue", "tab:gray"] * len(MODES))
        ax.set_xticks(range(len(names)), [n.replace(" draft ", "\n") for n in names])
        ax.set_ylabel(label)
    fig.suptitle(f"{result['build']}: JSON schema, greedy, draft masked by the grammar or not")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build", type=Path)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chat", action="store_true", help="encode the prompts through the chat template")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/bench/structured_acceptance.json")
    result = run(parser.parse_args(argv))
    write_artifact(result, parser.parse_args(argv).out, plot, table)
    return 0 if all(s["all_equal_to_ar"] for s in result["summary"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
