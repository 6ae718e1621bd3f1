"""``python -m ssd_trt.tune BUILD_DIR``: the build's decoding defaults, chosen by measurement, per regime.

SD's K, and SSD's K with its fan-out budget B, are swept on the tuning prompts (``bench/prompts/tuning.jsonl``,
disjoint from the prompts the benchmark reports on), with the chat template when the build has one, under the runtime's default
placement (``RuntimeOptions()``: target on core 0, the draft on core 1), for two regimes: greedy, and sampled
(T=0.7 / top-p 0.9 and T=1 / top-k 50 together). Each point runs every tuning prompt, in rounds over all points
after one untimed request per mode (opening the engines is not decoding), so a slow minute on a shared machine
touches every point alike; a point's speed is its best round (noise only ever slows a run down).
The fastest point of each regime goes into the manifest (``tuned_decoding``), with every point measured and
AR on the same prompts; ``generate``, the Python API and the Triton model then use the regime's winner for any
request that does not set K or B (``Generator.resolve``). A rebuild drops the tuning (its manifest is new):
``--if-missing`` tunes only a build that has none.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

from tqdm import tqdm

import ssd_trt
from ssd_trt.bench.prompts import TUNING_PROMPTS, load_prompts
from ssd_trt.bench.settings import PRESETS
from ssd_trt.decoding.settings import AR, SD, SSD, Settings, min_fan_out_budget, ssd_tree_tokens
from ssd_trt.errors import SsdTrtError
from ssd_trt.manifest import TunedDecoding, read_manifest, write_manifest
from ssd_trt.recipe import DecodingDefaults

REGIMES = {"greedy": ("greedy",), "sampled": ("t0.7-p0.9", "t1-k50")}
PLOT_NAME = "tuning.png"      # beside the manifest: every measured point as speedup over AR


def grid(sd_ks: list[int], ssd_ks: list[int], budgets: list[int], limits) -> list[tuple]:
    """The points to measure: ("ar",), ("sd", K), ("ssd", K, B) within the engine's limits; a budget below the
    smallest (``min_fan_out_budget``) is raised to it and duplicates dropped."""
    points: list[tuple] = [("ar",)] + [("sd", k) for k in sd_ks if k <= limits.max_draft_len]
    for k in [k for k in ssd_ks if k <= limits.max_draft_len]:
        for b in sorted({max(b, min_fan_out_budget(k)) for b in budgets}):
            if ssd_tree_tokens(k, b) <= limits.max_tree_size:
                points.append(("ssd", k, b))
    return points


def settings_of(point: tuple) -> Settings:
    if point[0] == "ssd":
        return SSD(draft_len=point[1], fan_out_budget=point[2])
    return SD(draft_len=point[1]) if point[0] == "sd" else AR()


def measure(generator, points: list[tuple], prompts: list[list[int]], presets: list, max_new_tokens: int,
            rounds: int) -> dict[tuple, float]:
    """tokens/s of each point (total tokens / total seconds over the prompts and presets), best of ``rounds``;
    one loaded build, each point's settings passed per call."""
    for mode in sorted({point[0] for point in points}):   # open every engine and see every shape once, untimed
        generator.generate_ids(prompts[:1], presets[0].params(max_new_tokens),
                               mode=settings_of(next(p for p in points if p[0] == mode)))
    best: dict[tuple, float] = {}
    with tqdm(total=rounds * len(points), desc="tune", unit="point") as bar:
        for _ in range(rounds):
            for point in points:
                tokens, seconds = 0, 0.0
                for preset in presets:
                    params = preset.params(max_new_tokens)
                    for ids in prompts:
                        start = time.perf_counter()
                        [result] = generator.generate_ids([ids], params, mode=settings_of(point))
                        seconds += time.perf_counter() - start
                        tokens += len(result.token_ids)
                best[point] = max(best.get(point, 0.0), tokens / seconds)
                bar.update()
    return best


def winners(speeds: dict[tuple, float]) -> DecodingDefaults:
    sd = max((p for p in speeds if p[0] == "sd"), key=speeds.get)
    ssd = max((p for p in speeds if p[0] == "ssd"), key=speeds.get)
    return DecodingDefaults(sd_draft_len=sd[1], ssd_draft_len=ssd[1], ssd_fan_out_budget=ssd[2])


