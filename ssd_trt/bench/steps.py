"""The whole-step benchmark: a build's target engine steps on the CPU, ssd-trt's kernel engine beside ONNX Runtime's
graph and llama.cpp on the same GGUF.

    python -m ssd_trt.bench.steps build/qwen2.5-coder-1.5b build/smollm2-135m --out docs/bench/steps

For every build and thread count (1: core 0; 2: cores 0 and 1), rounds interleaved (the machine's speed drifts),
medians over the rounds:

* ``kernel``: the target on ``engines/kernel_engine.py`` (the build's CPU tiles); ``ort``: the same target on ONNX
  Runtime's int8-activation graph (``engines/ort.py``, what ``cpu_kernel=False`` runs);
* ``decode``: one-token steps on one row holding ``--depth`` tokens (ms a token; tok/s = 1000 / ms); ``verify T``: a
  step of T tokens on the same row (what verifying T - 1 drafted tokens costs); ``prefill``: ``--prompt`` tokens into an
  empty row (the time to first token without tokenization);
* ``llama.cpp``: ``llama-bench -p 0 -n 32 -d DEPTH`` (its decode, ms a token) and ``llama-bench -p PROMPT -n 0`` (its
  prompt processing), same threads, same cores.

Writes ``steps.json`` and ``steps.png``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ssd_trt.bench.artifact import pyplot, write_artifact
from ssd_trt.bench.kernels import cpu_name
from ssd_trt.bench.llama_bench import binary
from ssd_trt.engines.affinity import pinned

VERIFY = (2, 4, 8)


def _llama_bench(gguf: Path, args: list[str], threads: int, cores: list[int]) -> float:
    """llama-bench's mean tokens/s for these arguments, pinned to ``cores``."""
    command = [str(binary("llama_bench")), "-m", str(gguf), *args, "-t", str(threads), "-r", "3", "-o", "json"]
    with pinned(cores):
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-400:]}")
    return float(json.loads(done.stdout)[0]["avg_ts"])


def _engines(build: Path, threads: int, cores: list[int]) -> dict:
    from ssd_trt.engines.factory import engine_spec
    from ssd_trt.engines.kernel_engine import KernelEngine
    from ssd_trt.engines.ort import OrtEngine
    from ssd_trt.kernels.artifact import load_cpu_tiles
    from ssd_trt.manifest import read_manifest
    manifest = read_manifest(build)
    spec = engine_spec(manifest, "target")
    return {"kernel": KernelEngine(load_cpu_tiles(build / "target"), spec, threads, cores),
            "ort": OrtEngine(build / "target" / "model.ort.onnx", spec, threads, cores, int8_activations=True)}


def _times(engine, depth: int, prompt: int, rng) -> dict[str, float]:
    """ms of: a one-token step at ``depth`` (median of 8), each verify step (median of 5), a prefill of ``prompt``."""
    out = {}
    engine.reset(1)
    start = time.perf_counter()
    engine.forward(rng.integers(100, 5000, (1, prompt)), np.arange(prompt)[None])
    out["prefill"] = 1e3 * (time.perf_counter() - start)
    engine.reset(1)
    engine.forward(rng.integers(100, 5000, (1, depth)), np.arange(depth)[None])
    for tokens, repeats in ((1, 8), *((t, 5) for t in VERIFY)):
        times = []
        for _ in range(repeats):
            ids = rng.integers(100, 5000, (1, tokens))
            start = time.perf_counter()
            engine.forward(ids, depth + np.arange(tokens)[None])
            times.append(1e3 * (time.perf_counter() - start))
            engine.rollback(np.array([depth]))
        out["decode" if tokens == 1 else f"verify {tokens}"] = statistics.median(times)
    return out


