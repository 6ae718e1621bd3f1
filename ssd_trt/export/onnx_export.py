"""Trace a :class:`Decoder` into one ONNX step graph with an ``ssd::tree_attention`` node per layer.

Flavours of the same traced graph:
  * ``ort``: the op's standard-op decomposition attached as a model-local function (ORT inlines it);
  * ``trt``: the bare node, tagged ``plugin_namespace``/``plugin_version`` so data-centre TensorRT's ONNX
    parser imports it as the ``ssd::tree_attention`` plugin; no function attached;
  * ``rtx``: the node rewritten onto ONNX ops TensorRT maps to its native attention, KV-cache update and
    rotary layers (``native_graph.py``; TensorRT for RTX takes no plugins).
Flavours of one trace reference one external weight file, written once.
"""
from __future__ import annotations

import io
import warnings
from pathlib import Path

import onnx
import torch
from onnx import external_data_helper, helper

from ssd_trt_plugins.tree_attention.masks import causal_tree_mask
from ssd_trt_plugins.tree_attention.onnx_function import (DOMAIN, MASKED_NAME, NAME, OPSET, mask_nodes,
                                                  masked_attention_function, tree_attention_function)
from ssd_trt.engines.base import EAGLE3_INPUTS, EAGLE3_OUTPUT_HIDDEN, GRAPH_INPUTS, GRAPH_OUTPUT_FEATURES, \
    GRAPH_OUTPUT_LOGITS, past_names, present_names
from ssd_trt.models.decoder import Decoder, with_named_weights

PLUGIN_VERSION = "1"
_SYMBOLIC_REGISTERED: list[bool] = []


def _register_symbolic() -> None:
    """Map the torch custom op to a custom-domain ONNX node (TorchScript exporter)."""
    if _SYMBOLIC_REGISTERED:
        return
    from torch.onnx import register_custom_op_symbolic
    from torch.onnx.symbolic_helper import parse_args

    @parse_args("v", "v", "v", "v", "v", "v", "v", "f")
    def symbolic(g, query, key_new, value_new, key_cache, value_cache, cache_lengths, tree_mask, scale):
        outputs = g.op(f"{DOMAIN}::{NAME}", query, key_new, value_new, key_cache, value_cache,
                       cache_lengths, tree_mask, scale_f=scale, outputs=3)
        for output, like in zip(outputs, (query, key_cache, value_cache)):
            output.setType(like.type())   # same shapes/dtypes as these inputs
        return outputs

    register_custom_op_symbolic(f"{DOMAIN}::{NAME}", symbolic, 1)
    _SYMBOLIC_REGISTERED.append(True)


def cache_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Every layer's past (input) and present (output) cache names, in graph order."""
    layers = range(num_layers)
    return ([name for layer in layers for name in past_names(layer)],
            [name for layer in layers for name in present_names(layer)])


def io_names(num_layers: int, features: bool = False) -> tuple[list[str], list[str]]:
    past, present = cache_names(num_layers)
    return [*GRAPH_INPUTS, *past], [GRAPH_OUTPUT_LOGITS, *present, *([GRAPH_OUTPUT_FEATURES] if features else [])]


WEIGHT_PREFIX = "model."    # graph initializers are named after the traced module: model.<Decoder parameter>


class _StepGraph(torch.nn.Module):
    """The decoder with ``logit_indices`` as a positional input, in the graph's input order."""

    def __init__(self, model: Decoder) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, tree_mask, cache_lengths, logit_indices, *caches):
        return self.model(input_ids, position_ids, tree_mask, cache_lengths, *caches, logit_indices=logit_indices)


STEP_DYNAMIC_AXES = {"input_ids": {0: "batch", 1: "new_tokens"}, "position_ids": {0: "batch", 1: "new_tokens"},
                     "tree_mask": {0: "batch", 1: "new_tokens", 2: "mask_words"}, "cache_lengths": {0: "batch"},
                     "logit_indices": {0: "batch", 1: "logit_count"}, "logits": {0: "batch", 1: "logit_count"}}
CACHE_AXES = {0: "batch", 2: "capacity"}


def _step_args(batch: int, num_new: int) -> tuple[torch.Tensor, ...]:
    """Example step inputs for tracing: ids, positions, causal mask, lengths, logit indices."""
    return (torch.zeros(batch, num_new, dtype=torch.int64), torch.arange(num_new).repeat(batch, 1),
            torch.from_numpy(causal_tree_mask(batch, num_new)), torch.zeros(batch, dtype=torch.int32),
            torch.tensor([[1, 2]] * batch, dtype=torch.int64))


def _trace(wrapper: torch.nn.Module, args: tuple, inputs: list[str], outputs: list[str],
           dynamic: dict[str, dict[int, str]], weights_as_inputs: bool = False) -> onnx.ModelProto:
    """``weights_as_inputs``: the parameters become graph inputs named after them, with no data in the graph
    (``export/streamed.py`` binds them from the checkpoint); no deduplication of equal-valued parameters."""
    _register_symbolic()
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapper, args, buffer, input_names=inputs, output_names=outputs,
                          dynamic_axes=dynamic, opset_version=OPSET, dynamo=False,
                          custom_opsets={DOMAIN: 1}, do_constant_folding=True,
                          export_params=not weights_as_inputs, keep_initializers_as_inputs=weights_as_inputs)
    return onnx.load_from_string(buffer.getvalue())


