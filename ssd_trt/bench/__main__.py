"""``python -m ssd_trt.bench BUILD_DIR``: this engine's modes and peer baselines, side by side, in one run.

For each sampling preset (greedy, T=0.7 top-p 0.9, T=1 top-k 50, or --temperature/--top-p/--top-k) and
each hardware setting: SD's K, and SSD's K and fan-out budget jointly (every pair of the two lists: the best
budget depends on K, since the draft's tree grows with K x budget), are swept on the tuning prompts (a split
disjoint from the measured ones), then every mode runs the measured prompts. Writes results.json, PNG
plots and a terminal table to --out. See docs/benchmarks.md for the schema.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import numpy as np

import ssd_trt
from ssd_trt.bench import llama_bench, llama_cpp
from ssd_trt.bench.prompts import DEFAULT_PROMPTS, TUNING_PROMPTS, load_prompts
from ssd_trt.bench.runner import LoadedBuilds, agreement, by_category, run_engine, run_hf, summarise
from ssd_trt.decoding.settings import AR, SD, SSD, min_fan_out_budget
from ssd_trt.bench.settings import PRESETS, SETTINGS, SamplingPreset
from ssd_trt.bench.speed_model import predicted_speedup
from ssd_trt.errors import SsdTrtError

ENGINE_MODES = ("ar", "sd", "ssd")
BASELINES = {"hf": "hf_ar", "hf_assisted": "hf_assisted"}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ssd_trt.bench", description=__doc__.splitlines()[0])
    p.add_argument("build_dir", type=Path)
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL with a 'prompt' field")
    p.add_argument("--limit-per-category", type=int, default=None, help="first N prompts of each category")
    p.add_argument("--modes", default="ar,sd,ssd")
    p.add_argument("--baselines", default="hf,hf_assisted,llama_bench,llama_lookup,llama_cpp,llama_cpp_lookup",
                   help="comma list of hf, hf_assisted, llama_bench, llama_lookup, llama_speculative (llama.cpp's own binaries), "
                        "llama_cpp, llama_cpp_lookup (its Python binding), or 'none' (llama.cpp ones need "
                        "`bash scripts/install_llama_cpp.sh` and a .gguf target; skipped with a note otherwise)")
    p.add_argument("--ar-builds", default="",
                   help="comma list of LABEL=BUILD_DIR: other builds of the same target whose greedy AR runs side by "
                        "side as rows LABEL, with its agreement with this build's AR (e.g. "
                        "ar_fp32=build/smollm2-135m-fp32)")
    p.add_argument("--settings", default="paper,equal", help="paper, equal (see bench/settings.py)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--sampling", default="greedy",
                   help=f"comma list of presets: {', '.join(PRESETS)} (or use --temperature/--top-p/--top-k)")
    p.add_argument("--temperature", type=float, default=None, help="one custom preset instead of --sampling")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--tuning-prompts", type=Path, default=TUNING_PROMPTS,
                   help="JSONL the sweeps tune K / fan-out on (disjoint from --prompts)")
    p.add_argument("--chat", action="store_true", help="apply the chat template to every prompt")
    p.add_argument("--sd-k", default="2,3,4,6", help="K values swept for SD (best one is reported)")
    p.add_argument("--ssd-k", default="2,3,4", help="K values swept for SSD (best one is reported)")
    p.add_argument("--ssd-budget", default="6,8,12", help="fan-out budgets swept for SSD")
    p.add_argument("--sweep-prompts", type=int, default=5, help="tuning prompts used by the sweeps")
    p.add_argument("--build-defaults", action="store_true",
                   help="no sweeps: SD and SSD run at the build's own decoding defaults for each preset's regime "
                        "(the tuned winners in its manifest, python -m ssd_trt.tune; else the recipe's)")
    p.add_argument("--sweep-once", action="store_true",
                   help="sweep only under the first setting and reuse its best K / budget for the others")
    p.add_argument("--out", type=Path, default=Path("runs/bench"))
    return p.parse_args(argv)


def choose_prompts(args):
    prompts = load_prompts(args.prompts)
    if args.limit_per_category:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            if seen.get(p.category, 0) < args.limit_per_category:
                kept.append(p)
                seen[p.category] = seen.get(p.category, 0) + 1
        prompts = kept
    return prompts


def usable_baselines(wanted: str, manifest) -> tuple[str, dict[str, str]]:
    """The baselines that can run here, and why each other one asked for is skipped."""
    keep, skipped = [], {}
    for name in [b for b in wanted.split(",") if b and b != "none"]:
        if name in (*llama_cpp.NAMES, *llama_bench.NAMES):
            reason = llama_bench.unavailable_reason(name) if name in llama_bench.NAMES else llama_cpp.unavailable_reason()
            if reason is None and not manifest.model("target").source.endswith(".gguf"):
                reason = "the target is not built from a .gguf file (llama.cpp runs the same file)"
            if reason is None and name == "llama_speculative" and not manifest.model("draft").source.endswith(".gguf"):
                reason = "the draft is not built from a .gguf file (llama.cpp's speculative decoding loads it)"
            if reason is not None:
                skipped[name] = reason
                print(f"ssd_trt.bench: skipping {name}: {reason}", file=sys.stderr)
                continue
        elif name not in BASELINES:
            raise ValueError(f"unknown baseline {name!r}; choose from "
                             f"{', '.join([*BASELINES, *llama_bench.NAMES, *llama_cpp.NAMES])}")
        keep.append(name)
    return ",".join(keep) or "none", skipped


def other_ar_builds(spec: str, manifest) -> list[tuple[str, Path]]:
    """--ar-builds LABEL=DIR,...: builds of the same target file (so the same prompt token ids)."""
    from ssd_trt.manifest import read_manifest
    out = []
    for item in [i for i in spec.split(",") if i]:
        label, _, path = item.partition("=")
        if not path or label in (*ENGINE_MODES, *BASELINES.values(), *llama_cpp.NAMES, *llama_bench.NAMES):
            raise ValueError(f"--ar-builds item {item!r}: write LABEL=BUILD_DIR with a label not already a mode "
                             f"or baseline")
        other = read_manifest(Path(path))
        if other.model("target").source_sha256 != manifest.model("target").source_sha256:
            raise ValueError(f"--ar-builds {label}: {path} is built from another target "
                             f"({other.model('target').source}); compare builds of the same model")
        out.append((label, Path(path)))
    return out


def presets(args) -> list[SamplingPreset]:
    if args.temperature is not None:
        return [SamplingPreset("custom", args.temperature, args.top_p, args.top_k)]
    unknown = [name for name in args.sampling.split(",") if name not in PRESETS]
    if unknown:
        raise ValueError(f"unknown --sampling preset(s) {unknown}; choose from {', '.join(PRESETS)}")
    return [PRESETS[name] for name in args.sampling.split(",")]


SSD_GRID = "ssd: K x fan-out budget"


def ssd_grid(ks: str, budgets: str) -> list[tuple[int, int]]:
    """Every (K, budget) pair of the two comma lists (a budget below the smallest, ``min_fan_out_budget``, raised to
    it; pairs that coincide after that are swept once)."""
    return sorted({(int(k), max(int(b), min_fan_out_budget(int(k)))) for k in ks.split(",") for b in budgets.split(",")})


def sweep(builds, build_dir, setting, prompts, encoded, params, ar_tps, values, make_settings):
    points = []
    for value in values:
        mode = make_settings(value)
        runs = run_engine(builds, build_dir, setting, mode, prompts, encoded, params,
                          label=f"{mode.name} sweep {value}")
        s = summarise(runs, None)
        points.append({"value": list(value) if isinstance(value, tuple) else value,   # (K, budget) -> JSON list
                       "tokens_per_s": s["tokens_per_s"], "mean_accepted": s["mean_accepted"],
                       "cache_hit_rate": s["cache_hit_rate"], "speedup_vs_ar": s["tokens_per_s"] / ar_tps})
    return points


def run_setting(args, builds: LoadedBuilds, setting, prompts, encoded, tuning, params, hf_pair, eos_ids,
                chosen: dict | None = None) -> dict:
    build = args.build_dir
    modes = [m for m in args.modes.split(",") if m]
    small, small_ids = tuning
    results, categories, runs_by_mode = {}, {}, {}
    ar_runs = run_engine(builds, build, setting, AR(), prompts, encoded, params)
    runs_by_mode["ar"] = ar_runs
    sweeps: dict = {}
    chosen = dict(chosen or {})
    ar_small: list = []

    def pick(key: str, label: str, values: list, make_settings):
        """The fastest value on the tuning prompts (swept once; reused when ``chosen`` has it), or the build's
        default for this preset's regime (--build-defaults)."""
        if key not in chosen and args.build_defaults:
            d = args.decoding_defaults[params.greedy]
            chosen[key] = d.sd_draft_len if key == "sd_k" else [d.ssd_draft_len, d.ssd_fan_out_budget]
        if key not in chosen:
            if not ar_small:    # the sweeps' AR reference, on the same tuning prompts
                ar_small.append(summarise(run_engine(builds, build, setting, AR(), small, small_ids, params,
                                                     label="ar tuning"), None))
            sweeps[label] = sweep(builds, build, setting, small, small_ids, params, ar_small[0]["tokens_per_s"],
                                  values, make_settings)
            chosen[key] = max(sweeps[label], key=lambda p: p["tokens_per_s"])["value"]
        return chosen[key]

    if "sd" in modes:
        best_sd = pick("sd_k", "sd: K", [int(k) for k in args.sd_k.split(",")], lambda k: SD(draft_len=k))
        runs_by_mode["sd"] = run_engine(builds, build, setting, SD(draft_len=best_sd), prompts, encoded, params)
    if "ssd" in modes:
        best_k, best_budget = pick("ssd_grid", SSD_GRID, ssd_grid(args.ssd_k, args.ssd_budget),
                                   lambda kb: SSD(draft_len=kb[0], fan_out_budget=kb[1]))
        chosen["ssd_k"], chosen["ssd_budget"] = best_k, best_budget
        runs_by_mode["ssd"] = run_engine(builds, build, setting, SSD(draft_len=best_k, fan_out_budget=best_budget),
                                         prompts, encoded, params, keep_timeline=True)
    target, draft, _ = hf_pair if hf_pair else (None, None, None)
    for name in [b for b in args.baselines.split(",") if b in BASELINES]:
        runs_by_mode[BASELINES[name]] = run_hf(target, draft if name == "hf_assisted" else None, setting, prompts,
                                               encoded, args.max_new_tokens, eos_ids, BASELINES[name])
    for label, other_build in (args.ar_builds if params.greedy else []):   # their point: agreement at T = 0
        runs_by_mode[label] = run_engine(builds, other_build, setting, AR(), prompts, encoded, params, label=label)
    for name in [b for b in args.baselines.split(",") if b in llama_cpp.NAMES]:
        runs_by_mode[name] = llama_cpp.run_llama_cpp(args.gguf, setting, prompts, encoded, args.max_new_tokens,
                                                     eos_ids, name)
    # token-identical to AR is the check at T = 0; sampled modes are checked by their distribution (tests)
    reference = ar_runs if params.greedy else None
    for mode, runs in runs_by_mode.items():
        results[mode] = summarise(runs, reference)
        categories[mode] = by_category(runs, reference)
    results.update(binary_rows(args, setting, encoded, params.greedy))
    for mode in [m for m in ENGINE_MODES if m in modes]:   # what a short request waits (startup cost)
        results[mode]["two_token_latency_s"] = two_token_latency(builds, build, setting, mode, prompts, encoded,
                                                                 params, chosen)
    if params.greedy:    # engines with other kernels: how often their greedy text is this build's AR text
        for name in [*llama_cpp.NAMES, *(label for label, _ in args.ar_builds)]:
            if name in runs_by_mode:
                results[name]["agreement_with_ar"] = agreement([r.tokens for r in runs_by_mode[name]],
                                                               [r.tokens for r in ar_runs])
        if "hf_ar" in runs_by_mode:   # the AR row checked against an independent reference, not itself
            results["ar"]["agreement_with_transformers"] = agreement([r.tokens for r in ar_runs],
                                                                     [r.tokens for r in runs_by_mode["hf_ar"]])
    for mode, summary in results.items():
        for base in ("ar", "sd", "hf_ar", "hf_assisted", "llama_cpp", "llama_bench"):
            if base in results and base != mode and results[base]["tokens_per_s"]:
                summary[f"speedup_vs_{base}"] = summary["tokens_per_s"] / results[base]["tokens_per_s"]
    model = predicted_speedup(runs_by_mode.get("ssd", []), results["ar"]["tokens_per_s"])
    if model and "ssd" in results:
        model["measured_speedup_vs_ar"] = results["ssd"].get("speedup_vs_ar")
    timeline = next((r.stats["timeline"] for r in runs_by_mode.get("ssd", []) if r.stats.get("timeline")), [])
    return {"summary": results, "by_category": categories, "sweeps": sweeps, "speed_model": model,
            "timeline": timeline, "setting": setting.description, "chosen": chosen}


