"""The build's TensorRT step: engines when TensorRT and a GPU are present, a clear reason otherwise.

TensorRT is never imported here; ``ssd_trt.trt`` probes for it in a subprocess (constructing
TensorRT objects without a GPU segfaults the process).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ssd_trt.manifest import artifact_entry
from ssd_trt.recipe import Recipe


def maybe_build_engines(recipe: Recipe, out: Path, models: dict[str, Any]) -> dict[str, Any]:
    if recipe.engine.backend == "ort":
        return {"status": "skipped", "reason": "recipe asks for backend 'ort' (ONNX Runtime only)"}
    try:
        from ssd_trt.engines.availability import probe_tensorrt
        from ssd_trt.trt.engine_build import build_engine
    except ImportError as exc:  # the TensorRT path is optional
        return {"status": "stopped at ONNX", "reason": f"TensorRT path not installed ({exc})"}
    available, reason = probe_tensorrt()
    if not available:
        if recipe.engine.backend == "trt":
            from ssd_trt.errors import SsdTrtError
            raise SsdTrtError(f"recipe asks for backend 'trt' but TensorRT cannot run here: {reason}. "
                              f"ONNX artifacts are in {out}; set engine.backend to 'auto' or 'ort' to use them")
        return {"status": "stopped at ONNX", "reason": reason}
    e = recipe.engine
    limits = e.limits
    artifacts, engines = [], {}
    for role in ("target", "draft"):
        engine_path = out / role / "engine.plan"
        engines[role] = build_engine(out / role / "model.trt.onnx", engine_path, limits, e.trt_precision,
                                     out / "timing.cache", out / role / "build.log")
        artifacts.append({"role": role, "flavour": "engine", **artifact_entry(out, engine_path)})
    return {"status": "built", "reason": "TensorRT and a GPU were found", "engines": engines,
            "artifacts": artifacts}
