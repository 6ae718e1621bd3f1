"""Why the ONNX Runtime engine feeds one-token steps as two rows with int8 activations, measured.

    python research/cpu/measure_row_exact.py build/smollm2-135m --out docs/bench/row_exact.json

On the build's target (one core): after a 40-token prefix, 3 tokens are computed as one 3-token step and
as three 1-token steps, with and without the padding row; prints the largest logit difference to the
3-token step and whether the argmax agrees. Then the median time of a 1-token step with and without the
padding row (the padding's cost).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from ssd_trt.engines.affinity import pinned
    from ssd_trt.engines.factory import EngineSet
    from ssd_trt.manifest import read_manifest
    from ssd_trt.options import RuntimeOptions
    options = RuntimeOptions(target_threads=1, target_cores=(0,), spin=True)
    engine = EngineSet(args.build, read_manifest(args.build), {"target": options.placement("target")}).get("target")
    rng = np.random.default_rng(0)
    prefix, tokens = rng.integers(100, 20000, 40), rng.integers(100, 20000, 3)

    def logits(chunks: list[int]) -> np.ndarray:
        engine.reset(1)
        engine.forward(prefix[None], np.arange(40)[None], logit_indices=np.array([[39]]))
        out, start = [], 0
        for size in chunks:
            out.append(engine.forward(tokens[start:start + size][None], engine.lengths[:, None] + np.arange(size))[0])
            start += size
        return np.concatenate(out)

    def decode_ms() -> float:
        engine.reset(1)
        engine.forward(prefix[None], np.arange(40)[None], logit_indices=np.array([[39]]))
        times = []
        for _ in range(40):
            start = time.perf_counter()
            engine.forward(np.array([[7]]), engine.lengths[:, None])
            times.append(time.perf_counter() - start)
            engine.rollback(engine.lengths - 1)
        return 1e3 * float(np.median(times[5:]))

    report = {"build": str(args.build), "padding": engine.pad_single_rows}
    with pinned((0,)):
        for padded in (True, False):
            engine.pad_single_rows = padded
            chain, single = logits([3]), logits([1, 1, 1])
            report["padded" if padded else "unpadded"] = {
                "max_abs_logit_difference_1x3_vs_3": float(np.abs(single - chain).max()),
                "argmax_same": bool((single.argmax(-1) == chain.argmax(-1)).all()),
                "decode_step_ms": decode_ms()}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
