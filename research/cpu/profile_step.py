"""Where the time of a step goes, for docs/cpu_speed.md's profiles.

    python research/cpu/profile_step.py build/smollm2-135m            # ONNX Runtime: one target decode step
    python research/cpu/profile_step.py build/smollm2-135m --ssd      # py-spy: SSD's target and draft threads

The first runs 30 decode steps (one core) through a profiling ONNX Runtime session over the build's target
graph (``--rows`` rows of one token each) and prints the kernel time per op type (profiling inflates a step; read the shares). The second
records greedy SSD (paper-style placement, 6 prompts x 128 tokens) with py-spy and prints, per thread,
the share of samples inside ONNX Runtime and the ssd_trt functions the rest is spent in.
"""
from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SSD_RUN = r"""
import sys, ssd_trt
from ssd_trt.bench.prompts import load_prompts
from ssd_trt.bench.settings import PAPER_STYLE
gen = ssd_trt.load(sys.argv[1], PAPER_STYLE.options("ssd"))
for p in load_prompts()[:6]:
    gen.generate_ids([gen.encode(p.prompt, chat=True)], ssd_trt.SamplingParams(max_new_tokens=128), mode="ssd")
"""


def decode_step_profile(build: Path, steps: int = 30, rows: int = 1) -> None:
    import onnxruntime as ort
    from ssd_trt.engines.affinity import pinned
    from ssd_trt.engines.factory import EngineSet
    from ssd_trt.manifest import read_manifest
    from ssd_trt.options import RuntimeOptions
    options = RuntimeOptions(target_threads=1, target_cores=(0,), spin=True)
    engine = EngineSet(build, read_manifest(build), {"target": options.placement("target")}).get("target")
    profiled = ort.SessionOptions()
    profiled.intra_op_num_threads = 1
    profiled.enable_profiling = True
    profiled.log_severity_level = 3
    profiled.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "step")
    profiled.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "4" if engine.int8_activations else "1")
    engine.session = ort.InferenceSession(str(build / "target" / "model.ort.onnx"), profiled,
                                          providers=["CPUExecutionProvider"])
    with pinned((0,)):
        engine.reset(rows)
        engine.forward(np.tile(np.arange(40) + 5, (rows, 1)), np.tile(np.arange(40), (rows, 1)),
                       logit_indices=np.full((rows, 1), 39))
        for _ in range(steps):
            engine.forward(np.full((rows, 1), 7), engine.lengths[:, None])
    events = json.loads(Path(engine.session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"][-steps:]
    decoding_from = runs[0]["ts"]                 # the prefill before is not counted
    kernel, nodes = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= decoding_from:
            kernel[e["args"]["op_name"]] += e["dur"]
            nodes[e["args"]["op_name"]] += 1
    count = len(runs)
    total = sum(kernel.values()) / count / 1e3
    print(f"{build}, {rows} row(s): {count} profiled decode steps; model_run median {np.median([r['dur'] for r in runs]) / 1e3:.2f} ms "
          f"(profiling on); kernel time {total:.2f} ms/step over {sum(nodes.values()) / count:.0f} nodes/step")
    for op, us in kernel.most_common(10):
        print(f"  {op:22s} {us / count / 1e3:6.2f} ms/step ({100 * us / count / 1e3 / total:4.1f}%)  {nodes[op] / count:5.0f} nodes")


def ssd_thread_profile(build: Path) -> None:
    raw = Path(tempfile.mkdtemp()) / "ssd.raw"
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")    # pip install py-spy
    subprocess.run([py_spy, "record", "-r", "200", "-f", "raw", "-o", str(raw), "--", sys.executable, "-c", SSD_RUN,
                    str(build)], check=True, cwd=ROOT, capture_output=True)
    samples, in_ort, where = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if any("Generator.__init__" in f or "OrtEngine.__init__" in f for f in frames):
            continue                                  # loading, not decoding
        thread, ort_run = frames[0], any("run_with_iobinding" in f for f in frames)
        samples[thread] += int(n)
        in_ort[thread] += int(n) if ort_run else 0
        own = [f.split(" (")[0] for f in frames if "ssd_trt" in f]
        where[thread]["ONNX Runtime step" if ort_run else (own[-1] if own else frames[-1][:50])] += int(n)
    for thread, total in samples.most_common(2):
        print(f"thread {thread[:50]}: {total} samples, {100 * in_ort[thread] / total:.1f}% inside ONNX Runtime steps")
        for name, n in where[thread].most_common(6):
            print(f"  {100 * n / total:5.1f}%  {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", type=Path)
    parser.add_argument("--ssd", action="store_true", help="py-spy SSD's threads instead of one decode step")
    parser.add_argument("--rows", type=int, default=1, help="rows of the profiled decode step (one token each)")
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d')} python research/cpu/profile_step.py {args.build}"
          f"{' --ssd' if args.ssd else ''}")
    ssd_thread_profile(args.build) if args.ssd else decode_step_profile(args.build, rows=args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