def binary_rows(args, setting, encoded: list[list[int]], greedy: bool) -> dict[str, dict]:
    """llama.cpp's own binaries (bench/llama_bench.py) as rows shaped like ``summarise``'s: tokens/s only.
    llama-bench does not sample, so its decode speed is every preset's yardstick; llama-lookup runs greedy."""
    rows = {}
    wanted = [b for b in args.binary_baselines.split(",") if b in llama_bench.NAMES]
    for name in wanted if greedy else [b for b in wanted if b == "llama_bench"]:
        if name == "llama_bench":
            depth = round(float(np.mean([len(ids) for ids in encoded])))       # the measured prompts' mean length
            row = llama_bench.run_llama_bench(args.gguf, setting, args.max_new_tokens, depth)
        elif name == "llama_speculative":
            row = llama_bench.run_llama_speculative_row(args.gguf, args.draft_gguf, setting, args.prompt_texts,
                                                        args.max_new_tokens)
        else:
            row = llama_bench.run_llama_lookup(args.gguf, setting, args.prompt_texts, args.max_new_tokens)
        rows[name] = {**dict.fromkeys(("prompts", "generated_tokens", "seconds", "ttft_s", "exact_prompts",
                                       "mean_accepted", "cache_hit_rate", "ceiling_fraction")), **row}
    return rows


