"""The two TensorRT editions one build path serves, and everything in which they differ.

* ``datacenter``: TensorRT (``import tensorrt``, >= 10.9) on a data-centre GPU. Builds on the GPU it will
  run on (tactics are timed there), from the ``trt`` flavour of the step graph: tree attention as the
  ``ssd::tree_attention`` plugin node (``plugins/tree_attention/trt_plugin.py``), caches aliased through
  the plugin's in-place I/O (a preview feature).
* ``rtx``: TensorRT for RTX (``import tensorrt_rtx``, 1.7). Builds ahead of time, on any host, with no GPU,
  for the compute capabilities the recipe lists (one plan holds kernels for each); takes no custom plugins
  from Python (its network API has no ``add_plugin*``; a registered Python plugin aborts the process when
  the parser adds it), so it builds from the ``rtx`` flavour: the same step graph on ONNX ops the parser
  maps to TensorRT's native LLM layers (``export/native_graph.py``): ``Attention`` (opset 23) with the
  tree mask -> the attention layer, ``TensorScatter`` (opset 24) -> the KV-cache update layer (in place,
  which needs a static cache length: the graph's capacity is the recipe's max_context),
  ``RotaryEmbedding`` (opset 23) -> the rotary layer.

Precision: both build strongly typed networks (the graph's own types decide: fp16 / bf16 graphs are
exported in that type). TensorRT for RTX has dedicated attention kernels only for fp16/bf16; an fp32
graph builds only with the attention marked decomposable (split into matmul/softmax layers), which
:func:`prepare_network` does, so fp32 stays available for parity checks.

Nothing here imports TensorRT at import time.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

EditionName = Literal["datacenter", "rtx"]
RTX_WHEEL = "tensorrt-rtx-cu13==1.7.1.116"


@dataclass(frozen=True, slots=True)
class Edition:
    """One TensorRT edition: its Python module, the step-graph flavour it builds from, its plan's file name."""
    name: EditionName
    module: str
    flavour: str             # model.<flavour>.onnx
    plan_file: str           # <role>/<plan_file>
    install_hint: str

    def installed(self) -> bool:
        """Whether the module can be found (not imported: importing TensorRT can need a GPU)."""
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            return False

    def import_module(self) -> Any:
        return importlib.import_module(self.module)


DATACENTER = Edition("datacenter", "tensorrt", "trt", "engine.plan",
                     install_hint="install TensorRT >= 10.9 on a GPU host (pip install -e '.[trt]')")
RTX = Edition("rtx", "tensorrt_rtx", "rtx", "engine.rtx.plan",
              install_hint=f"pip install -e '.[rtx]' (installs {RTX_WHEEL})")
EDITIONS: dict[str, Edition] = {DATACENTER.name: DATACENTER, RTX.name: RTX}


def editions_for(choice: str) -> tuple[Edition, ...]:
    """The editions a recipe's ``engine.tensorrt`` asks for, in preference order (``auto``: both; ``none``: none)."""
    if choice == "none":
        return ()
    return (DATACENTER, RTX) if choice == "auto" else (EDITIONS[choice],)


def network_flags(trt: Any) -> int:
    """Strongly typed (the only network flag RTX has; implied on data-centre 11, explicit on 10.x), and the
    data-centre edition's ahead-of-time Python plugins."""
    flags = 0
    for flag in ("STRONGLY_TYPED", "PREFER_AOT_PYTHON_PLUGINS"):
        if hasattr(trt.NetworkDefinitionCreationFlag, flag):
            flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, flag))
    return flags


def configure(edition: Edition, trt: Any, config: Any, capabilities: tuple[str, ...]) -> None:
    """Edition-specific builder settings: AOT targets (RTX) or in-place plugin I/O (data-centre)."""
    if edition is RTX:
        config.num_compute_capabilities = len(capabilities)
        for index, capability in enumerate(capabilities):
            config.set_compute_capability(getattr(trt.ComputeCapability, capability.upper()), index)
    else:
        config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)


def prepare_network(edition: Edition, trt: Any, network: Any, precision: str) -> int:
    """After parsing: in an fp32 RTX network mark each native attention decomposable (no fp32 kernel).

    Returns how many attentions were marked.
    """
    if edition is not RTX or precision != "fp32":
        return 0
    marked = 0
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        if layer.type == trt.LayerType.ATTENTION_INPUT:
            layer.__class__ = trt.IAttentionInputLayer      # the bindings' way to reach the subclass API
            layer.attention.decomposable = True
            marked += 1
    return marked
