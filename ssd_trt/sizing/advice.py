"""What to change when a recipe does not fit: each suggestion is a recipe change planned again, not a rule of thumb.

Tried in this order, each alone: the smallest larger tensor_parallel whose target ranks fit (it cannot help the
draft's GPU); the largest max_batch, then the largest max_context (a multiple of 256), that fit at the recipe's
tensor_parallel; a lighter format where the backend has one (int4 block weights on ONNX Runtime; bf16 plans for
fp32 ones on TensorRT).
"""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from ssd_trt.errors import RecipeError
from ssd_trt.models.sharding import valid_ranks
from ssd_trt.recipe import Recipe
from ssd_trt.sizing.fit import FitPlan, plan_fit, with_engine, with_models
from ssd_trt.sizing.formats import runtime_backend
from ssd_trt.sizing.memory import GIB

CONTEXT_STEP = 256


@dataclass(frozen=True, slots=True)
class Suggestion:
    change: str             # the recipe field, e.g. engine.tensor_parallel
    value: object           # its new value (None: no value of it fits)
    peak_bytes: int | None  # the fullest GPU's bytes with the change
    text: str


def suggestions(plan: FitPlan) -> list[Suggestion]:
    """Changes that make ``plan``'s recipe fit, each planned again (empty when it fits)."""
    if plan.fits:
        return []
    found = [_more_ranks(plan), _smaller(plan, "max_batch", range(plan.recipe.engine.max_batch - 1, 0, -1)),
             _smaller(plan, "max_context", _contexts(plan.recipe))]
    return [s for s in found + _lighter_formats(plan) if s is not None]


def _replan(plan: FitPlan, recipe: Recipe) -> FitPlan | None:
    try:
        return plan_fit(recipe, plan.models, plan.gpu_memory)
    except RecipeError:
        return None


def _more_ranks(plan: FitPlan) -> Suggestion | None:
    current = plan.recipe.engine.tensor_parallel
    if plan.role_fits("target"):
        return None
    draft_note = "" if plan.role_fits("draft") else "; the draft's GPU still does not fit: see the other changes"
    for ranks in (n for n in valid_ranks(plan.models["target"].config) if n > current):
        other = _replan(plan, with_engine(plan.recipe, tensor_parallel=ranks))
        if other is not None and other.role_fits("target"):
            rank = max(d.total for d in other.devices if d.role == "target")
            return Suggestion("engine.tensor_parallel", ranks, other.peak,
                              f"engine.tensor_parallel: {ranks} ({ranks + 1} GPUs with the draft's): each target rank "
                              f"then needs {rank / GIB:.2f} GiB{draft_note}")
    return Suggestion("engine.tensor_parallel", None, None,
                      "no tensor_parallel up to 64 fits the target's ranks with these limits")


def _contexts(recipe: Recipe) -> list[int]:
    """max_context values to try, largest first: multiples of 256 below the recipe's, down to the least the other
    limits allow."""
    e = recipe.engine
    floor = max(e.max_tree_size, e.max_draft_len + 1, 16)
    values = [c for c in range((e.max_context - 1) // CONTEXT_STEP * CONTEXT_STEP, floor - 1, -CONTEXT_STEP) if c > 0]
    return values + ([floor] if floor < e.max_context and floor not in values else [])


def _smaller(plan: FitPlan, field: str, values) -> Suggestion | None:
    """The largest of ``values`` (given largest first; memory grows with each) at which every GPU fits."""
    values = list(values)
    if not values:                # already at the least the recipe allows
        return None
    low, high, best = 0, len(values) - 1, None
    while low <= high:            # binary search: memory is monotone in the limit
        middle = (low + high) // 2
        try:
            other = _replan(plan, with_engine(plan.recipe, **{field: values[middle]}))
        except ValidationError:
            other = None
        if other is not None and other.fits:
            best, high = (values[middle], other), middle - 1
        else:
            low = middle + 1
    now = getattr(plan.recipe.engine, field)
    if best is None:
        return Suggestion(f"engine.{field}", None, None,
                          f"no engine.{field} below {now} fits at engine.tensor_parallel "
                          f"{plan.recipe.engine.tensor_parallel}")
    value, other = best
    return Suggestion(f"engine.{field}", value, other.peak,
                      f"engine.{field}: {value} (from {now}) at engine.tensor_parallel "
                      f"{plan.recipe.engine.tensor_parallel}: the fullest device then needs {other.peak / GIB:.2f} GiB")


def _lighter_formats(plan: FitPlan) -> list[Suggestion]:
    recipe, backend = plan.recipe, runtime_backend(plan.recipe)
    if backend == "trt" and recipe.engine.trt_precision == "fp32":
        other = _replan(plan, with_engine(recipe, trt_precision="bf16"))
        if other is not None:
            verdict = "every GPU fits" if other.fits else "still does not fit"
            return [Suggestion("engine.trt_precision", "bf16", other.peak,
                               f"engine.trt_precision: bf16 halves weights, cache and activations: {verdict} "
                               f"(fullest device {other.peak / GIB:.2f} GiB)")]
    lighter = [role for role in ("target", "draft") if getattr(recipe, role).weights in ("float", "int8")]
    if backend == "ort" and lighter:
        other = _replan(plan, with_models(recipe, lighter, weights="int4"))
        if other is not None:
            verdict = "every engine fits" if other.fits else "still does not fit"
            return [Suggestion("weights", "int4", other.peak,
                               f"weights: int4 for the {' and '.join(lighter)} (block-32, 0.625 bytes a weight): "
                               f"{verdict} (fullest device {other.peak / GIB:.2f} GiB)")]
    if backend != "ort" and any(getattr(recipe, role).weights != "float" for role in ("target", "draft")):
        return [Suggestion("weights", None, None,
                           f"weights: int4/int8 do not shrink the GPU engines: the {plan.formats['target'].label} "
                           "engines hold plain weights (block weights are ONNX Runtime's)")]
    return []
