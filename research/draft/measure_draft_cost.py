"""One draft token vs one target token in this engine (ONNX Runtime, 1 thread each, single-token decode
steps at a 100-token context, interleaved so machine load affects both alike).

The draft is measured as the runtime uses it, copy component included, on two contexts: fresh tokens
(no suffix recurs: the copy lookup finds nothing) and a repeating 20-token pattern (every step
matches 8 tokens and mixes the follower in: its worst case).
Run: python research/draft/measure_draft_cost.py build/smollm2-135m"""
import sys
import time

import numpy as np

from ssd_trt.runtime import Generator, RuntimeOptions

gen = Generator(sys.argv[1] if len(sys.argv) > 1 else "build/smollm2-135m",
                RuntimeOptions(target_cores=None, draft_cores=None))
engines = {role: gen.engine(role) for role in ("target", "draft")}
CONTEXTS = {"fresh": lambda i: 300 + i, "repeating": lambda i: 300 + i % 20}
for name, token in CONTEXTS.items():
    for engine in engines.values():
        engine.reset(1)
        engine.forward(np.array([[token(i) for i in range(100)]]), np.arange(100)[None])
    times = {role: [] for role in engines}
    for step in range(100, 160):
        for role, engine in engines.items():
            start = time.perf_counter()
            engine.forward(np.array([[token(step)]]), engine.lengths[:, None].astype(np.int64))
            times[role].append(time.perf_counter() - start)
    median = {role: float(np.median(t[10:])) for role, t in times.items()}
    print(f"{name} context: target {median['target'] * 1e3:.2f} ms/token, draft {median['draft'] * 1e3:.2f} "
          f"ms/token, ratio {median['draft'] / median['target']:.3f}")