def two_token_latency(builds, build, setting, mode: str, prompts, encoded, params, chosen: dict) -> float:
    """Median wall time of a 2-token request (prefill, first speculation, one round) over the prompts,
    with the K / fan-out budget the sweep chose for the mode."""
    from dataclasses import replace
    settings = {"ar": AR(), "sd": SD(draft_len=chosen.get("sd_k")),
                "ssd": SSD(draft_len=chosen.get("ssd_k"), fan_out_budget=chosen.get("ssd_budget"))}[mode]
    runs = run_engine(builds, build, setting, settings, prompts, encoded, replace(params, max_new_tokens=2),
                      label=f"{mode} 2-token")
    return float(np.median([r.seconds for r in runs]))


def table(name: str, summary: dict) -> str:
    head = f"{'mode':12s} {'tok/s':>7s} {'ttft':>6s} {'2tok':>6s} {'acc':>5s} {'hit':>5s} {'draft':>6s} " \
           f"{'verif':>6s} {'exact':>7s} {'xAR':>5s} {'xSD':>5s} {'xHF':>5s} {'xHFas':>5s} {'xLC':>5s} {'xLB':>5s} {'ceil%':>6s}"
    lines = [f"== {name} ==", head]

    def f(v, fmt):
        width = int(fmt.split(".")[0]) if fmt[0].isdigit() else 0
        return format(v, fmt) if isinstance(v, (int, float)) else "-".rjust(width)

    def ms(v):
        return f(None if v is None else 1e3 * v, "6.1f")
    for mode, s in summary.items():
        exact = "-" if s["exact_prompts"] is None else f"{s['exact_prompts']}/{s['prompts']}"
        lines.append(f"{mode:12s} {f(s['tokens_per_s'], '7.2f')} {f(s['ttft_s'], '6.3f')} "
                     f"{f(s.get('two_token_latency_s'), '6.3f')} {f(s['mean_accepted'], '5.2f')} "
                     f"{f(s['cache_hit_rate'], '5.2f')} {ms(s.get('draft_latency_s'))} {ms(s.get('verify_latency_s'))} "
                     f"{exact:>7s} {f(s.get('speedup_vs_ar'), '5.2f')} {f(s.get('speedup_vs_sd'), '5.2f')} "
                     f"{f(s.get('speedup_vs_hf_ar'), '5.2f')} {f(s.get('speedup_vs_hf_assisted'), '5.2f')} "
                     f"{f(s.get('speedup_vs_llama_cpp'), '5.2f')} {f(s.get('speedup_vs_llama_bench'), '5.2f')} "
                     f"{f(100 * s['ceiling_fraction'] if s['ceiling_fraction'] else None, '6.1f')}")
    lines.append("(2tok: median seconds of a 2-token request; acc: draft tokens accepted per round; draft / verif: "
                 "ms per round; exact: token-identical to ar at T = 0, '-' when sampling; xLC / xLB: against "
                 "llama.cpp through its Python binding / its own llama-bench binary)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        probe = ssd_trt.load(args.build_dir)
        chosen_presets = presets(args)
        prompts = choose_prompts(args)
        tuning_prompts = load_prompts(args.tuning_prompts)[:args.sweep_prompts]
        overlap = {p.prompt for p in prompts} & {p.prompt for p in tuning_prompts}
        if overlap:
            raise ValueError(f"{len(overlap)} tuning prompt(s) also appear among the measured prompts; tune on a "
                             f"disjoint split (--tuning-prompts)")
        encoded = [probe.encode(p.prompt, chat=args.chat) for p in prompts]
        tuning = (tuning_prompts, [probe.encode(p.prompt, chat=args.chat) for p in tuning_prompts])
        eos_ids = sorted(probe.eos_ids)
        args.baselines, skipped = usable_baselines(args.baselines, probe.manifest)
        args.binary_baselines = args.baselines      # llama.cpp's binaries run under every preset
        args.decoding_defaults = {greedy: probe.decoding_defaults(ssd_trt.SamplingParams(temperature=0 if greedy else 1))
                                  for greedy in (True, False)}
        # llama-lookup reads text: the prompts as this engine encodes them (chat template included)
        args.prompt_texts = [probe.tokenizer.decode(ids) for ids in encoded]
        args.gguf = Path(probe.manifest.model("target").source)
        args.draft_gguf = Path(probe.manifest.model("draft").source)
        args.ar_builds = other_ar_builds(args.ar_builds, probe.manifest)
        weights = {role: f"{getattr(probe.manifest.recipe, role).weights} weights, "
                         f"{getattr(probe.manifest.recipe, role).activations} activations" for role in ("target", "draft")}
        hf_pair = None
        if any(b in BASELINES for b in args.baselines.split(",")):
            from ssd_trt.bench.baselines import load_hf_pair
            hf_pair = load_hf_pair(probe.manifest)
        del probe
    except (SsdTrtError, ValueError) as error:
        print(f"ssd_trt.bench: error: {error}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"config": {"build_dir": str(args.build_dir), "prompts_file": str(args.prompts), "prompts": len(prompts),
                         "tuning_prompts_file": str(args.tuning_prompts), "tuning_prompts": len(tuning_prompts),
                         "max_new_tokens": args.max_new_tokens, "chat": args.chat,
                         "date": datetime.datetime.now().isoformat(timespec="seconds"),
                         "machine": f"{platform.machine()} {platform.processor()} cpus={len(__import__('os').sched_getaffinity(0))}",
                         "hf_note": None if hf_pair is None else hf_pair[2], "skipped_baselines": skipped,
                         "weights": weights, "ar_builds": {label: str(path) for label, path in args.ar_builds},
                         "k_and_budget": "the build's decoding defaults" if args.build_defaults else
                         "swept on the tuning prompts"},
              "presets": {}}
    try:
        from ssd_trt.bench import plots
    except ImportError:            # matplotlib is an optional extra: results.json alone, said once
        plots = None
        print("ssd_trt.bench: matplotlib is not installed, so no plots (pip install -e '.[plots]')", flush=True)
    builds = LoadedBuilds()
    for preset in chosen_presets:
        params = preset.params(args.max_new_tokens)
        entry = report["presets"].setdefault(preset.name, {"params": preset.describe(), "settings": {}})
        chosen: dict = {}
        for key in args.settings.split(","):
            setting = SETTINGS[key]
            # transformers' baselines are greedy here: their sampled runs would use another random stream
            baselines_args = argparse.Namespace(**{**vars(args), "baselines": args.baselines if params.greedy
                                                    else "none"})
            outcome = run_setting(baselines_args, builds, setting, prompts, encoded, tuning, params, hf_pair,
                                  eos_ids, chosen if args.sweep_once else None)
            chosen = outcome["chosen"]
            outcome["timeline"] = outcome["timeline"][:40]
            entry["settings"][setting.name] = outcome
            if plots is not None:
                tag = f"{preset.name}_{setting.name}"
                plots.tokens_per_category(outcome["by_category"], args.out / f"tokens_per_category_{tag}.png",
                                          f"tokens/s by category ({preset.name}, {setting.name})")
                if outcome["timeline"]:
                    plots.ssd_timeline(outcome["timeline"], args.out / f"ssd_timeline_{tag}.png")
                if outcome["sweeps"]:          # none with --build-defaults
                    plots.sweeps(outcome["sweeps"], args.out / f"sweeps_{tag}.png")
            print(table(f"{preset.name}, {setting.name}: {setting.description}", outcome["summary"]), flush=True)
            (args.out / "results.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out / 'results.json'}{'' if plots is None else ' and plots'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
