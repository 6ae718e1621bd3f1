#!/usr/bin/env python
"""The real pair on one GPU through the public runtime's torch backend: greedy AR, SD and SSD.

Qwen2.5-Coder-1.5B-Instruct (target) and its 0.5B sibling (draft), Qwen's own Q4_K_M GGUF files
(``python -m ssd_trt.models.fetch qwen2.5-coder``), built for the torch backend
(``python -m ssd_trt.build recipes/qwen2.5-coder-1.5b-torch.yaml``: no ONNX; the runtime dequantizes each file into
the recipe's fp32 on the GPU). ``ssd_trt.load(build, RuntimeOptions(backend="torch"))`` places draft and target on
two CUDA streams of GPU 0, the target's at the higher priority (``engines/device_step.place_draft_and_target``); each
engine replays a CUDA graph per (batch, T) bucket; SSD's draft runs in its worker thread.

Per prompt (``ssd_trt/bench/prompts/pair.jsonl``, chat template, batch 1) the three modes run one after another, so
a run cut short by its time budget still compares whole triples. Reported per mode: tokens/s (whole requests,
prefill included, after an untimed warm-up), mean accepted tokens per round and acceptance rate, SSD's cache hit
rate, draft and verify ms per round, whether each prompt's tokens equal AR's (greedy exactness), and each engine's
device step times (CUDA events) by step width T. The JSON is rewritten after every prompt.

    python research/gpu/pair_session.py --build build/qwen2.5-coder-1.5b-torch --json pair.json
    python research/gpu/pair_session.py --write-smoke-pair DIR     # a tiny qwen2 GGUF pair and its torch recipe
    python research/gpu/pair_session.py --build DIR/build/tiny-gguf-torch --smoke --json pair.json   # on CPU

Exit code 0 when SD and SSD equal AR on every prompt run, 1 when one does not, 2 when there is no CUDA device
(without ``--smoke``), 3 when the build is missing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPTS = ROOT / "ssd_trt" / "bench" / "prompts" / "pair.jsonl"
MODES = ("ar", "sd", "ssd")
SMOKE_PROMPTS = ["def add(a, b):", "Write a haiku about", "x = [1, 2, 3]"]


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A tiny qwen2 GGUF with the real pair's block kinds (Q4_K / Q6_K projections, Q5_0, Q8_0) and, like the real
    files, its tokenizer in the metadata: ``tests/test_gguf_build.py``'s file."""
    from tests.test_gguf_build import write_tiny_qwen2
    return write_tiny_qwen2(path, seed=seed, with_tokenizer=True)


def write_smoke_pair(folder: Path) -> Path:
    """A tiny GGUF file (``write_tiny_gguf``) as both target and draft (so that speculation is accepted and SSD's
    cache is used) and a torch-backend recipe for them, shaped like ``recipes/qwen2.5-coder-1.5b-torch.yaml``: what
    the session builds on CPU."""
    import yaml
    folder.mkdir(parents=True, exist_ok=True)
    target = draft = write_tiny_gguf(folder / "tiny-qwen2.gguf")
    recipe = {"name": "tiny-gguf-torch", "output_dir": str(folder / "build" / "tiny-gguf-torch"),
              "target": {"source": str(target), "dtype": "float32"},
              "draft": {"source": str(draft), "dtype": "float32"},
              "engine": {"backend": "torch", "tensorrt": "none", "max_batch": 4, "max_context": 256,
                         "max_draft_len": 8, "max_tree_size": 64},
              "decoding": {"sd_draft_len": 3, "ssd_draft_len": 3, "ssd_fan_out_budget": 4}}
    path = folder / "tiny-gguf-torch.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def pair_prompts(count: int) -> list[str]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [row["prompt"] for row in rows[:count]]


def innermost(engine):
    """The device step engine under the wrappers (copy component, feature draft)."""
    while hasattr(engine, "inner"):
        engine = engine.inner
    return engine


def record_step_times(engine, sink: dict) -> None:
    """Collect the engine's device milliseconds per step (CUDA events; wall time on CPU) by step width T."""
    inner = innermost(engine)
    forward = inner.forward

    def timed(input_ids, *args, **kwargs):
        out = forward(input_ids, *args, **kwargs)
        sink[int(input_ids.shape[1])].append(float(inner.last_step_ms))
        return out
    inner.forward = timed


