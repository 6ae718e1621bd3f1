"""``python -m ssd_trt.bench.report results.json``: the benchmark tables (README, docs/benchmarks.md), rendered from a benchmark's results.

Every number in the README's and docs/benchmarks.md's results comes from this output (nothing is typed by hand).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLUMNS = ("mode", "tok/s", "TTFT s", "2-token s", "accepted/round", "cache hit", "draft ms/round",
           "verify ms/round", "exact", "×AR", "×SD", "×HF AR", "×HF assisted", "×llama.cpp (binding)", "×llama-bench",
           "% of ceiling (decode phase)")


def _cell(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def row(mode: str, s: dict) -> str:
    exact = "–" if s.get("exact_prompts") is None else f"{s['exact_prompts']}/{s['prompts']}"
    ms = (lambda v: None if v is None else 1e3 * v)   # noqa: E731
    cells = [mode, _cell(s.get("tokens_per_s"), ".1f"), _cell(s.get("ttft_s"), ".3f"),
             _cell(s.get("two_token_latency_s"), ".3f"), _cell(s.get("mean_accepted"), ".2f"),
             _cell(s.get("cache_hit_rate"), ".2f"), _cell(ms(s.get("draft_latency_s")), ".1f"),
             _cell(ms(s.get("verify_latency_s")), ".1f"), exact, _cell(s.get("speedup_vs_ar"), ".2f"),
             _cell(s.get("speedup_vs_sd"), ".2f"), _cell(s.get("speedup_vs_hf_ar"), ".2f"),
             _cell(s.get("speedup_vs_hf_assisted"), ".2f"), _cell(s.get("speedup_vs_llama_cpp"), ".2f"),
             _cell(s.get("speedup_vs_llama_bench"), ".2f"),
             _cell(None if s.get("ceiling_fraction") is None else 100 * s["ceiling_fraction"], ".1f")
             + ("" if s.get("decode_ceiling_fraction") is None else f" ({100 * s['decode_ceiling_fraction']:.1f})")]
    return "| " + " | ".join(cells) + " |"


def tables(report: dict) -> str:
    out = []
    for preset, entry in report["presets"].items():
        params = entry["params"]
        label = "greedy" if params["temperature"] == 0 else \
            f"T={params['temperature']:g}" + (f", top-p {params['top_p']:g}" if params["top_p"] < 1 else "") + \
            (f", top-k {params['top_k']}" if params["top_k"] else "")
        for setting, outcome in entry["settings"].items():
            chosen = outcome.get("chosen", {})
            picks = ", ".join(f"{k} {v}" for k, v in chosen.items())
            how = report["config"].get("k_and_budget", "tuned on the tuning split")
            out += [f"**{label} — {setting}** ({outcome['setting']}; {how}: {picks})", "",
                    "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
            out += [row(mode, s) for mode, s in outcome["summary"].items()]
            vs_hf = outcome["summary"].get("ar", {}).get("agreement_with_transformers")
            if vs_hf:
                out += ["", f"AR against transformers' greedy on the fp32 model (the independent reference): "
                            f"{vs_hf['identical_prompts']}/{vs_hf['prompts']} outputs identical, mean agreeing prefix "
                            f"{vs_hf['mean_agreeing_prefix']:.3f}."]
            out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd_trt.bench.report", description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.results.read_text())
        print(tables(report))
    except (OSError, ValueError, KeyError) as error:
        print(f"ssd_trt.bench.report: error: {args.results} is not a benchmark results.json ({error})",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