def tune(build_dir: Path, prompts_file: Path = TUNING_PROMPTS, prompts: int = 4, max_new_tokens: int = 48,
         rounds: int = 2, sd_ks: tuple[int, ...] = (1, 2, 3, 4), ssd_ks: tuple[int, ...] = (1, 2, 3),
         budgets: tuple[int, ...] = (4, 8, 16)) -> TunedDecoding:
    generator = ssd_trt.load(build_dir)
    chat = generator.manifest.tokenizer.chat_template        # as users prompt a chat model
    encoded = [generator.encode(p.prompt, chat=chat) for p in load_prompts(prompts_file)[:prompts]]
    points = grid(list(sd_ks), list(ssd_ks), list(budgets), generator.limits)
    chosen, measured = {}, {}
    for regime, names in REGIMES.items():
        speeds = measure(generator, points, encoded, [PRESETS[n] for n in names], max_new_tokens, rounds)
        chosen[regime] = winners(speeds)
        measured[regime] = {"presets": list(names), "ar_tokens_per_s": speeds[("ar",)],
                            "points": [{"mode": p[0], "draft_len": p[1] if len(p) > 1 else None,
                                        "fan_out_budget": p[2] if len(p) > 2 else None, "tokens_per_s": v,
                                        "speedup_vs_ar": v / speeds[("ar",)]} for p, v in speeds.items()]}
    placement = {role: {"cores": list(generator.options.placement(role).cores or ()),
                        "threads": generator.options.placement(role).threads} for role in ("target", "draft")}
    tuned = TunedDecoding(greedy=chosen["greedy"], sampled=chosen["sampled"], measurement={
        "prompts_file": prompts_file.name, "prompts": len(encoded), "chat_template": chat,
        "max_new_tokens": max_new_tokens,
        "rounds": rounds, "placement": placement, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        **measured})
    manifest = read_manifest(build_dir)
    write_manifest(build_dir, manifest.model_copy(update={"tuned_decoding": tuned}))
    (build_dir / PLOT_NAME).unlink(missing_ok=True)     # an earlier tuning's plot must not pass for this one's
    plot_tuning(tuned.measurement, build_dir / PLOT_NAME)
    return tuned


def plot_tuning(measurement: dict, path: Path) -> Path | None:
    """Every measured point as speedup over AR, one panel per regime and mode (the bench's sweep plot);
    None when matplotlib (an optional extra) is not installed."""
    try:
        from ssd_trt.bench.plots import sweeps
    except ImportError:
        return None
    panels = {}
    for regime in REGIMES:
        points = measurement[regime]["points"]
        panels[f"{regime}: sd K"] = [{"value": q["draft_len"], "speedup_vs_ar": q["speedup_vs_ar"]}
                                     for q in points if q["mode"] == "sd"]
        panels[f"{regime}: ssd K x budget"] = [{"value": [q["draft_len"], q["fan_out_budget"]],
                                                "speedup_vs_ar": q["speedup_vs_ar"]} for q in points if q["mode"] == "ssd"]
    return sweeps(panels, path)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ssd_trt.tune", description=__doc__.splitlines()[0])
    p.add_argument("build_dir", type=Path)
    p.add_argument("--if-missing", action="store_true", help="do nothing when the build is already tuned")
    p.add_argument("--prompts", type=int, default=4, help="tuning prompts per point")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sd-k", default="1,2,3,4")
    p.add_argument("--ssd-k", default="1,2,3")
    p.add_argument("--ssd-budget", default="4,8,16")
    args = p.parse_args(argv)
    try:
        if args.if_missing and read_manifest(args.build_dir).tuned_decoding is not None:
            print(f"{args.build_dir}: already tuned (rebuild or drop --if-missing to tune again)")
            return 0
        tuned = tune(args.build_dir, prompts=args.prompts, max_new_tokens=args.max_new_tokens, rounds=args.rounds,
                     sd_ks=_ints(args.sd_k), ssd_ks=_ints(args.ssd_k), budgets=_ints(args.ssd_budget))
    except (SsdTrtError, ValueError) as error:
        print(f"ssd_trt.tune: error: {error}", file=sys.stderr)
        return 2
    for regime in REGIMES:
        d, m = getattr(tuned, regime), tuned.measurement[regime]
        best = {(q["mode"], q["draft_len"], q["fan_out_budget"]): q["speedup_vs_ar"] for q in m["points"]}
        print(f"{regime:8s} sd K={d.sd_draft_len} ({best[('sd', d.sd_draft_len, None)]:.2f}x AR)   "
              f"ssd K={d.ssd_draft_len} B={d.ssd_fan_out_budget} "
              f"({best[('ssd', d.ssd_draft_len, d.ssd_fan_out_budget)]:.2f}x AR)   AR {m['ar_tokens_per_s']:.1f} tok/s")
    plot = args.build_dir / PLOT_NAME
    print(f"recorded in {args.build_dir / 'manifest.json'} (tuned_decoding)"
          + (f"; every point plotted in {plot}" if plot.exists() else
             "; no plot: matplotlib is not installed (pip install -e '.[plots]')"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