def placement(gen) -> dict:
    """Where each engine runs: device, stream priority (lower = more urgent), CUDA graphs, captured buckets."""
    out = {}
    for role in ("target", "draft"):
        engine = innermost(gen.engine(role))
        stream = getattr(engine, "_stream", None)
        out[role] = {"engine": type(engine).__name__, "device": str(getattr(engine, "_device", "?")),
                     "stream_priority": None if stream is None else stream.priority,
                     "cuda_graph_buckets": [f"{b.batch}x{b.tokens}" for b in getattr(engine, "captured_buckets", ())]}
    target, draft = out["target"]["stream_priority"], out["draft"]["stream_priority"]
    out["target_prioritized"] = None if target is None or draft is None else target < draft
    return out


def step_summary(sink: dict) -> dict:
    return {f"T={width}": {"steps": len(times), "median_ms": round(statistics.median(times), 3)}
            for width, times in sorted(list(sink.items())) if times}


def run(build: Path, prompts: list[str], new_tokens: int, chat: bool, budget_s: float, json_path: Path | None,
        smoke: bool) -> dict:
    import torch

    import ssd_trt
    from ssd_trt.decoding.params import SamplingParams
    from ssd_trt.runtime import RuntimeOptions

    started = time.perf_counter()
    gen = ssd_trt.load(build, RuntimeOptions(backend="torch"))
    chat = chat and bool(getattr(gen.tokenizer, "chat_template", None))
    report: dict = {"build": str(build), "smoke": smoke, "backend": "torch", "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                    "dtype": {role: getattr(gen.manifest.recipe, role).dtype for role in ("target", "draft")},
                    "decoding": gen.manifest.recipe.decoding.model_dump(), "chat": chat, "new_tokens": new_tokens,
                    "prompts_file": str(PROMPTS.relative_to(ROOT)) if not smoke else "smoke words"}
    steps = {role: defaultdict(list) for role in ("target", "draft")}
    for role in steps:
        record_step_times(gen.engine(role), steps[role])
    report["load_s"] = round(time.perf_counter() - started, 1)
    params = SamplingParams(max_new_tokens=new_tokens)
    warm = SamplingParams(max_new_tokens=min(8, new_tokens))
    # SD and SSD at the build's K and budget, set explicitly: a mode named "ssd" alone lets the load policy pick each
    # round's option (AR, SD or SSD) from measured costs; this measures SSD itself
    settings = {mode: gen.resolve(mode, params).settings for mode in MODES}
    report["settings"] = {mode: dataclasses.asdict(value) for mode, value in settings.items()}
    for mode in MODES:      # untimed: kernel compiles, the first use of every bucket
        gen.generate([prompts[0]], warm, mode=settings[mode], chat=chat)
    report["warmup_s"] = round(time.perf_counter() - started - report["load_s"], 1)
    for role in steps:
        steps[role].clear()
    report["placement"] = placement(gen)
    rows: list[dict] = []
    for index, prompt in enumerate(prompts):
        if time.perf_counter() - started > budget_s:
            report["truncated"] = f"time budget of {budget_s:.0f} s reached after {index} of {len(prompts)} prompts"
            break
        row = {"prompt": index}
        for mode in MODES:
            [result] = gen.generate([prompt], params, mode=settings[mode], chat=chat)
            row[mode] = {"tokens": result.token_ids, "stats": {k: result.stats.get(k) for k in (
                "generated_tokens", "elapsed_s", "tokens_per_s", "ttft_s", "rounds", "mean_accepted",
                "acceptance_rate", "cache_hit_rate", "draft_latency_s", "verify_latency_s")}}
        rows.append(row)
        report["modes"] = summarise(rows)
        report["step_ms"] = {role: step_summary(sink) for role, sink in steps.items()}
        report["seconds"] = round(time.perf_counter() - started, 1)
        if json_path:
            json_path.write_text(json.dumps(report, indent=2))
    report["prompts_run"] = len(rows)
    report["ok"] = bool(rows) and all(report["modes"][mode]["equal_to_ar"] == len(rows) for mode in ("sd", "ssd"))
    if json_path:
        json_path.write_text(json.dumps(report, indent=2))
    return report


