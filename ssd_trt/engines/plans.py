"""Which TensorRT plan of a build can run here, and the checks a plan passes before it is deserialised.

A plan is refused at load, with the fix, when it is not the file the build wrote (size or sha256:
truncated, corrupt, swapped), when it was built from another recipe than the build's (the recipe's
fingerprint recorded with the plan), or when this GPU is not among the compute capabilities it has kernels
for (TensorRT for RTX plans are built ahead of time for a list; a data-centre plan for its build GPU).
Deserialising a wrong plan would fail deep inside TensorRT, or worse, run a plan of another model.
A tensor-parallel target's rank plans pass the same checks, and must be one per rank, each with its all-reduce layers.
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
    plan = manifest.tensorrt.plan(role, edition)
    if plan is None:
        raise ArtifactError(f"the build in {root} has no {edition} TensorRT plan for the {role} "
                            f"({manifest.tensorrt.status}: {manifest.tensorrt.reason}); {manifest.rebuild_hint}")
    _check_entry(root, manifest, plan, device_capability)
    return plan


def check_rank_plans(root: Path, manifest: Manifest, role: str, edition: str,
                     device_capability: str | None) -> list[PlanEntry]:
    """A tensor-parallel role's ``edition`` plans, rank 0 first, once there is one per rank, each file, recipe and GPU
    match it, and each holds the all-reduce layers its rank's step needs (two per decoder layer): a plan with fewer
    would pass partial sums on as whole, and the ranks would wait in collectives the others never enter."""
    split, fix = manifest.tensor_parallel, manifest.rebuild_hint
    if split is None or split.role != role:
        raise ArtifactError(f"the build in {root} does not split the {role} over tensor-parallel ranks")
    plans = manifest.tensorrt.rank_plans(role, edition)
    ranks = [plan.rank for plan in plans]
    if ranks != list(range(split.num_ranks)):
        raise ArtifactError(f"the build in {root} splits the {role} over {split.num_ranks} ranks but has {edition} "
                            f"TensorRT plans for rank{'s' if len(ranks) != 1 else ''} {ranks or 'none'} "
                            f"({manifest.tensorrt.status}: {manifest.tensorrt.reason}); {fix}")
    layers = manifest.model(role).config.num_layers
    for plan in plans:
        where = f"{split.ranks[plan.rank].dir}/"
        if not Path(plan.path).as_posix().startswith(where):
            raise ArtifactError(f"the manifest's {edition} plan for {role} rank {plan.rank} points at {plan.path}, "
                                f"outside the rank's folder {where}; {fix}")
        if plan.collective_layers != 2 * layers:
            raise ArtifactError(f"the {edition} plan of {role} rank {plan.rank} ({plan.path}) has "
                                f"{plan.collective_layers} all-reduce layers, its {layers} decoder layers need "
                                f"{2 * layers} (one after the attention output, one after the MLP); {fix}")
        _check_entry(root, manifest, plan, device_capability,
                     f"tensor-parallel rank {plan.rank} (of {split.num_ranks})'s TensorRT plan")
    return plans


def _check_entry(root: Path, manifest: Manifest, plan: PlanEntry, device_capability: str | None,
                 what: str = "TensorRT plan") -> None:
    """One plan's file (name, size, sha256), recipe fingerprint and GPU against the manifest."""
    fix, edition = manifest.rebuild_hint, plan.edition
    path = Path(root) / plan.path
    if Path(plan.path).name != EDITIONS[edition].plan_file:
        raise ArtifactError(f"the manifest's {edition} plan for the {plan.role} points at {plan.path}; {fix}")
    verify_file(path, plan.bytes, plan.sha256, fix, what=what)
    if plan.recipe_sha256 != recipe_fingerprint(manifest.recipe):
        raise ArtifactError(f"{what} {path} was built from another recipe than this build's "
                            f"{manifest.recipe.name!r} (recipe fingerprint {plan.recipe_sha256[:12]} vs "
                            f"{recipe_fingerprint(manifest.recipe)[:12]}): its shapes and weights may not be this "
                            f"model's; {fix}")
    if device_capability is not None and device_capability not in plan.compute_capabilities:
        hint = (" (TensorRT for RTX 1.7 builds no sm90 kernels: on a Hopper GPU use the data-centre edition, "
                "engine.tensorrt: datacenter)" if edition == "rtx" and device_capability == "sm90" else
                f"; add {device_capability} to engine.compute_capabilities and rebuild" if edition == "rtx" else
                "; rebuild on this GPU")
        raise ArtifactError(f"{what} {path} has kernels for {', '.join(plan.compute_capabilities)}, not for "
                            f"this GPU ({device_capability}){hint}")
