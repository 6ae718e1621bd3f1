"""Why one-token steps attend two queries, measured: what a one-token step computes and costs, three ways.

    python research/cpu/measure_row_exact.py build/smollm2-135m --out docs/bench/row_exact.json

On the build's target (int8 activations, one core), at batch 1 and 16, after a 40-token prefix 3 tokens per row
are computed as one 3-token step and as three 1-token steps, by:

* ``in_graph``: the build's graph, which attends a one-token step as two queries (export/fused_graph.py);
* ``uncopied``: the same graph with that copy switched off (its T = 1 test never true);
* ``engine_padded``: the uncopied graph fed a second, discarded token per row by the engine (the traced graph's
  way, engines/ort.py), so the projections compute two tokens per row.

For each: the largest logit difference to the 3-token step, whether the argmax agrees, and the median time of a
one-token step (the three ways timed in interleaved rounds, so drift in the machine's speed hits all alike).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PREFIX, NEW = 40, 3


def uncopied_graph(build: Path) -> Path:
    """The build's target graph with its one-token copy off, beside the build's weights (its external data)."""
    import onnx
    from ssd_trt.export.fused_graph import without_one_token_copy
    graph = onnx.load(str(build / "target" / "model.ort.onnx"), load_external_data=False)
    path = build / "target" / "model.uncopied.onnx"
    onnx.save_model(without_one_token_copy(graph), str(path))
    return path


def _inputs(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(100, 20000, (batch, PREFIX)), rng.integers(100, 20000, (batch, NEW))


def _prefill(engine, prefix: np.ndarray) -> None:
    batch = prefix.shape[0]
    engine.reset(batch)
    engine.forward(prefix, np.tile(np.arange(PREFIX), (batch, 1)), logit_indices=np.full((batch, 1), PREFIX - 1))


def exactness(engine, batch: int) -> dict:
    prefix, tokens = _inputs(batch)

    def logits(chunks: list[int]) -> np.ndarray:
        _prefill(engine, prefix)
        out, start = [], 0
        for size in chunks:
            out.append(engine.forward(tokens[:, start:start + size], engine.lengths[:, None] + np.arange(size)))
            start += size
        return np.concatenate(out, axis=1)

    chain, single = logits([NEW]), logits([1] * NEW)
    return {"max_abs_logit_difference_1x3_vs_3": float(np.abs(single - chain).max()),
            "argmax_same": bool((single.argmax(-1) == chain.argmax(-1)).all())}


def decode_times(engine, batch: int, steps: int = 10) -> list[float]:
    """Seconds of ``steps`` one-token steps at a 40-token context (each rolled back)."""
    _prefill(engine, _inputs(batch)[0])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.forward(np.full((batch, 1), 7), engine.lengths[:, None])
        times.append(time.perf_counter() - start)
        engine.rollback(engine.lengths - 1)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from ssd_trt.engines.affinity import pinned
    from ssd_trt.engines.factory import EngineSet
    from ssd_trt.engines.ort import OrtEngine
    from ssd_trt.manifest import read_manifest
    from ssd_trt.options import RuntimeOptions
    options = RuntimeOptions(target_threads=1, target_cores=(0,), spin=True, target_alone_threads=1)
    engine = EngineSet(args.build, read_manifest(args.build), {"target": options.placement("target")}).get("target")
    report: dict = {"build": str(args.build), "prefix_tokens": PREFIX, "new_tokens_per_row": NEW, "threads": 1}
    path = uncopied_graph(args.build)
    try:
        plain = OrtEngine(path, engine.spec, threads=1, int8_activations=True)
        ways = {"in_graph": (engine, False), "uncopied": (plain, False), "engine_padded": (plain, True)}
        with pinned((0,)):
            for batch in (1, 16):
                row, times = {}, {name: [] for name in ways}
                for name, (model, padded) in ways.items():
                    model.pad_single_rows = padded
                    row[name] = exactness(model, batch)
                for _ in range(8):          # interleaved rounds
                    for name, (model, padded) in ways.items():
                        model.pad_single_rows = padded
                        times[name] += decode_times(model, batch)[2:]
                for name in ways:
                    row[name]["decode_step_ms"] = 1e3 * float(np.median(times[name]))
                report[f"batch_{batch}"] = row
    finally:
        path.unlink()
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