def trace_step_graph(model: Decoder, weights_as_inputs: bool = False) -> onnx.ModelProto:
    """Trace the step graph with dynamic batch, new-token count, logit count, mask words and cache capacity.

    ``weights_as_inputs``: ``model`` already has named weights (a skeleton from ``export/streamed.py``) and
    they are left as graph inputs for the caller to bind."""
    if not weights_as_inputs:
        model = with_named_weights(model)      # every linear's weight is an initializer '<module>.weight_t'
    batch, num_new, capacity = 2, 3, 8
    inputs, outputs = io_names(model.config.num_layers, features=bool(model.feature_layers))
    dynamic = dict(STEP_DYNAMIC_AXES)
    if model.feature_layers:
        dynamic[GRAPH_OUTPUT_FEATURES] = {0: "batch", 1: "new_tokens"}
    past, present = cache_names(model.config.num_layers)
    dynamic.update({name: CACHE_AXES for name in (*past, *present)})
    return _trace(_StepGraph(model), (*_step_args(batch, num_new), *model.empty_caches(batch, capacity)),
                  inputs, outputs, dynamic, weights_as_inputs)




class _Eagle3StepGraph(torch.nn.Module):
    """An EAGLE-3 draft in the step graph's order: (step inputs, features, draft_hidden, from_target, caches)
    -> (logits, caches, hidden)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, tree_mask, cache_lengths, logit_indices, features, draft_hidden,
                from_target, *caches):
        logits, hidden, *new_caches = self.model(
            input_ids, position_ids, tree_mask, cache_lengths, features, draft_hidden, from_target, *caches,
            logit_indices=logit_indices)
        return (logits, *new_caches, hidden)


def trace_eagle3_step_graph(model) -> onnx.ModelProto:
    """The step graph of an :class:`~ssd_trt.models.eagle3.Eagle3Draft`: the decoder step's inputs plus each
    token's target features [B,T,3H], the draft's own carried hidden [B,T,H] and which of the two it carries
    [B,T] bool; outputs the logits, each draft layer's caches and the output hidden [B,T,H]."""
    model = with_named_weights(model)
    batch, num_new, capacity, width = 2, 3, 8, model.config.layer.hidden_size
    past, present = cache_names(model.config.layer.num_layers)
    inputs = [*GRAPH_INPUTS, *EAGLE3_INPUTS, *past]
    outputs = [GRAPH_OUTPUT_LOGITS, *present, EAGLE3_OUTPUT_HIDDEN]
    dynamic = {**STEP_DYNAMIC_AXES, **{name: CACHE_AXES for name in (*past, *present)},
               **{name: {0: "batch", 1: "new_tokens"} for name in (*EAGLE3_INPUTS, EAGLE3_OUTPUT_HIDDEN)}}
    dtype = model.embed_tokens.weight.dtype         # features and hidden in the model's precision
    args = (*_step_args(batch, num_new), torch.zeros(batch, num_new, 3 * width, dtype=dtype),
            torch.zeros(batch, num_new, width, dtype=dtype),
            torch.ones(batch, num_new, dtype=torch.bool), *model.empty_caches(batch, capacity))
    return _trace(_Eagle3StepGraph(model), args, inputs, outputs, dynamic)


def _attention_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if node.domain == DOMAIN and node.op_type == NAME]


def _rename_scale_attribute(model: onnx.ModelProto) -> None:
    for node in _attention_nodes(model):
        for attribute in node.attribute:
            if attribute.name == "scale_f":
                attribute.name = "scale"


def ort_flavour(traced: onnx.ModelProto, shared_mask: bool = True) -> onnx.ModelProto:
    """Attach the op's standard-op decomposition as a model-local function.

    With ``shared_mask`` the visibility mask (identical for every layer: it depends only on the step's
    cache_lengths, tree_mask and the cache capacity) is built once at graph level and each layer calls
    ``tree_attention_masked``; this removes ~35 small kernels per layer from every decode step.
    """
    model = onnx.ModelProto()
    model.CopyFrom(traced)
    _rename_scale_attribute(model)
    del model.functions[:]
    if not shared_mask:
        model.functions.append(tree_attention_function())
        return model
    nodes = _attention_nodes(model)
    first = list(model.graph.node).index(nodes[0])
    mask = mask_nodes("shared_mask_", "cache_lengths", "tree_mask", past_names(0)[0], "shared_mask_allowed5")
    for offset, node in enumerate(mask):
        model.graph.node.insert(first + offset, node)
    for node in nodes:
        node.op_type = MASKED_NAME
        node.input[6] = "shared_mask_allowed5"
    model.functions.append(masked_attention_function())
    return model


