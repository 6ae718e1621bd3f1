"""The rank graphs checked on a CPU: all ranks joined into one ONNX graph, each all-reduce simulated by a Sum.

No single rank graph can be run alone (it computes a partial sum at each marker), and ONNX Runtime has no
collective. But N ranks side by side in one graph, with rank r's marker output replaced by the Sum of every rank's
marker input, is exactly what the N plans compute together with their all-reduce layers. So the joined graph, run
in ONNX Runtime, must give the whole model's logits on every rank, and each rank's caches must be the whole model's
key/value heads that the rank holds (``models/sharding.py``). The build checks this on the checkpoint's first
layers (the same code writes the full graphs), with the torch decoder of the whole cut checkpoint as reference.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch

from ssd_trt.engines.base import GRAPH_INPUTS, GRAPH_OUTPUT_LOGITS
from ssd_trt.export.tensor_parallel import rank_dir
from ssd_trt.export.validate import ATOL, sample_feeds
from ssd_trt.models.decoder import Decoder
from ssd_trt.models.sharding import MARKER, Split, marker_nodes, rank_split

SHARED = frozenset(GRAPH_INPUTS)       # the step's inputs: the same on every rank


def _ranked(rank: int, name: str) -> str:
    return name if not name or name in SHARED else f"rank{rank}/{name}"


def joined_graph(ranks: list[onnx.ModelProto], folders: list[str]) -> onnx.ModelProto:
    """One graph running every rank's graph (``ranks``, identical in structure, weights external under
    ``folders[r]``) side by side; rank r's tensors are prefixed ``rank<r>/`` and each all-reduce marker becomes the
    Sum of that marker's input on every rank."""
    first = ranks[0]
    counts = {len(model.graph.node) for model in ranks}
    if len(counts) != 1 or {len(marker_nodes(model)) for model in ranks} != {len(marker_nodes(first))}:
        raise ValueError("the rank graphs differ in structure; they are traced from one skeleton")
    joined = onnx.ModelProto()
    joined.CopyFrom(first)
    graph = joined.graph
    for field in (graph.node, graph.input, graph.output, graph.initializer, graph.value_info):
        del field[:]
    graph.input.extend([value for value in first.graph.input if value.name in SHARED])
    # node i of every rank before node i + 1 of any: each Sum then comes after every rank's partial it reads
    for position in range(len(first.graph.node)):
        for rank, model in enumerate(ranks):
            node = model.graph.node[position]
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            if node.op_type == "Identity" and MARKER.match(node.name):
                del copy.input[:]
                copy.op_type = "Sum"
                copy.input.extend(_ranked(other, node.input[0]) for other in range(len(ranks)))
            else:
                copy.input[:] = [_ranked(rank, name) for name in node.input]
            copy.output[:] = [_ranked(rank, name) for name in node.output]
            copy.name = _ranked(rank, node.name or f"node{position}")
            graph.node.append(copy)
    for rank, (model, folder) in enumerate(zip(ranks, folders)):
        for value in model.graph.input:
            if value.name not in SHARED:
                graph.input.append(_renamed_value(value, rank))
        graph.output.extend(_renamed_value(value, rank) for value in model.graph.output)
        for tensor in model.graph.initializer:
            copy = onnx.TensorProto()
            copy.CopyFrom(tensor)
            copy.name = _ranked(rank, tensor.name)
            for entry in copy.external_data:
                if entry.key == "location":
                    entry.value = f"{folder}/{entry.value}"
            graph.initializer.append(copy)
    return joined


def _renamed_value(value: onnx.ValueInfoProto, rank: int) -> onnx.ValueInfoProto:
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value)
    copy.name = _ranked(rank, value.name)
    return copy


