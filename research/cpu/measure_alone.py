"""What the target's step costs on the draft's core too: one-core against two-core steps of the build's target.

    python research/cpu/measure_alone.py build/smollm2-135m --out docs/bench/target_alone.json

The engine step runs the target on a second ONNX Runtime session, one thread on each of the target's and the
draft's cores, whenever the draft is idle (``Engine.alone``: prefills, AR rounds, SD's verification, paused SSD).
This times both sessions of the runtime's default placement (target core 0, draft core 1) on the shapes the
engine step runs: 1 to 16 rows, steps of 1 to 3 tokens after a 64-token context, and a 48-token prefill per row;
the two sessions in interleaved rounds (drift in the machine's speed hits both alike), medians. It also checks that
the two sessions' logits are bit-identical at each shape (the engine step's exactness rests on it).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CONTEXT, PREFILL, ROUNDS, REPEATS = 64, 48, 6, 3
ROWS, TOKENS = (1, 2, 4, 8, 16), (1, 2, 3)


def timed(engine, alone: bool, rows: int, tokens: int, seed: int) -> tuple[float, np.ndarray]:
    """Median seconds of ``REPEATS`` steps of ``tokens`` on ``rows`` rows after the context (each rolled back), and
    the logits of the last."""
    ids = np.random.default_rng(seed).integers(100, 20000, (rows, tokens))
    times, logits = [], None
    with engine.alone() if alone else nullcontext():
        for _ in range(REPEATS):
            start = time.perf_counter()
            logits = engine.forward(ids, engine.lengths[:, None] + np.arange(tokens))
            times.append(time.perf_counter() - start)
            engine.rollback(engine.lengths - tokens)
    return float(np.median(times)), logits


def prefill_seconds(engine, alone: bool, rows: int) -> float:
    ids = np.random.default_rng(rows).integers(100, 20000, (rows, PREFILL))
    engine.reset(rows)
    with engine.alone() if alone else nullcontext():
        start = time.perf_counter()
        engine.forward(ids, np.broadcast_to(np.arange(PREFILL), (rows, PREFILL)).copy())
        return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from tqdm import tqdm

    from ssd_trt.engines.affinity import pinned
    from ssd_trt.engines.factory import EngineSet
    from ssd_trt.manifest import read_manifest
    from ssd_trt.options import RuntimeOptions
    options = RuntimeOptions().for_build(threads_per_engine=1)
    engine = EngineSet(args.build, read_manifest(args.build), {"target": options.placement("target")}).get("target")
    if not engine.alone_sessions:
        raise SystemExit("the default placement has no second core here: nothing to compare")
    steps = {(rows, tokens): {"one_core": [], "two_cores": []} for rows in ROWS for tokens in TOKENS}
    prefills = {rows: {"one_core": [], "two_cores": []} for rows in ROWS}
    identical = True
    with pinned(options.target_cores):
        for round_ in tqdm(range(ROUNDS), desc="rounds", unit="round"):
            for rows in ROWS:
                for alone, name in ((False, "one_core"), (True, "two_cores")):
                    prefills[rows][name].append(prefill_seconds(engine, alone, rows))
                engine.reset(rows)
                engine.forward(np.random.default_rng(0).integers(100, 20000, (rows, CONTEXT)),
                               np.broadcast_to(np.arange(CONTEXT), (rows, CONTEXT)).copy())
                for tokens in TOKENS:
                    one, one_logits = timed(engine, False, rows, tokens, round_)
                    two, two_logits = timed(engine, True, rows, tokens, round_)
                    identical &= bool(np.array_equal(one_logits, two_logits))
                    steps[(rows, tokens)]["one_core"].append(one)
                    steps[(rows, tokens)]["two_cores"].append(two)
    report = {"build": str(args.build), "context": CONTEXT, "prefill_tokens_per_row": PREFILL, "rounds": ROUNDS,
              "placement": "target core 0; two cores: a second session with a thread on cores 0 and 1",
              "logits_bit_identical": identical, "steps": [], "prefills": []}
    for (rows, tokens), times in steps.items():
        one, two = (1e3 * float(np.median(times[k])) for k in ("one_core", "two_cores"))
        report["steps"].append({"rows": rows, "tokens": tokens, "one_core_ms": round(one, 2),
                                "two_cores_ms": round(two, 2), "ratio": round(two / one, 3)})
    for rows, times in prefills.items():
        one, two = (1e3 * float(np.median(times[k])) for k in ("one_core", "two_cores"))
        report["prefills"].append({"rows": rows, "one_core_ms": round(one, 1), "two_cores_ms": round(two, 1),
                                   "ratio": round(two / one, 3)})
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
