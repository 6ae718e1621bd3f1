"""``python -m ssd_trt.demo BUILD_DIR``: one prompt through ar, sd and ssd, then a table to compare them.

The engines are opened once; each mode streams its text, and the table shows what each mode did: tokens/s, draft
tokens accepted per round, SSD's speculation-cache hit rate, the time a round spent drafting and verifying, and the
CPU cores each model ran on. ``ssd`` is the default mode as a user gets it (K, the budget and the kind of each round
adapted to what it measures); ``ssd*`` beside it is SSD at the build's K and budget every round: the draft on its
own core, speculating beside every verification (the paper's setting, where the draft has a device of its own).
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from ssd_trt.errors import SsdTrtError
from ssd_trt.generate import TextPrinter
from ssd_trt.runtime import MODES

EVERY_ROUND = "ssd*"       # the table's name for SSD at the build's K and budget, speculating every round

HOW_TO_READ = (
    "How to read it: 'accepted' is draft tokens the target accepted per round (each round adds one more token of "
    "the target's own); 'cache hit' is how often SSD's pre-drafted speculation matched the verification outcome. "
    "'ssd' is the default mode as you get it: left unset, it adapts K, the budget and the kind of each round to what "
    "it measures, and runs SD or AR rounds where those are faster here. 'ssd*' is SSD at the build's K and budget "
    "every round: its draft speculates on its own core beside every verification, while AR and SD lend that core to "
    "the target whenever the draft is idle, so on a 2-core machine ssd* can land below SD or AR (the SSD paper gives "
    "the draft a device of its own). One prompt is noisy; `python -m ssd_trt.bench` compares the modes side by side "
    "over a prompt set.")


def cores(option: tuple[int, ...] | None, threads: int) -> str:
    where = "any core" if not option else "core " + ",".join(str(c) for c in option)
    return f"{where}, {threads} thread{'s' if threads != 1 else ''}"


def number(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def target_placement(mode: str, options) -> str:
    """AR's and SD's target steps run while the draft is idle: on the draft's cores too (Engine.alone); default SSD's
    too, in the rounds it runs without speculating beside them."""
    wide = options.alone_threads > options.target_threads
    if mode == EVERY_ROUND or not wide:
        return cores(options.target_cores, options.target_threads)
    if mode == "ssd":
        return f"{cores(options.alone_cores, options.alone_threads)} while the draft idles, else " \
               f"{cores(options.target_cores, options.target_threads)}"
    return cores(options.alone_cores, options.alone_threads)


def draft_placement(mode: str, options) -> str:
    """SSD's draft works beside the target; SD's in turn with it (on the draft's worker thread either way)."""
    if mode == "ar":
        return "-"
    if mode == "sd":
        return cores(options.draft_cores, options.draft_threads) + " (in turn with the target)"
    if mode == "ssd":
        return cores(options.draft_cores, options.draft_threads) + " (beside it, or in turn)"
    return cores(options.draft_cores, options.draft_threads) + " (its own, beside every verification)"


def summary_table(rows: list[tuple[str, dict]], options) -> str:
    header = ("mode", "tok/s", "accepted/round", "cache hit", "draft ms/round", "verify ms/round",
              "target on", "draft on")
    lines = [header]
    for mode, stats in rows:
        lines.append((mode, number(stats.get("tokens_per_s"), ".1f"), number(stats.get("mean_accepted"), ".2f"),
                      number(stats.get("cache_hit_rate"), ".2f"),
                      number(None if stats.get("draft_latency_s") is None else 1e3 * stats["draft_latency_s"], ".1f"),
                      number(None if stats.get("verify_latency_s") is None else 1e3 * stats["verify_latency_s"], ".1f"),
                      target_placement(mode, options), draft_placement(mode, options)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd_trt.demo", description=__doc__.splitlines()[0])
    parser.add_argument("build_dir", type=Path)
    parser.add_argument("--prompt", default="Write a short poem about the sea.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, default ar,sd,ssd")
    parser.add_argument("--no-chat", action="store_true", help="tokenize the prompt as-is (default: chat template)")
    args = parser.parse_args(argv)
    try:
        import ssd_trt
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        generator = ssd_trt.load(args.build_dir)
        params = ssd_trt.SamplingParams(max_new_tokens=args.max_new_tokens)
        # open every engine (and the SSD worker) untimed first: the first request would otherwise pay ~2 s of
        # session creation and the table would compare that, not decoding (a server does this at load too)
        for mode in modes:
            generator.generate(args.prompt, ssd_trt.SamplingParams(max_new_tokens=2), mode=mode,
                               chat=not args.no_chat)
        # the modes as a user gets them; then, beside SSD, SSD speculating at the build's K and budget every round
        runs = [(mode, mode) for mode in modes] + \
            ([(EVERY_ROUND, generator.resolve("ssd", params).settings)] if "ssd" in modes else [])
        rows = []
        for label, mode in runs:
            every_round = "" if isinstance(mode, str) else f" (K={mode.draft_len}, B={mode.fan_out_budget}, every round)"
            print(f"== mode {label}{every_round} ==", flush=True)
            printer = TextPrinter(generator.tokenizer)
            [result] = generator.generate(args.prompt, params, mode=mode, chat=not args.no_chat, on_tokens=printer)
            printer.finish(result.text)
            rows.append((label, result.stats))
    except SsdTrtError as error:
        print(f"ssd_trt.demo: error: {error}", file=sys.stderr)
        return 2
    print()
    print(summary_table(rows, generator.options))
    print(textwrap.fill(HOW_TO_READ, width=110))
    return 0


if __name__ == "__main__":
    sys.exit(main())
