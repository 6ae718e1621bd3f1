"""The build's TensorRT step: plans from the edition the recipe names that can build here, or why not.

TensorRT is never imported here: each edition is probed in a subprocess (``engines/availability.py``;
constructing data-centre TensorRT objects without a GPU kills the process). TensorRT for RTX builds
without a GPU, for the recipe's compute capabilities; the data-centre edition builds on its GPU.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ssd_trt.errors import SsdTrtError
from ssd_trt.manifest import ROLES, recipe_fingerprint
from ssd_trt.recipe import Recipe
from ssd_trt.engines.editions import RTX, Edition, editions_for


def can_build(edition: Edition) -> tuple[bool, str]:
    """(True, what) when ``edition`` can build plans here, else (False, why and how to fix it)."""
    from ssd_trt.engines.availability import probe_tensorrt, probe_tensorrt_rtx
    if not edition.installed():
        return False, f"{edition.module} is not installed ({edition.install_hint})"
    if edition is RTX:
        probe = probe_tensorrt_rtx()
        return probe["build"], probe["reason"]
    return probe_tensorrt()


def maybe_build_engines(recipe: Recipe, out: Path) -> dict[str, Any]:
    """Build both models' plans with the first edition of ``engine.tensorrt`` that can build here."""
    if recipe.engine.backend == "ort":
        return {"status": "skipped", "reason": "recipe asks for backend 'ort' (ONNX Runtime only)", "plans": []}
    if not editions_for(recipe.engine.tensorrt):
        return {"status": "skipped", "reason": "recipe sets engine.tensorrt: none (ONNX Runtime only)", "plans": []}
    reasons = []
    for edition in editions_for(recipe.engine.tensorrt):
        able, reason = can_build(edition)
        if able:
            break
        reasons.append(f"{edition.name}: {reason}")
    else:
        why = "; ".join(reasons)
        if recipe.engine.backend == "trt":
            raise SsdTrtError(f"recipe asks for backend 'trt' but no TensorRT edition can build here ({why}). "
                              f"ONNX artifacts are in {out}; set engine.backend to 'auto' or 'ort' to use them")
        return {"status": "stopped at ONNX", "reason": why, "plans": []}
    from ssd_trt.export.host_memory import release_freed_memory
    from ssd_trt.trt.engine_build import build_engine
    e = recipe.engine
    plans, artifacts = [], []
    for role in ROLES:
        # a tensor-parallel target: one plan per rank, built one after the other (the builder's memory is one rank's)
        ranks = e.tensor_parallel if role == "target" else 1
        for rank in range(ranks) if ranks > 1 else [None]:
            which = f"{role}'s" if rank is None else f"{role} rank {rank}'s (of {ranks})"
            try:
                plan = build_engine(edition, role, out, e.limits, e.trt_precision, tuple(e.compute_capabilities),
                                    recipe_fingerprint(recipe), rank=rank, num_ranks=ranks)
            except (ValueError, RuntimeError) as error:
                raise SsdTrtError(f"building the {which} {edition.name} TensorRT plan failed: {error}") from None
            plans.append(plan)
            artifacts.append({"role": role, "flavour": "engine", "path": plan["path"], "sha256": plan["sha256"],
                              "bytes": plan["bytes"]})
            if rank is not None:      # the next rank's builder starts from a trimmed heap
                release_freed_memory()
    return {"status": "built", "reason": f"{edition.name}: {reason}", "plans": plans, "artifacts": artifacts}
