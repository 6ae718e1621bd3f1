"""What the build does differently for each kind of model it exports: one object per kind, not branches.

* a **decoder** (the target, or an independent draft): loaded with ``models.loading.load_decoder``, compared
  with transformers' implementation, traced as the step graph and validated in ONNX Runtime with its caches
  written in place, as the engine runs it;
* an **EAGLE-3 head** (``draft: {kind: eagle3}``): loaded on the target's embedding, and the target's graph then
  also returns the features it reads; it has no transformers twin to compare with (its graph is checked against
  ``models/eagle3.py``), and its step graph takes extra per-token inputs, traced and validated with them. It
  shares the target's tokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import onnx

from ssd_trt.recipe import Recipe


@dataclass(frozen=True)
class ModelKind:
    name: str
    load: Callable[[Any, Any], tuple[Any, dict]]     # (source, the loaded target or None) -> (model, config.json)
    parity: Callable[[Any, Any], dict]               # (model, source) -> the manifest's parity record
    trace: Callable[[Any], onnx.ModelProto]          # the step graph
    validate: Callable[..., dict]                    # (model, ONNX path, shapes, capacity=None): torch vs ORT
    validate_in_place: bool                          # the ORT flavour is checked with its caches bound in place
    shares_target_tokenizer: bool
    with_target: Callable[[Any, Any], Any]           # (target, this draft) -> the target this draft needs


def _decoder() -> ModelKind:
    from ssd_trt.export.onnx_export import trace_step_graph
    from ssd_trt.export.parity import transformers_parity
    from ssd_trt.export.validate import validate_with_polygraphy
    from ssd_trt.models.loading import load_decoder
    return ModelKind("decoder", lambda source, _: load_decoder(source), transformers_parity, trace_step_graph,
                     validate_with_polygraphy, validate_in_place=True, shares_target_tokenizer=False,
                     with_target=lambda target, _: target)


def _eagle3_head() -> ModelKind:
    from ssd_trt.export.onnx_export import trace_eagle3_step_graph
    from ssd_trt.export.validate import validate_eagle3_graph
    from ssd_trt.models.decoder import with_target_features
    return ModelKind(
        "eagle3", load_feature_draft,
        lambda model, source: {"max_abs_diff": None, "reason": "an EAGLE-3 head is no transformers model; its graph "
                                                               "is checked against models/eagle3.py"},
        trace_eagle3_step_graph, validate_eagle3_graph, validate_in_place=False, shares_target_tokenizer=True,
        # the target's step graph also returns the features this draft reads (issue 19, item 1)
        with_target=lambda target, draft: with_target_features(target, draft.config.feature_layers))


def model_kind(recipe: Recipe, role: str) -> ModelKind:
    """The kind of ``role``'s model in ``recipe``."""
    return _eagle3_head() if role == "draft" and recipe.draft.kind == "eagle3" else _decoder()


def load_feature_draft(source, target) -> tuple[Any, dict]:
    """An EAGLE-3 head (released layout) for ``target``, on the target's embedding; and its config.json."""
    import json
    from pathlib import Path

    from ssd_trt.errors import RecipeError
    from ssd_trt.models.eagle3 import load_eagle3_checkpoint
    model = load_eagle3_checkpoint(source.path, target.config.num_layers, target.embed_tokens.weight.detach())
    if model.config.layer.vocab_size != target.config.vocab_size or \
            model.config.layer.hidden_size != target.config.hidden_size:
        raise RecipeError(f"EAGLE-3 head {source.path} is for a target of vocabulary {model.config.layer.vocab_size} "
                          f"and width {model.config.layer.hidden_size}; this target has {target.config.vocab_size} "
                          f"and {target.config.hidden_size}")
    return model.eval(), json.loads((Path(source.path) / "config.json").read_text())
