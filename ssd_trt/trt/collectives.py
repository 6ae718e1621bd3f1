"""A tensor-parallel rank's network: each all-reduce marker replaced by TensorRT's native all-reduce layer.

The rank graphs (``export/tensor_parallel.py``) carry an ``Identity`` node named ``tp_all_reduce/layers.<i>.<module>``
(``models/sharding.py``'s ``MARKER``, from its table's reduced projections) wherever a partial sum must be added over the ranks. TensorRT's ONNX parser imports it as an identity layer of that
name; after parsing, each one gets an ``IDistCollectiveLayer`` (``ALL_REDUCE``, ``SUM``, over ``num_ranks``) on the
marker's input, and every layer that read the marker's output reads the collective's output instead
(``ILayer.set_input``). The marker, read by nothing any more, is dropped by the builder.

Both editions have the same network API for this (``add_dist_collective``: TensorRT for RTX 1.7, data-centre
TensorRT 11.4), so this one function serves both; at run time each rank's execution context needs the ranks'
communicator (``IExecutionContext.set_communicator``, an NCCL communicator) before its first enqueue.
"""
from __future__ import annotations

from typing import Any

from ssd_trt.models.sharding import MARKER


def insert_all_reduces(trt: Any, network: Any, num_ranks: int) -> int:
    """Replace every all-reduce marker of a parsed rank network by a native all-reduce over ``num_ranks`` ranks;
    returns how many. RuntimeError when this TensorRT has no collective layer or a marker cannot be rewired."""
    if not hasattr(network, "add_dist_collective"):
        raise RuntimeError(f"{trt.__name__} {trt.__version__} has no collective layer (add_dist_collective): "
                           "tensor-parallel plans need TensorRT for RTX >= 1.7 or TensorRT >= 11.4")
    layers = [network.get_layer(index) for index in range(network.num_layers)]
    markers = [layer for layer in layers if MARKER.match(layer.name)]
    readers: dict[str, list[tuple[Any, int]]] = {}
    for layer in layers:
        for index in range(layer.num_inputs):
            tensor = layer.get_input(index)
            if tensor is not None:
                readers.setdefault(tensor.name, []).append((layer, index))
    for marker in markers:
        if marker.type != trt.LayerType.IDENTITY or marker.num_inputs != 1:
            raise RuntimeError(f"all-reduce marker {marker.name!r} was parsed as a {marker.type.name} layer, not an "
                               "identity: the ONNX parser changed how it imports the markers")
        reduced = marker.get_output(0)
        if reduced.is_network_output:
            raise RuntimeError(f"all-reduce marker {marker.name!r}'s output is a network output")
        collective = network.add_dist_collective(marker.get_input(0), trt.CollectiveOperation.ALL_REDUCE,
                                                 trt.ReduceOperation.SUM, -1, [])
        if collective is None:
            raise RuntimeError(f"{trt.__name__} could not add an all-reduce layer for {marker.name!r}")
        collective.num_ranks = num_ranks
        collective.name = f"{marker.name}.all_reduce"
        for layer, index in readers.get(reduced.name, []):
            layer.set_input(index, collective.get_output(0))
    return len(markers)


def count_collectives(trt: Any, network: Any) -> int:
    """All-reduce layers in a network (what a rank's plan must hold: two per decoder layer)."""
    return sum(network.get_layer(index).type == trt.LayerType.DIST_COLLECTIVE for index in range(network.num_layers))
