"""``python -m ssd_trt.bench.interleaved BUILD_DIR``: modes as a user gets them, against AR, in interleaved runs.

Each mode is given by name (``ssd``: the default mode, which adapts K, the budget and the round kind to what it
measures; ``sd``: SD at the build's K) or as a hand-picked setting (``ssd-k2-b1``: SSD at K=2 with a fan-out budget
of 1; ``sd-k3``: SD at K=3), under one hardware setting (``--setting``, default equal cores: AR may use
both cores; SSD's target uses the draft's core whenever the draft is idle). Every run times each mode over the same
prompts, batch 1, the modes' order alternating from run to run, so the machine's drift (up to 2x within minutes on
the shared machines this runs on) falls on every mode alike. Reported per preset: each run's tokens/s per mode, each
run's ratio to AR, and their medians; with hand-picked settings beside ``ssd``, also the default's ratio to the
fastest of them in each run (``ssd_vs_best_hand_picked``). A long-lived process is what is measured: each mode's engines are opened, and
the adaptive policy's step times taken, on one untimed tuning prompt first. Every request generates exactly
``--max-new-tokens`` (EOS ignored): sampled modes draw other texts than AR, and texts of other lengths would weigh
the prompts' prefill differently.

Writes a JSON artifact (``--out``) and a PNG of the per-run ratios beside it.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import re
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from ssd_trt.bench.artifact import pyplot, write_artifact
from ssd_trt.bench.prompts import DEFAULT_PROMPTS, TUNING_PROMPTS, load_prompts
from ssd_trt.bench.runner import LoadedBuilds, run_engine, summarise
from ssd_trt.bench.settings import PRESETS, SETTINGS
from ssd_trt.decoding.settings import MODES, SD, SSD, Settings, as_settings
from ssd_trt.errors import SsdTrtError


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ssd_trt.bench.interleaved", description=__doc__.splitlines()[0])
    p.add_argument("build_dir", type=Path)
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL with a 'prompt' field")
    p.add_argument("--tuning-prompts", type=Path, default=TUNING_PROMPTS,
                   help="JSONL whose first prompt warms each mode up, untimed (disjoint from --prompts)")
    p.add_argument("--modes", default="ar,ssd",
                   help=f"comma list of mode names ({', '.join(MODES)}) or hand-picked settings (sd-k3, ssd-k2-b1); "
                        "ar first")
    p.add_argument("--sampling", default=",".join(PRESETS), help=f"comma list of presets: {', '.join(PRESETS)}")
    p.add_argument("--setting", default="equal", choices=sorted(SETTINGS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--limit-per-category", type=int, default=4, help="first N prompts of each category")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chat", action="store_true", help="apply the chat template to every prompt")
    p.add_argument("--out", type=Path, default=Path("runs/interleaved.json"))
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or args.modes[0] != "ar" or any(mode_settings(m) is None for m in args.modes):
        p.error(f"--modes must start with ar and name modes among {', '.join(MODES)} or hand-picked settings such as "
                f"sd-k3 and ssd-k2-b1, got {args.modes}")
    return args


HAND_PICKED = re.compile(r"^(?P<mode>sd|ssd)-k(?P<k>\d+)(?:-b(?P<b>\d+))?$")


def mode_settings(spec: str) -> Settings | None:
    """The settings a ``--modes`` entry names: a mode as a user gets it, or a hand-picked K (and SSD's budget);
    None when it names neither."""
    if spec in MODES:
        return as_settings(spec)
    found = HAND_PICKED.match(spec)
    if found is None or (found["mode"] == "sd") != (found["b"] is None):
        return None
    k = int(found["k"])
    return SD(draft_len=k) if found["mode"] == "sd" else SSD(draft_len=k, fan_out_budget=int(found["b"]))


def first_per_category(prompts, limit: int):
    seen: dict[str, int] = {}
    kept = []
    for prompt in prompts:
        if seen.get(prompt.category, 0) < limit:
            kept.append(prompt)
            seen[prompt.category] = seen.get(prompt.category, 0) + 1
    return kept


def measure(args) -> dict:
    from tqdm import tqdm
    builds = LoadedBuilds()
    setting = SETTINGS[args.setting]
    prompts = first_per_category(load_prompts(args.prompts), args.limit_per_category)
    warmup = load_prompts(args.tuning_prompts)[:1]
    probe = builds.get(args.build_dir, setting, "ar")
    encoded = [probe.encode(p.prompt, chat=args.chat) for p in prompts]
    warm_ids = [probe.encode(p.prompt, chat=args.chat) for p in warmup]
    categories = sorted({p.category for p in prompts})
    out = {}
    for name in args.sampling.split(","):
        params = replace(PRESETS[name].params(args.max_new_tokens), stop_on_eos=False)
        for mode in args.modes:                     # engines opened, the adaptive policy's steps timed: untimed
            run_engine(builds, args.build_dir, setting, mode_settings(mode), warmup, warm_ids, params, label="warm-up")
        runs = []
        for run in tqdm(range(args.runs), desc=f"{name}: interleaved runs", unit="run"):
            order = args.modes if run % 2 == 0 else args.modes[::-1]
            measured = {mode: run_engine(builds, args.build_dir, setting, mode_settings(mode), prompts, encoded,
                                         params, label=f"run {run} {mode}") for mode in order}
            summaries = {mode: summarise(measured[mode], None) for mode in order}
            rates = {mode: summaries[mode]["tokens_per_s"] for mode in order}
            by_category = {category: {mode: summarise([r for r, p in zip(measured[mode], prompts)
                                                       if p.category == category], None)["tokens_per_s"]
                                      for mode in order}
                           for category in categories}
            runs.append({"order": order, "tokens_per_s": rates,
                         "decode_tokens_per_s": {mode: summaries[mode]["decode_tokens_per_s"] for mode in order},
                         "mean_accepted": {mode: summaries[mode]["mean_accepted"] for mode in order},
                         "cache_hit_rate": {mode: summaries[mode]["cache_hit_rate"] for mode in order},
                         "vs_ar": {mode: rates[mode] / rates["ar"] for mode in args.modes if mode != "ar"},
                         "by_category": by_category})
        out[name] = {"params": PRESETS[name].describe(), "runs": runs,
                     "median_vs_ar": {mode: statistics.median(r["vs_ar"][mode] for r in runs)
                                      for mode in args.modes if mode != "ar"},
                     "median_tokens_per_s": {mode: statistics.median(r["tokens_per_s"][mode] for r in runs)
                                             for mode in args.modes}}
        out[name]["median_vs_ar_by_category"] = {
            category: {mode: statistics.median(r["by_category"][category][mode] / r["by_category"][category]["ar"]
                                               for r in runs) for mode in args.modes if mode != "ar"}
            for category in categories}
        picked = [mode for mode in args.modes if mode.startswith("ssd-")]
        if "ssd" in args.modes and picked:     # the default against the best hand-picked point of the same run
            out[name]["ssd_vs_best_hand_picked"] = statistics.median(
                r["tokens_per_s"]["ssd"] / max(r["tokens_per_s"][mode] for mode in picked) for r in runs)
    return {"build": str(args.build_dir), "setting": setting.description, "prompts": len(prompts),
            "limit_per_category": args.limit_per_category, "max_new_tokens": args.max_new_tokens, "chat": args.chat,
            "modes": args.modes, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {platform.processor()}",
            "command": "python -m ssd_trt.bench.interleaved " + " ".join(sys.argv[1:]), "presets": out}


def table(result: dict) -> str:
    others = [m for m in result["modes"] if m != "ar"]
    lines = ["| preset | " + " | ".join(f"{m} / ar per run" for m in others) + " | "
             + " | ".join(f"{m} / ar (median)" for m in others) + " | ar tok/s (median) |",
             "|---|" + "---|" * (2 * len(others) + 1)]
    for name, entry in result["presets"].items():
        per_run = [", ".join(f"{r['vs_ar'][m]:.2f}" for r in entry["runs"]) for m in others]
        lines.append(f"| {name} | " + " | ".join(per_run) + " | "
                     + " | ".join(f"{entry['median_vs_ar'][m]:.2f}" for m in others)
                     + f" | {entry['median_tokens_per_s']['ar']:.1f} |")
        for category, medians in entry.get("median_vs_ar_by_category", {}).items():
            lines.append(f"| {name}, {category} | " + " | ".join(
                ", ".join(f"{r['by_category'][category][m] / r['by_category'][category]['ar']:.2f}"
                          for r in entry["runs"]) for m in others) + " | "
                + " | ".join(f"{medians[m]:.2f}" for m in others) + " | "
                + f"{statistics.median(r['by_category'][category]['ar'] for r in entry['runs']):.1f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    others = [m for m in result["modes"] if m != "ar"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = list(result["presets"])
    for offset, mode in enumerate(others):
        for x, name in enumerate(names):
            ratios = [r["vs_ar"][mode] for r in result["presets"][name]["runs"]]
            ax.scatter([x + 0.15 * offset] * len(ratios), ratios, label=mode if x == 0 else None, alpha=0.7)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("tokens/s vs AR (each run)")
    ax.set_title(f"modes as a user gets them, batch 1 ({result['setting']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        result = measure(args)
    except SsdTrtError as error:
        print(f"ssd_trt.bench.interleaved: error: {error}", file=sys.stderr)
        return 2
    write_artifact(result, args.out, plot, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
