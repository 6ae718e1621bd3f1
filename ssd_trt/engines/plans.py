"""Which TensorRT plan of a build can run here, and the checks a plan passes before it is deserialised.

A plan is refused at load, with the fix, when it is not the file the build wrote (size or sha256:
truncated, corrupt, swapped), when it was built from another recipe than the build's (the recipe's
fingerprint recorded with the plan), or when this GPU is not among the compute capabilities it has kernels
for (TensorRT for RTX plans are built ahead of time for a list; a data-centre plan for its build GPU).
Deserialising a wrong plan would fail deep inside TensorRT, or worse, run a plan of another model.
"""
from __future__ import annotations

from pathlib import Path

from ssd_trt.errors import ArtifactError
from ssd_trt.manifest import Manifest, PlanEntry, recipe_fingerprint, verify_file
from ssd_trt.engines.editions import EDITIONS


def check_plan(root: Path, manifest: Manifest, role: str, edition: str, device_capability: str | None) -> PlanEntry:
    """The manifest's entry for the role's ``edition`` plan once the file, recipe and GPU all match it.

    ``device_capability`` is the GPU's (e.g. "sm89", from the probe); None skips only that check (no GPU
    here: the plan could not be deserialised anyway).
    """
    fix = manifest.rebuild_hint
    plan = manifest.tensorrt.plan(role, edition)
    if plan is None:
        raise ArtifactError(f"the build in {root} has no {edition} TensorRT plan for the {role} "
                            f"({manifest.tensorrt.status}: {manifest.tensorrt.reason}); {fix}")
    path = Path(root) / plan.path
    if Path(plan.path).name != EDITIONS[edition].plan_file or plan.role != role:
        raise ArtifactError(f"the manifest's {edition} plan for the {role} points at {plan.path}; {fix}")
    verify_file(path, plan.bytes, plan.sha256, fix, what="TensorRT plan")
    if plan.recipe_sha256 != recipe_fingerprint(manifest.recipe):
        raise ArtifactError(f"TensorRT plan {path} was built from another recipe than this build's "
                            f"{manifest.recipe.name!r} (recipe fingerprint {plan.recipe_sha256[:12]} vs "
                            f"{recipe_fingerprint(manifest.recipe)[:12]}): its shapes and weights may not be this "
                            f"model's; {fix}")
    if device_capability is not None and device_capability not in plan.compute_capabilities:
        hint = (" (TensorRT for RTX 1.7 builds no sm90 kernels: on a Hopper GPU use the data-centre edition, "
                "engine.tensorrt: datacenter)" if edition == "rtx" and device_capability == "sm90" else
                f"; add {device_capability} to engine.compute_capabilities and rebuild" if edition == "rtx" else
                "; rebuild on this GPU")
        raise ArtifactError(f"TensorRT plan {path} has kernels for {', '.join(plan.compute_capabilities)}, not for "
                            f"this GPU ({device_capability}){hint}")
    return plan
