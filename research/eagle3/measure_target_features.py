"""What returning its hidden states for a feature (EAGLE-3) draft costs the target, measured.

    python research/eagle3/measure_target_features.py build/smollm2-135m --out docs/bench/target_features.json

The build's target is exported twice the way the build exports it (its block weights, its activations),
once as is and once also returning the residual stream entering layers 2, L/2 and L-3 (``features``,
``Decoder.feature_layers``); both run on one core, decode (1 token) and verification (4 tokens) steps after
a 64-token prefix, interleaved, and the median step times are compared.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def export(model, recipe_model, source, out: Path) -> Path:
    from ssd_trt.export.block_weights import apply_block_weights, model_block_weights
    from ssd_trt.export.onnx_export import save_flavours, trace_step_graph
    traced = trace_step_graph(model)
    blocks = model_block_weights(recipe_model.weights, source, model, keep_8bit=recipe_model.activations == "int8")
    if blocks:
        traced, _ = apply_block_weights(traced, blocks)
    save_flavours(traced, out, datacenter=False)
    return out / "model.ort.onnx"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    from ssd_trt.engines.affinity import pinned
    from ssd_trt.engines.factory import engine_spec
    from ssd_trt.engines.ort import OrtEngine
    from ssd_trt.manifest import read_manifest
    from ssd_trt.models.decoder import with_target_features
    from ssd_trt.models.eagle3 import default_feature_layers
    from ssd_trt.models.loading import load_decoder
    from ssd_trt.models.sources import resolve_source
    manifest = read_manifest(args.build)
    recipe_model = manifest.recipe.target
    source = resolve_source(manifest.model("target").source)
    model, _ = load_decoder(source)
    layers = default_feature_layers(model.config.num_layers)
    spec = engine_spec(manifest, "target")
    int8 = recipe_model.activations == "int8"
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 20000, (1, 64))
    times: dict[str, dict[int, list[float]]] = {"plain": {1: [], 4: []}, "features": {1: [], 4: []}}
    with tempfile.TemporaryDirectory() as scratch, pinned((0,)):
        engines = {"plain": OrtEngine(export(model, recipe_model, source, Path(scratch) / "plain"), spec,
                                      int8_activations=int8),
                   "features": OrtEngine(export(with_target_features(model, layers), recipe_model, source,
                                                Path(scratch) / "features"), spec, int8_activations=int8)}
        for engine in engines.values():
            engine.reset(1)
            engine.forward(prefix, np.arange(64)[None])
        for _ in range(args.repeats):
            for tokens in (1, 4):
                for name, engine in engines.items():
                    ids = rng.integers(100, 20000, (1, tokens))
                    start = time.perf_counter()
                    engine.forward(ids, 64 + np.arange(tokens)[None])
                    times[name][tokens].append(1000 * (time.perf_counter() - start))
                    engine.rollback(np.array([64]))
        width = engines["features"].last_features.shape[-1]
    median = {name: {tokens: statistics.median(values) for tokens, values in by.items()} for name, by in times.items()}
    result = {"build": str(args.build), "feature_layers": list(layers), "feature_width": width,
              "threads": 1, "repeats": args.repeats, "prefix": 64,
              "median_ms": {name: {f"{t}_tokens": round(v, 3) for t, v in by.items()} for name, by in median.items()},
              "cost": {f"{t}_tokens": round(median["features"][t] / median["plain"][t] - 1, 4) for t in (1, 4)}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
