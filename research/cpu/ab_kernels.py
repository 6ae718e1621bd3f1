"""Two versions of the kernel sources side by side, interleaved in one process: ms per pass over a model's linear
layers at M rows, on one path and one thread (a development tool: the kernel benchmark, ``python -m
ssd_trt.bench.kernels``, is what the docs cite).

    python research/cpu/ab_kernels.py --old /tmp/csrc_old --new ssd_trt/kernels/csrc --rows 1,4,8 --rounds 7

Each source folder is compiled into its own cache entry; both libraries read the same tiles.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from ssd_trt.bench.kernels import MODELS, ROOT, OursPass, linear_tensors
from ssd_trt.kernels import native
from ssd_trt.models.sources import resolve_source
from kernel_sources import library_of, use_library


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, required=True)
    ap.add_argument("--model", default="real target")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--path", default="auto")
    ap.add_argument("--check", action="store_true", help="also compare the two versions' outputs")
    args = ap.parse_args()
    libs = {"old": library_of(args.old.resolve()), "new": library_of(args.new.resolve())}
    name = next(n for n in MODELS if n.startswith(args.model))
    source = MODELS[name]
    tensors = linear_tensors(resolve_source(source).path if source.startswith("pkg:") else ROOT / source)
    passes = {}
    shared = None
    for label, lib in libs.items():
        use_library(lib)
        one = OursPass.__new__(OursPass)
        one.kernels = native.Kernels(path=args.path, threads=1, cores=[0])
        if shared is None:
            from ssd_trt.kernels.tiles import tile_gguf
            shared = [native.NativeWeight(tile_gguf(raw, kind, k)) for _, kind, k, raw in tensors]
        one.weights, one.bytes = shared, sum(w.weight.nbytes for w in shared)
        passes[label] = one
    print(name, {k: p.kernels.path for k, p in passes.items()}, f"{shared and passes['old'].bytes / 2**30:.2f} GiB")
    if args.check:
        rng = np.random.default_rng(1)
        for w in shared[:12]:
            x = rng.standard_normal((5, w.k)).astype(np.float32)
            a, b = (passes[k].kernels.matmul(x, [w]) for k in ("old", "new"))
            print(f"  {w.weight.kind} {w.k}x{w.n}: max |old-new| {np.abs(a - b).max():.3g} (scale {np.abs(a).max():.3g})")
    rows = [int(r) for r in args.rows.split(",")]
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for m in rows:
            for label in ("old", "new") if _ % 2 == 0 else ("new", "old"):
                times.setdefault((label, m), []).append(1e3 * min(passes[label].time(m) for _ in range(2)))
    for m in rows:
        old, new = (statistics.median(times[(k, m)]) for k in ("old", "new"))
        print(f"M={m:3d}  old {old:7.2f} ms  new {new:7.2f} ms  new/old {new / old:.3f}   "
              f"(old x M=1 {old / statistics.median(times[('old', rows[0])]):.2f}, "
              f"new x M=1 {new / statistics.median(times[('new', rows[0])]):.2f})")


if __name__ == "__main__":
    main()