def trt_flavour(traced: onnx.ModelProto) -> onnx.ModelProto:
    model = onnx.ModelProto()
    model.CopyFrom(traced)
    _rename_scale_attribute(model)
    del model.functions[:]
    for node in _attention_nodes(model):
        node.attribute.extend([helper.make_attribute("plugin_namespace", DOMAIN),
                               helper.make_attribute("plugin_version", PLUGIN_VERSION)])
    return model


def external_files(model: onnx.ModelProto) -> list[str]:
    """The external-data files ``model``'s initializers point at, in order of first use."""
    files: dict[str, None] = {}
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            files.update({entry.value: None for entry in tensor.external_data if entry.key == "location"})
    return list(files)


def _externalise(traced: onnx.ModelProto, out_dir: Path, weights_file: str) -> onnx.ModelProto:
    """Move weights into ``out_dir/weights_file`` (written once); return the proto that points at it.
    Tensors already external (a streamed export's, ``streamed.py``) stay where they are."""
    if weights_file not in external_files(traced):
        (out_dir / weights_file).unlink(missing_ok=True)
    shared = onnx.ModelProto()
    shared.CopyFrom(traced)
    external_data_helper.convert_model_to_external_data(shared, all_tensors_to_one_file=True,
                                                        location=weights_file, size_threshold=1024)
    external_data_helper.write_external_data_tensors(shared, str(out_dir))
    return shared


def save_flavours(traced: onnx.ModelProto | None, out_dir: Path, trt_traced: onnx.ModelProto | None = None,
                  datacenter: bool = True, native: onnx.ModelProto | None = None,
                  fused: onnx.ModelProto | None = None) -> dict[str, Path]:
    """Write model.ort.onnx (fp32) and the TensorRT flavours the recipe's editions build from.

    ``fused`` (``export/fused_graph.py``) is the ``ort`` flavour when given, with its own ``weights.bin``;
    otherwise the traced graph is, through :func:`ort_flavour`.
    ``model.trt.onnx`` (data-centre, plugin node) when ``datacenter``: with one trace it shares
    the traced graph's weight file (``weights.bin``, or ``weights.trt.bin`` beside a fused ``ort`` flavour);
    ``trt_traced`` (the model traced in the recipe's TensorRT precision) gets ``weights.trt.bin``.
    ``model.rtx.onnx`` (TensorRT for RTX, native attention) when ``native`` (the graph from
    ``export/native_graph.py``) is given, with ``weights.rtx.bin``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"ort": out_dir / "model.ort.onnx"}
    if fused is None:
        shared = _externalise(traced, out_dir, "weights.bin")
        onnx.save_model(ort_flavour(shared), paths["ort"])
    else:
        shared = _externalise(fused, out_dir, "weights.bin")
        onnx.save_model(shared, paths["ort"])
    saved = [shared]
    if datacenter and (trt_traced is not None or fused is not None):
        shared = _externalise(traced if trt_traced is None else trt_traced, out_dir, "weights.trt.bin")
        saved.append(shared)
    return _tensorrt_flavours(shared, out_dir, datacenter, native, paths, saved)


WEIGHT_LABELS = {"weights.bin": "weights", "weights.trt.bin": "trt_weights", "weights.rtx.bin": "rtx_weights"}


def _with_weight_files(paths: dict[str, Path], saved: list[onnx.ModelProto], out_dir: Path) -> dict[str, Path]:
    """``paths`` plus every weight file a saved graph reads, under the flavour label the manifest has always used."""
    for graph in saved:
        for name in external_files(graph):
            paths.setdefault(WEIGHT_LABELS.get(name, name), out_dir / name)
    return paths


def save_engine_flavours(traced: onnx.ModelProto, out_dir: Path, datacenter: bool,
                         native: onnx.ModelProto | None) -> dict[str, Path]:
    """Only the TensorRT flavours of a traced graph whose weights are already in ``out_dir/weights.trt.bin``
    (a tensor-parallel rank's, ``export/tensor_parallel.py``: ONNX Runtime has no all-reduce, so a rank gets no
    ``ort`` flavour): ``model.trt.onnx`` when ``datacenter``, ``model.rtx.onnx`` when ``native`` is given."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shared = _externalise(traced, out_dir, "weights.trt.bin")
    return _tensorrt_flavours(shared, out_dir, datacenter, native, {}, [shared])


def _tensorrt_flavours(shared: onnx.ModelProto, out_dir: Path, datacenter: bool, native: onnx.ModelProto | None,
                       paths: dict[str, Path], saved: list[onnx.ModelProto]) -> dict[str, Path]:
    """``paths`` plus ``model.trt.onnx`` (``shared``, the traced graph over its weight file) when ``datacenter`` and
    ``model.rtx.onnx`` (``native``, with ``weights.rtx.bin``) when given, and every weight file they read."""
    if datacenter:
        paths["trt"] = out_dir / "model.trt.onnx"
        onnx.save_model(trt_flavour(shared), paths["trt"])
    if native is not None:
        paths["rtx"] = out_dir / "model.rtx.onnx"
        saved.append(_externalise(native, out_dir, "weights.rtx.bin"))
        onnx.save_model(saved[-1], paths["rtx"])
    return _with_weight_files(paths, saved, out_dir)
