"""The target's step graph split over ``engine.tensor_parallel`` ranks: one graph and one weight file per rank.

Each rank's graph is the decoder of its share of the model (``models/sharding.py``'s table: its query heads, the
key/value heads they read, its MLP columns; embedding, norms and LM head whole), traced once as a weightless skeleton
(``streamed.skeleton``): every rank has the same graph, only the weights differ. The two row-split products of each
decoder layer (attention's o_proj and the MLP's down_proj: the table's ``REDUCED``) give partial sums; each is
followed by an all-reduce *marker*, an ``Identity`` node named ``tp_all_reduce/layers.<i>.<module>``
(``sharding.marker_name``). ONNX has no all-reduce op and TensorRT's
ONNX parser takes no custom node without a plugin, but it imports an Identity as a layer of the node's name, so the
TensorRT build finds every marker by name and puts its native all-reduce layer in its place
(``trt/collectives.py``). ONNX Runtime would run a marker as the identity, i.e. compute a wrong (partial) model:
a rank graph runs only on TensorRT, and the runtime refuses ONNX Runtime for such a build.

Weights are streamed as for a whole model (``streamed.py``) but into N files: each checkpoint tensor is read once,
and each rank's slice of it is converted in ~64 MB blocks of rows and appended to that rank's
``<role>/rank<r>/weights.trt.bin``. The host holds one checkpoint tensor (in its own dtype) and one block at a time,
never a rank's whole layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from onnx import helper

from ssd_trt.export.onnx_export import WEIGHT_PREFIX, trace_step_graph
from ssd_trt.export.streamed import Binding, ExternalWeights, check_structure, hf_name, skeleton, write_float
from ssd_trt.models.checkpoint import Checkpoint
from ssd_trt.models.sharding import MARKER_PREFIX, REDUCED, Split, marker_name


def rank_dir(role_dir: Path, rank: int) -> Path:
    return role_dir / f"rank{rank}"


def mark_all_reduces(model: onnx.ModelProto, num_layers: int) -> int:
    """Put an all-reduce marker after the product of every reduced weight (o_proj and down_proj) in place; returns
    how many (2 per layer). Every reader of the product reads the marker's output instead."""
    producers = {}
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1].startswith(WEIGHT_PREFIX):
            producers[node.input[1].removeprefix(WEIGHT_PREFIX).removesuffix(".weight_t")] = node
    nodes = list(model.graph.node)
    placed = 0
    for layer in range(num_layers):
        for module in REDUCED:
            product = producers.get(f"layers.{layer}.{module}")
            if product is None:
                raise ValueError(f"the traced graph has no MatMul of layers.{layer}.{module}'s weight: the trace "
                                 "changed, so the all-reduce points cannot be placed")
            name = marker_name(layer, module)
            partial, reduced = product.output[0], f"{name}.sum"
            for node in nodes:
                for index, value in enumerate(node.input):
                    if value == partial:
                        node.input[index] = reduced
            nodes.insert(nodes.index(product) + 1, helper.make_node("Identity", [partial], [reduced], name=name))
            placed += 1
    if any(output.name.startswith(MARKER_PREFIX) for output in model.graph.output):
        raise ValueError("an all-reduce marker's input is a graph output")
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return placed


@dataclass
class RankGraphs:
    """The rank graphs of one model (unsaved protos; their weights are in each rank's file) and how they split."""
    split: Split
    graphs: list[onnx.ModelProto]
    markers: int                 # all-reduce markers per rank graph


def export_rank_graphs(checkpoint: Checkpoint, split: Split, role_dir: Path, weights_file: str,
                       dtype: torch.dtype) -> RankGraphs:
    """Every rank's step graph, its weights written to ``role_dir/rank<r>/weights_file`` in ``dtype``, reading each
    checkpoint tensor once."""
    config = split.rank_config()
    template = trace_step_graph(skeleton(config, dtype), weights_as_inputs=True)
    markers = mark_all_reduces(template, config.num_layers)
    graphs = []
    for _ in range(split.ranks):
        graph = onnx.ModelProto()
        graph.CopyFrom(template)
        graphs.append(graph)
    files = []
    try:
        for rank in range(split.ranks):
            rank_dir(role_dir, rank).mkdir(parents=True, exist_ok=True)
            files.append(ExternalWeights(rank_dir(role_dir, rank) / weights_file))
        _bind_rank_weights(template, graphs, checkpoint, split, files, dtype)
    finally:
        for weights in files:
            weights.close()
    for graph in graphs:
        check_structure(graph, config)
    return RankGraphs(split, graphs, markers)


def _bind_rank_weights(template: onnx.ModelProto, graphs: list[onnx.ModelProto], checkpoint: Checkpoint,
                       split: Split, files: list[ExternalWeights], dtype: torch.dtype) -> None:
    """Each weight input of the rank graphs becomes an initializer in its rank's file: the checkpoint tensor is read
    once, and each rank's slice written block by block (``streamed.write_float``)."""
    unused = Binding(None)
    weight_inputs = [value for value in template.graph.input if value.name.startswith(WEIGHT_PREFIX)]
    for graph in graphs:
        for value in [v for v in graph.graph.input if v.name.startswith(WEIGHT_PREFIX)]:
            graph.graph.input.remove(value)
    for value in weight_inputs:
        name = value.name
        source, transposed = hf_name(name, checkpoint.config)
        info = checkpoint.tensors[source]
        whole = checkpoint.tensor(source)
        declared = tuple(d.dim_value for d in value.type.tensor_type.shape.dim)
        target = torch.int64 if info.dtype == "I64" else dtype
        for rank, (graph, weights) in enumerate(zip(graphs, files)):
            part = split.shard(source, whole, rank)
            shape = (part.shape[1], part.shape[0]) if transposed else tuple(part.shape)
            if declared != tuple(shape):
                raise ValueError(f"rank {rank}'s graph weight {name} is {declared} but its slice of checkpoint tensor "
                                 f"{source} is {tuple(shape)}")
            write_float(name, checkpoint, source, shape, transposed, target, weights, graph, unused, False, part)
        del whole


def rank_record(split: Split, role: str, rank_files: list[dict[str, Path]], root: Path, markers: int) -> dict:
    """The manifest's ``tensor_parallel`` record (``manifest.TensorParallelBuild``): how the model was split, and each
    rank's folder, files (their sha256 are in the artifacts) and all-reduce markers."""
    c = split.config
    return {"role": role, "num_ranks": split.ranks, "marker_prefix": MARKER_PREFIX,
            "query_heads_per_rank": split.heads, "kv_heads_per_rank": split.kv_heads,
            "kv_head_replicas": split.kv_replicas, "mlp_columns_per_rank": split.intermediate,
            "replicated": "embedding, norms and LM head (whole on every rank)",
            "all_reduce_points": f"after {' and '.join(REDUCED)} of each of the {c.num_layers} layers",
            "ranks": [{"rank": rank, "dir": rank_dir(Path(role), rank).as_posix(),
                       "files": {flavour: path.relative_to(root).as_posix() for flavour, path in files.items()},
                       "all_reduce_markers": markers}
                      for rank, files in enumerate(rank_files)]}
