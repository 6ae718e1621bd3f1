"""Where adaptive SSD's time goes against AR at a fixed number of closed-loop clients, in process (no server).

    python research/cpu/profile_policy_load.py build/smollm2-135m --clients 4 --out docs/bench/profiles/policy_4_clients.txt

One ``LLMEngine`` per run over the build: ``--clients`` requests live at a time (a finished one is replaced at
once), ``--requests`` in all, 64 new tokens each over the report prompts (chat template), EOS ignored. AR and
adaptive SSD ("ssd", nothing set) alternate ``--repeats`` times on one Generator, so the load policy keeps what it
measured between SSD runs (as a server does); SD (the build's K) runs beside them for comparison. Then one more SSD
run under cProfile. The report: tokens/s of each run and the main thread's seconds in ONNX Runtime (the same work
should take the same time: where it does not, the machine slowed that run), which option the policy chose per round,
the slowdowns and acceptances it measured, and the profile's top entries by cumulative time.
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import io
import json
import pstats
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ssd_trt  # noqa: E402
from ssd_trt import SamplingParams  # noqa: E402
from ssd_trt.batching.engine import LLMEngine  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[2] / "ssd_trt" / "bench" / "prompts" / "default.jsonl"


class MainThreadOrtTime:
    """Seconds the main thread spends inside ONNX Runtime's ``run_with_iobinding`` (the target's steps, and the
    draft's when it runs in turn), and how many calls: the same work in two runs should take the same time, so a
    run whose ORT seconds per call differ from another's was slowed by the machine, not by the engine step."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def __enter__(self) -> "MainThreadOrtTime":
        import onnxruntime
        self._cls = onnxruntime.InferenceSession
        self._original = original = self._cls.run_with_iobinding
        timer = self

        def timed(session, *args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                return original(session, *args, **kwargs)
            started = time.perf_counter()
            try:
                return original(session, *args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - started
                timer.calls += 1
        self._cls.run_with_iobinding = timed
        return self

    def __exit__(self, *exc) -> None:
        self._cls.run_with_iobinding = self._original


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
        rates, chosen, times = {}, {}, {}
        for mode in ("ar", "sd", "ssd"):
            with MainThreadOrtTime() as ort:
                rates[mode], chosen[mode] = closed_loop(gen, prompts, mode, args.clients, args.requests)
            times[mode] = f"{ort.seconds:.1f} s / {ort.calls} calls"
        lines.append(f"repeat {repeat}: ar {rates['ar']:.1f} tok/s, sd {rates['sd']:.1f} tok/s, ssd {rates['ssd']:.1f} "
                     f"tok/s (ssd / ar {rates['ssd'] / rates['ar']:.2f}, sd / ar {rates['sd'] / rates['ar']:.2f}); "
                     f"ssd rounds by option: {chosen['ssd']}; main thread in ONNX Runtime: {times}")
    for settings, policy in gen.learned.policies.items():      # what the policy measured: slowdown per (bucket, option)
        lines.append(f"slowdowns ({settings}): {policy.describe()}")
    for settings, measured in gen.learned.yields.items():       # tokens accepted per round, per (K, source)
        lines.append(f"accepted per round ({settings}): "
                     f"{ {f'{k} {source}': round(v, 2) for (k, source), v in measured.accepted.items()} }, "
                     f"hit rate {measured.hit_rate if measured.hit_rate is None else round(measured.hit_rate, 3)}")
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