def summarise(rows: list[dict]) -> dict:
    """Per mode over the prompts run: tokens/s, acceptance, hit rate, ms per round, prompts equal to AR."""
    out = {}
    for mode in MODES:
        stats = [row[mode]["stats"] for row in rows]
        tokens = sum(s["generated_tokens"] for s in stats)
        seconds = sum(s["elapsed_s"] for s in stats)

        def mean(key: str, scale: float = 1.0):
            values = [s[key] for s in stats if s.get(key) is not None]
            return round(scale * statistics.mean(values), 4) if values else None
        out[mode] = {"tokens": tokens, "seconds": round(seconds, 3),
                     "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
                     "equal_to_ar": sum(row[mode]["tokens"] == row["ar"]["tokens"] for row in rows),
                     "mean_accepted": mean("mean_accepted"), "acceptance_rate": mean("acceptance_rate"),
                     "cache_hit_rate": mean("cache_hit_rate"), "draft_ms_per_round": mean("draft_latency_s", 1e3),
                     "verify_ms_per_round": mean("verify_latency_s", 1e3), "ttft_ms": mean("ttft_s", 1e3)}
    ar = out["ar"]["tokens_per_s"]
    for mode in ("sd", "ssd"):
        out[mode]["speedup_vs_ar"] = round(out[mode]["tokens_per_s"] / ar, 3) if ar and out[mode]["tokens_per_s"] \
            else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The real pair on one GPU: AR, SD and SSD through the torch backend.")
    parser.add_argument("--build", type=Path, default=ROOT / "build" / "qwen2.5-coder-1.5b-torch")
    parser.add_argument("--smoke", action="store_true", help="a tiny build on CPU: the code path, not a measurement")
    parser.add_argument("--write-smoke-pair", type=Path, metavar="DIR", help="write the smoke pair's files and exit")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="start no new prompt after this many seconds (loading included)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.write_smoke_pair:
        print(write_smoke_pair(args.write_smoke_pair))
        return 0
    import torch
    if not args.smoke and not torch.cuda.is_available():
        print(f"pair_session: no CUDA device visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}); "
              "the measurement needs one GPU (--smoke runs the code path on CPU)", file=sys.stderr)
        return 2
    if not (args.build / "manifest.json").is_file():
        print(f"pair_session: no build at {args.build}: fetch the pair (python -m ssd_trt.models.fetch qwen2.5-coder) "
              "and build it (python -m ssd_trt.build recipes/qwen2.5-coder-1.5b-torch.yaml)", file=sys.stderr)
        return 3
    prompts = SMOKE_PROMPTS[:args.prompts] if args.smoke else pair_prompts(args.prompts)
    report = run(args.build, prompts, args.new_tokens, chat=not args.smoke, budget_s=args.budget_s,
                 json_path=args.json, smoke=args.smoke)
    print(f"{'mode':<4} {'tok/s':>8} {'x AR':>6} {'accepted':>8} {'hit rate':>8} {'draft ms':>8} {'verify ms':>9} "
          f"{'== AR':>6}")
    for mode, row in report.get("modes", {}).items():
        def cell(value, spec: str) -> str:
            return "-" if value is None else format(value, spec)
        print(f"{mode:<4} {cell(row['tokens_per_s'], '.1f'):>8} {cell(row.get('speedup_vs_ar'), '.2f'):>6} "
              f"{cell(row['mean_accepted'], '.2f'):>8} {cell(row['cache_hit_rate'], '.2f'):>8} "
              f"{cell(row['draft_ms_per_round'], '.1f'):>8} {cell(row['verify_ms_per_round'], '.1f'):>9} "
              f"{row['equal_to_ar']}/{report['prompts_run']:>3}")
    print("placement:", json.dumps(report["placement"]))
    print("step ms:", json.dumps(report.get("step_ms")))
    if report.get("truncated"):
        print("truncated:", report["truncated"])
    print("pair session:", "PASSED" if report["ok"] else "FAILED")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
