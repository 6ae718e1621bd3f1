"""Where adaptive SSD's time goes against AR at a fixed number of closed-loop clients, in process (no server).

    python research/cpu/profile_policy_load.py build/smollm2-135m --clients 4 --out docs/bench/profiles/policy_4_clients.txt

One ``LLMEngine`` per run over the build: ``--clients`` requests live at a time (a finished one is replaced at
once), ``--requests`` in all, 64 new tokens each over the report prompts (chat template), EOS ignored. AR and
adaptive SSD ("ssd", nothing set) alternate ``--repeats`` times on one Generator, so the load policy keeps what it
measured between SSD runs (as a server does). Then one more SSD run under cProfile. The report: tokens/s of each
run, which option the policy chose per round, and the profile's top entries by cumulative time.
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ssd_trt  # noqa: E402
from ssd_trt import SamplingParams  # noqa: E402
from ssd_trt.batching.engine import LLMEngine  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[2] / "ssd_trt" / "bench" / "prompts" / "default.jsonl"


def closed_loop(gen, prompts: list[list[int]], mode: str, clients: int, requests: int) -> tuple[float, dict]:
    """tokens/s of ``requests`` requests, ``clients`` live at a time, and the policy's choices per round."""
    engine = LLMEngine(gen, calibrate=True)
    params = SamplingParams(max_new_tokens=64, stop_on_eos=False)
    sent, live, tokens, choices = 0, set(), 0, collections.Counter()
    started = time.perf_counter()
    while sent < requests or engine.has_unfinished():
        while len(live) < clients and sent < requests:
            live.add(engine.add_request(prompts[sent % len(prompts)], params, mode))
            sent += 1
        for output in engine.step():
            tokens += len(output.new_tokens)
            if output.finished:
                live.discard(output.request_id)
                engine.take_result(output.request_id)
        if engine.metrics.last_choice:
            choices[engine.metrics.last_choice["chose"]] += 1
    elapsed = time.perf_counter() - started
    engine.close()
    return tokens / elapsed, dict(choices)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build_dir", type=Path)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    gen = ssd_trt.load(args.build_dir)
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()][:8]
    prompts = [gen.encode(text, chat=True) for text in texts]
    lines = [f"# {' '.join(sys.argv)}", f"# {args.clients} clients, {args.requests} requests of 64 tokens per run"]
    for repeat in range(args.repeats):
        ar, _ = closed_loop(gen, prompts, "ar", args.clients, args.requests)
        ssd, choices = closed_loop(gen, prompts, "ssd", args.clients, args.requests)
        lines.append(f"repeat {repeat}: ar {ar:.1f} tok/s, ssd {ssd:.1f} tok/s (ssd / ar {ssd / ar:.2f}); "
                     f"ssd rounds by option: {choices}")
    profiler = cProfile.Profile()
    profiler.enable()
    ssd, choices = closed_loop(gen, prompts, "ssd", args.clients, args.requests)
    profiler.disable()
    lines.append(f"profiled ssd run: {ssd:.1f} tok/s; rounds by option: {choices}")
    report = io.StringIO()
    pstats.Stats(profiler, stream=report).sort_stats("cumulative").print_stats(30)
    text = "\n".join(lines) + "\n\n" + report.getvalue()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