def measure(build: Path, threads: int, rounds: int, depth: int, prompt: int) -> dict:
    from tqdm import tqdm

    from ssd_trt.manifest import read_manifest
    cores = list(range(threads))
    gguf = Path(read_manifest(build).model("target").source)
    rng = np.random.default_rng(0)
    with pinned(cores):                   # the caller's thread is each engine's first
        engines = _engines(build, threads, cores)
        for engine in engines.values():   # warm: first-run allocations, the weights' page faults
            _times(engine, 16, 16, rng)
    llama = binary("llama_bench") is not None
    samples: dict[str, dict[str, list[float]]] = {}
    for _ in tqdm(range(rounds), desc=f"{build.name}, {threads} thread(s)", file=sys.stderr):
        for name, engine in engines.items():
            with pinned(cores):
                for shape, ms in _times(engine, depth, prompt, rng).items():
                    samples.setdefault(name, {}).setdefault(shape, []).append(ms)
        if llama:
            decode = 1e3 / _llama_bench(gguf, ["-p", "0", "-n", "32", "-d", str(depth)], threads, cores)
            prefill = 1e3 * prompt / _llama_bench(gguf, ["-p", str(prompt), "-n", "0"], threads, cores)
            samples.setdefault("llama.cpp", {}).setdefault("decode", []).append(decode)
            samples["llama.cpp"].setdefault("prefill", []).append(prefill)
    engines["kernel"].close()
    ms = {way: {shape: statistics.median(v) for shape, v in shapes.items()} for way, shapes in samples.items()}
    kernel = ms["kernel"]
    ratios = {"kernel decode tok/s": 1e3 / kernel["decode"],
              **{f"kernel verify {t} / decode": kernel[f"verify {t}"] / kernel["decode"] for t in VERIFY},
              "kernel decode tok/s / ort": ms["ort"]["decode"] / kernel["decode"]}
    if llama:
        ratios["kernel decode tok/s / llama-bench"] = ms["llama.cpp"]["decode"] / kernel["decode"]
        ratios["kernel prefill / llama.cpp prefill"] = kernel["prefill"] / ms["llama.cpp"]["prefill"]
    return {"build": str(build), "gguf": str(gguf), "threads": threads, "cores": cores,
            "path": engines["kernel"].path, "depth": depth, "prompt": prompt, "ms": ms, "ms_all": samples,
            "ratios": ratios, "llama_cpp_note": None if llama else "llama-bench is not built "
                                                                   "(bash scripts/install_llama_cpp.sh)"}


def table(result: dict) -> str:
    lines = []
    for run in result["runs"]:
        ms, r = run["ms"], run["ratios"]
        lines.append(f"\n{Path(run['build']).name}, {run['threads']} thread(s), path {run['path']}, depth "
                     f"{run['depth']}, prompt {run['prompt']} tokens")
        shapes = ["decode", *(f"verify {t}" for t in VERIFY), "prefill"]
        lines.append("| engine | " + " | ".join(f"{s} ms" for s in shapes) + " | decode tok/s |")
        lines.append("|---" * (len(shapes) + 2) + "|")
        for way, by_shape in ms.items():
            cells = [f"{by_shape[s]:.1f}" if s in by_shape else "–" for s in shapes]
            lines.append(f"| {way} | " + " | ".join(cells) + f" | {1e3 / by_shape['decode']:.1f} |")
        summary = ", ".join(f"{name} {value:.2f}" for name, value in r.items())
        lines.append(f"\n{summary}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    runs = result["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.6), squeeze=False)
    shapes = ["decode", *(f"verify {t}" for t in VERIFY), "prefill"]
    for ax, run in zip(axes[0], runs):
        ways = list(run["ms"])
        width = 0.8 / len(ways)
        for i, way in enumerate(ways):
            values = [run["ms"][way].get(s, np.nan) for s in shapes]
            ax.bar(np.arange(len(shapes)) + i * width, values, width, label=way)
        ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2, shapes, rotation=30, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(f"{Path(run['build']).name}, {run['threads']} thread(s)", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"target engine steps ({result['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd_trt.bench.steps", description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", type=Path, help="build folders whose target has CPU tiles")
    parser.add_argument("--out", type=Path, help="folder for steps.json and steps.png")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--depth", type=int, default=128, help="tokens a row holds before the decode steps")
    parser.add_argument("--prompt", type=int, default=128, help="tokens of the timed prefill")
    args = parser.parse_args(argv)
    runs = [measure(build, int(t), args.rounds, args.depth, args.prompt)
            for build in args.builds for t in args.threads.split(",")]
    result = {"command": "python -m ssd_trt.bench.steps " + " ".join(argv if argv is not None else sys.argv[1:]),
              "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, "runs": runs}
    if args.out:
        write_artifact(result, args.out / "steps.json", plot, table)
    else:
        print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