def check_joined_ranks(reference: Decoder, root: Path, flavour_file: str, split: Split,
                       shapes: list[tuple[int, int]], capacity: int | None = None, atol: float = ATOL) -> dict:
    """The graphs ``root/rank<r>/flavour_file``, joined (:func:`joined_graph`), against the whole model
    ``reference`` on random steps of each (batch, new tokens) shape over filled caches."""
    import onnxruntime as ort
    ranks = [onnx.load(str(rank_dir(root, rank) / flavour_file), load_external_data=False)
             for rank in range(split.ranks)]
    joined = joined_graph(ranks, [rank_dir(Path("."), rank).as_posix() for rank in range(split.ranks)])
    path = root / f"joined.{flavour_file}"
    onnx.save_model(joined, path)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    max_abs, ranks_agree = 0.0, True
    for seed, (batch, new) in enumerate(shapes):
        feeds = sample_feeds(reference.config, batch, new, seed, capacity)
        with torch.no_grad():
            t = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in feeds.items()}
            caches = [t[name] for name in feeds if name.startswith("past_")]
            want = [o.numpy() for o in reference(t["input_ids"], t["position_ids"], t["tree_mask"],
                                                 t["cache_lengths"], *caches, logit_indices=t["logit_indices"])]
        names = [o.name for o in ranks[0].graph.output]
        joined_feeds = {name: value for name, value in feeds.items() if name in SHARED}
        for rank in range(split.ranks):
            first, last = split.kv_head_range(rank)
            joined_feeds.update({_ranked(rank, name): np.ascontiguousarray(value[:, first:last])
                                 for name, value in feeds.items() if name.startswith("past_")})
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, joined_feeds)))
        for rank in range(split.ranks):
            first, last = split.kv_head_range(rank)
            for name, expected in zip(names, want):
                value = got[_ranked(rank, name)].astype(np.float32)
                if name != GRAPH_OUTPUT_LOGITS:      # caches [B, KV, S, D]: the rank's key/value heads
                    expected = expected[:, first:last]
                finite = np.isfinite(expected)
                if not np.array_equal(expected[~finite], value[~finite]):
                    max_abs = float("inf")
                if finite.any():
                    max_abs = max(max_abs, float(np.abs(expected[finite] - value[finite]).max()))
            ranks_agree &= bool(np.array_equal(got[_ranked(rank, GRAPH_OUTPUT_LOGITS)],
                                               got[_ranked(0, GRAPH_OUTPUT_LOGITS)]))
    path.unlink()
    return {"tool": "onnxruntime: the rank graphs joined, each all-reduce as a Sum over the ranks, vs torch (the "
                    "whole model)", "ranks": split.ranks, "shapes": [list(s) for s in shapes], "atol": atol,
            "max_abs_error": max_abs, "ranks_agree": ranks_agree, "passed": bool(max_abs <= atol and ranks_agree)}


def bounded_rank_validation(checkpoint, layers: int, ranks: int, shapes: list[tuple[int, int]],
                            native_capacity: int | None, traced: bool) -> dict[str, dict]:
    """The cut checkpoint's rank graphs (fp32, written by the same code as the full ones) joined and checked against
    its whole torch decoder: the native-attention rewrite (``native_capacity``: the rtx flavour) and/or the traced
    graph with its tree attention as the reference ONNX function (``traced``: what the data-centre flavour computes
    with its plugin). ``{"rtx": result, "trt": result}``."""
    from ssd_trt.export.bounded_checks import scope
    from ssd_trt.export.native_graph import native_flavour
    from ssd_trt.export.onnx_export import ort_flavour, save_engine_flavours
    from ssd_trt.export.streamed import first_layers
    from ssd_trt.export.tensor_parallel import export_rank_graphs
    from ssd_trt.models.loading import decoder_from_checkpoint
    cut = first_layers(checkpoint, layers)
    split = rank_split(cut.config, ranks, "the checked layers")
    reference = decoder_from_checkpoint(cut.hf_config, {name: cut.tensor(name).float() for name in cut.tensors})
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        exported = export_rank_graphs(cut, split, root, "weights.trt.bin", torch.float32)
        for rank, graph in enumerate(exported.graphs):
            native = None if native_capacity is None else native_flavour(graph, native_capacity, cut.config.vocab_size)
            save_engine_flavours(graph, rank_dir(root, rank), datacenter=False, native=native)
            if traced:
                onnx.save_model(ort_flavour(graph), rank_dir(root, rank) / "model.traced.onnx")
        if native_capacity is not None:
            results["rtx"] = {**check_joined_ranks(reference, root, "model.rtx.onnx", split, shapes, native_capacity),
                              "checked_as": "fp32 native-attention rewrite of the cut checkpoint's rank graphs"}
        if traced:
            results["trt"] = {**check_joined_ranks(reference, root, "model.traced.onnx", split, shapes),
                              "checked_as": "fp32 traced rank graphs of the cut checkpoint, tree attention as its "
                                            "reference ONNX function (the data-centre plugin's math)"}
    for result in results.values():
        result["scope"] = scope(checkpoint, layers)
    return results
