"""The CPU kernel engine's whole step, two kernel source versions side by side in one process, interleaved: ms of
a decode step (1 token) and of verifying T tokens at a context of L, for a build's target or draft, 1 thread on
core 0 (a development tool; the project's benchmarks are ``python -m ssd_trt.bench``).

    python research/cpu/ab_step.py build/qwen2.5-coder-1.5b target OLD_CSRC NEW_CSRC --tokens 1,2,4,8
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from ssd_trt.engines.base import EngineSpec
from ssd_trt.engines.kernel_engine import KernelEngine
from kernel_sources import use_sources
from ssd_trt.kernels.artifact import load_cpu_tiles


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("build", type=Path)
    ap.add_argument("role")
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    os.sched_setaffinity(0, {0})
    tiles = load_cpu_tiles(args.build / args.role)
    shape = tiles.shape
    spec = EngineSpec(name=args.role, vocab_size=shape["vocab_size"], num_layers=shape["num_layers"],
                      num_kv_heads=shape["num_kv_heads"], head_dim=shape["head_dim"], max_batch=1,
                      max_context=args.context + 64)
    engines = {}
    for label, src in (("old", args.old), ("new", args.new)):
        use_sources(src)
        engines[label] = KernelEngine(tiles, spec, threads=1, cores=[0])
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, shape["vocab_size"], (1, args.context))
    for e in engines.values():
        e.reset(1)
        e.forward(prefix, np.arange(args.context)[None])
    tokens = [int(t) for t in args.tokens.split(",")]
    times: dict[tuple[str, int], list[float]] = {}
    for i in range(args.rounds):
        for t in tokens:
            ids = rng.integers(0, shape["vocab_size"], (1, t))
            pos = np.arange(args.context, args.context + t)[None]
            for label in ("old", "new") if i % 2 == 0 else ("new", "old"):
                e = engines[label]
                best = float("inf")
                for _ in range(3):
                    e.rollback(np.array([args.context]))
                    start = time.perf_counter()
                    e.forward(ids, pos)
                    best = min(best, time.perf_counter() - start)
                times.setdefault((label, t), []).append(1e3 * best)
    for t in tokens:
        old, new = (statistics.median(times[(k, t)]) for k in ("old", "new"))
        base = {k: statistics.median(times[(k, tokens[0])]) for k in ("old", "new")}
        print(f"{args.role} T={t}: old {old:6.1f} ms ({old / base['old']:.2f}x T={tokens[0]})  "
              f"new {new:6.1f} ms ({new / base['new']:.2f}x)  new/old {new / old:.3f}")


if __name__ == "__main__":
    main()
