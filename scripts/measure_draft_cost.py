"""One draft token vs one target token in this engine (ONNX Runtime, 1 thread each, single-token decode
steps at a 100-token context, interleaved so machine load affects both alike).
Run: python scripts/measure_draft_cost.py build/smollm2-135m"""
import sys
import time

import numpy as np

from ssd_trt.runtime import Generator, RuntimeOptions

gen = Generator(sys.argv[1] if len(sys.argv) > 1 else "build/smollm2-135m",
                RuntimeOptions(target_cores=None, draft_cores=None))
engines = {role: gen.engine(role) for role in ("target", "draft")}
for engine in engines.values():
    engine.reset(1)
    engine.forward(np.arange(100)[None] + 300, np.arange(100)[None])
times = {role: [] for role in engines}
for step in range(60):
    for role, engine in engines.items():
        start = time.perf_counter()
        engine.forward(np.array([[400 + step]]), engine.lengths[:, None].astype(np.int64))
        times[role].append(time.perf_counter() - start)
median = {role: float(np.median(t[10:])) for role, t in times.items()}
print(f"target {median['target'] * 1e3:.2f} ms/token, draft {median['draft'] * 1e3:.2f} ms/token, "
      f"ratio {median['draft'] / median['target']:.3f}")
