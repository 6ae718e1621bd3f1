"""The kernel on one weight whose tiles stay in cache (the first 256 columns of the real target's first Q4_K and
Q6_K weight of K = 1536, 16 calls a timing): G multiply-adds a second at M rows, the compute bound without the
memory stream (a development tool; the kernel benchmark, ``python -m ssd_trt.bench.kernels``, is what the docs cite
for speed).

    python research/cpu/measure_incache.py [CSRC_FOLDER]
"""
from pathlib import Path
import sys, time, numpy as np
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ssd_trt.bench.kernels import linear_tensors, ROOT, MODELS
from ssd_trt.kernels import native
from kernel_sources import use_sources
from ssd_trt.kernels.tiles import tile_gguf

if len(sys.argv) > 1:
    use_sources(Path(sys.argv[1]))
ts = linear_tensors(ROOT / MODELS["real target (Qwen2.5-Coder-1.5B Q4_K_M)"])
picked = {}
for name, kind, k, raw in ts:
    if kind not in picked and k == 1536:
        picked[kind] = (name, kind, k, raw)
kern = native.Kernels(threads=1, cores=[0])
print(kern.path)
for kind, (name, _, k, raw) in sorted(picked.items()):
    w = native.NativeWeight(tile_gguf(np.ascontiguousarray(raw[:256]), kind, k))
    for m in (1, 4, 8, 12):
        x = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32)
        best = 1e9
        for rep in range(5):
            t = time.perf_counter()
            for _ in range(40):
                kern.matmul(x, [w]*16)
            best = min(best, (time.perf_counter() - t) / 40 / 16)
        print(f"{kind} {name} {k}x256 M={m}: {best*1e6:7.1f} us  {m*k*256/best/1e9:6.1f} GMAC/s  {w.weight.nbytes/best/1e9:5.1f} GB/s")
