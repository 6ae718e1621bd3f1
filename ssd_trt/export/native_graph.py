"""The ``rtx`` flavour of the step graph: tree attention on ONNX ops TensorRT maps to native layers.

TensorRT for RTX takes no custom plugins from Python, so the ``ssd::tree_attention`` node of the traced
graph is rewritten into standard ONNX ops its parser imports as its LLM layers (checked by parsing:
``tests/test_tensorrt_rtx.py`` lists the layer types):

  ``TensorScatter`` (opset 24, axis 2, write_indices = cache_lengths)  -> KV-cache update layer
      the new keys/values written at slots L_b .. L_b+T-1, in place. TensorRT's KVCacheUpdate operator
      requires the cache to be a network input with a static sequence length and its output to be a
      network output at the same device address (the runtime binds present_*_i to past_*_i's buffer), so
      the graph's cache capacity is fixed at the recipe's max_context (the runtime's caches are exactly
      that long anyway).
  ``Attention`` (opset 23, 4-D, GQA from the head counts, boolean mask [B,1,T,S])  -> attention layer
      the mask is the tree-attention visibility (``reference.attention_mask``): every cached slot s < L_b,
      and new token j where bit (i, j) of the packed tree mask is set. Built once per step from
      cache_lengths and tree_mask (the same subgraph the ORT flavour shares across layers) and reused by
      every layer.
  ``RotaryEmbedding`` (opset 23, non-interleaved, per-token cos/sin [B,T,D/2])  -> rotary layer
      replaces the traced x*cos + rotate_half(x)*sin of queries and keys; first half
      x1*cos - x2*sin, second half x2*cos + x1*sin, the same function (cos and sin are the first half of
      the traced [B,1,T,D] tables, which repeat their halves).

The graph computes the same function as the other flavours; ONNX Runtime runs it on CPU, so the build
validates it against the torch model like the ORT flavour (``export/validate.py``).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ssd_trt_plugins.tree_attention.onnx_function import DOMAIN, NAME, mask_nodes
from ssd_trt.engines.base import GRAPH_OUTPUT_LOGITS, past_names, present_names

NATIVE_OPSET = 24      # TensorScatter is opset 24; Attention and RotaryEmbedding 23
MASK = "native_mask"          # bool [B, 1, T, S]
WRITE_INDICES = "native_write_indices"   # int64 [B]: cache_lengths


class NativeGraphError(ValueError):
    """The traced graph does not have the structure the rewrite expects."""


def native_flavour(traced: onnx.ModelProto, capacity: int, vocab_size: int) -> onnx.ModelProto:
    """The traced step graph (plain weights, any float type) rewritten onto native-layer ops, with the
    caches' capacity and the logits' vocabulary static (the tracer loses the latter through a reduced
    draft head's scatter in half precision)."""
    model = onnx.ModelProto()
    model.CopyFrom(traced)
    del model.functions[:]
    graph = model.graph
    attention = [node for node in graph.node if node.domain == DOMAIN and node.op_type == NAME]
    if not attention:
        raise NativeGraphError(f"the graph has no {DOMAIN}::{NAME} node: is it a traced step graph?")
    rotary = _replace_rotary(graph)
    if rotary != 2 * len(attention):
        raise NativeGraphError(f"found {rotary} rotary embeddings for {len(attention)} attention layers (expected "
                               "queries and keys of each): the traced rotary pattern changed")
    nodes = list(graph.node)
    first = nodes.index(attention[0])
    shared = mask_nodes("native_mask_", "cache_lengths", "tree_mask", past_names(0)[0], MASK + "5") + [
        helper.make_node("Constant", [], ["native_mask_axis1"], value=numpy_helper.from_array(
            np.array([1], dtype=np.int64), "native_mask_axis1")),
        helper.make_node("Squeeze", [MASK + "5", "native_mask_axis1"], [MASK]),
        helper.make_node("Cast", ["cache_lengths"], [WRITE_INDICES], to=TensorProto.INT64)]
    rewritten = nodes[:first] + shared
    for node in nodes[first:]:
        rewritten += _native_attention(node) if node in attention else [node]
    del graph.node[:]
    graph.node.extend(rewritten)
    _drop_unread(graph)
    _fix_capacity(graph, capacity)
    vocab = next(out for out in graph.output if out.name == GRAPH_OUTPUT_LOGITS).type.tensor_type.shape.dim[2]
    vocab.ClearField("dim_param")
    vocab.dim_value = vocab_size
    del graph.value_info[:]      # the trace's intermediate shapes (dynamic capacity) no longer hold
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("", NATIVE_OPSET))
    # the checker takes protobufs under 2 GB with their weights inline (a streamed graph's are external, and the
    # build's bounded validation loads its cut twin in ONNX Runtime instead)
    if model.ByteSize() < 2**31 and not any(t.data_location == TensorProto.EXTERNAL for t in graph.initializer):
        onnx.checker.check_model(model)
    return model


def _native_attention(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """One tree_attention node -> two TensorScatter (K, V cache writes) and one Attention."""
    query, key_new, value_new, key_cache, value_cache, _, _ = node.input
    output, key_out, value_out = node.output
    scale = next(a.f for a in node.attribute if a.name in ("scale", "scale_f"))
    prefix = f"{node.name or key_out}_native"
    return [
        helper.make_node("TensorScatter", [key_cache, key_new, WRITE_INDICES], [key_out], axis=2,
                         name=f"{prefix}_key_write"),
        helper.make_node("TensorScatter", [value_cache, value_new, WRITE_INDICES], [value_out], axis=2,
                         name=f"{prefix}_value_write"),
        helper.make_node("Attention", [query, key_out, value_out, MASK], [output], scale=scale,
                         name=f"{prefix}_attention"),
    ]


def _replace_rotary(graph: onnx.GraphProto) -> int:
    """Replace every Add(Mul(x, cos), Mul(Concat(Neg(Slice x), Slice x), sin)) by RotaryEmbedding.

    Returns how many were replaced. cos/sin here are the traced [B,1,T,D] tables; RotaryEmbedding takes
    their first halves as [B,T,D/2] (computed once, shared by every layer).
    """
    producer = {out: node for node in graph.node for out in node.output}
    replaced: dict[int, onnx.NodeProto] = {}
    tables: dict[tuple[str, str], tuple[str, str]] = {}
    extra: list[onnx.NodeProto] = []
    for node in graph.node:
        match = _rotary_match(node, producer)
        if match is None:
            continue
        x, cos, sin = match
        if (cos, sin) not in tables:
            tables[(cos, sin)] = (f"native_rope_cos_{len(tables)}", f"native_rope_sin_{len(tables)}")
            extra += _half_tables(cos, sin, *tables[(cos, sin)])
        half_cos, half_sin = tables[(cos, sin)]
        replaced[id(node)] = helper.make_node("RotaryEmbedding", [x, half_cos, half_sin], list(node.output),
                                              name=f"{node.name or node.output[0]}_rotary")
    if not replaced:
        return 0
    # the matched Mul/Concat/Neg/Slice nodes are left unread: _drop_unread removes them
    nodes = [replaced.get(id(node), node) for node in graph.node]
    # the half tables go right after the last node their inputs need
    position = max(i for i, n in enumerate(nodes) if set(n.output) & {c for pair in tables for c in pair}) + 1
    nodes[position:position] = extra
    del graph.node[:]
    graph.node.extend(nodes)
    return len(replaced)


def _rotary_match(node, producer):
    """(x, cos, sin) when ``node`` is the Add of a traced rotary embedding, else None."""
    if node.op_type != "Add" or len(node.input) != 2:
        return None
    muls = [producer.get(name) for name in node.input]
    if any(m is None or m.op_type != "Mul" for m in muls):
        return None
    for plain, rotated in (muls, muls[::-1]):
        concat = next((producer.get(i) for i in rotated.input if producer.get(i) is not None
                       and producer[i].op_type == "Concat"), None)
        if concat is None or len(concat.input) != 2:
            continue
        neg, second = producer.get(concat.input[0]), producer.get(concat.input[1])
        if neg is None or neg.op_type != "Neg" or second is None or second.op_type != "Slice":
            continue
        first = producer.get(neg.input[0])
        if first is None or first.op_type != "Slice" or first.input[0] != second.input[0]:
            continue
        x = first.input[0]
        if x not in plain.input:
            continue
        cos = plain.input[1] if plain.input[0] == x else plain.input[0]
        sin = next(i for i in rotated.input if i != concat.output[0])
        return x, cos, sin
    return None


def _half_tables(cos: str, sin: str, half_cos: str, half_sin: str) -> list[onnx.NodeProto]:
    """[B,1,T,D] -> [B,T,D/2]: squeeze the head axis, keep the first half of the last axis."""
    n = helper.make_node
    c = lambda name, value: n("Constant", [], [name], value=numpy_helper.from_array(  # noqa: E731
        np.array(value, dtype=np.int64), name))
    p = half_cos + "_"
    return [c(p + "axis1", [1]), c(p + "zero", [0]), c(p + "axis_last", [-1]), c(p + "two", [2]),
            n("Shape", [cos], [p + "D"], start=3, end=4), n("Div", [p + "D", p + "two"], [p + "half"]),
            n("Squeeze", [cos, p + "axis1"], [p + "cos3"]), n("Squeeze", [sin, p + "axis1"], [p + "sin3"]),
            n("Slice", [p + "cos3", p + "zero", p + "half", p + "axis_last"], [half_cos]),
            n("Slice", [p + "sin3", p + "zero", p + "half", p + "axis_last"], [half_sin])]


def _drop_unread(graph: onnx.GraphProto) -> None:
    """Remove nodes nothing reads (the replaced rotary's constants), repeatedly, then unread initializers."""
    while True:
        read = {name for node in graph.node for name in node.input} | {out.name for out in graph.output}
        kept = [node for node in graph.node if set(node.output) & read]
        if len(kept) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(kept)
    unread = [init for init in graph.initializer if init.name not in read]
    for init in unread:
        graph.initializer.remove(init)


def _fix_capacity(graph: onnx.GraphProto, capacity: int) -> None:
    """Make the caches' sequence dimension static (the KV-cache update layer requires it)."""
    names = {name for layer in range(len(graph.input)) for name in (*past_names(layer), *present_names(layer))}
    for value in list(graph.input) + list(graph.output):
        if value.name in names:
            dim = value.type.tensor_type.shape.dim[2]
            dim.ClearField("dim_param")
            dim.dim_value = capacity
