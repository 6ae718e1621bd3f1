"""TensorRT plugin ``ssd::tree_attention``: the Triton kernel, compiled ahead of time, inside an engine.

Registered with the ``tensorrt.plugin`` Python API (TensorRT >= 10.9):

* ``register``  shapes and types: output = query-like, key/value cache outputs *aliased* to the cache
  inputs (see below);
* ``autotune``  type/format combinations (fp16 | bf16 with int32 lengths and mask, or fp32) and, per
  combination, the tactics TensorRT times at build time (tile sizes);
* ``aot_impl``  the kernel compiled to PTX for the build GPU's SM (``ptx.py``), its launch grid as
  symbolic shape expressions and the two extra int32 kernel arguments (T and the cache capacity S).

Only an AOT implementation is registered, so TensorRT uses it whatever the ONNX node says (no "aot"
attribute needed) and the engine runs without Python. The TensorRT ONNX parser matches the bare
``tree_attention`` node that carries ``plugin_namespace="ssd"`` and ``plugin_version="1"``; its
``scale`` float attribute arrives as a one-element float32 array.

In-place KV cache. The cache outputs are declared with ``TensorDesc.aliased()`` (I/O aliasing,
``PreviewFeature.ALIASED_PLUGIN_IO_10_03``, which ``engine_build`` turns on): the plugin reads the
input cache and writes only the T new slots of the *same* buffer, O(T) instead of an O(S) copy.
Why this and not the alternatives:

* out-of-place outputs would force the kernel (or TensorRT) to copy the whole cache every step;
* ``IKVCacheUpdateLayer`` (TensorRT >= 10.15, imported from ONNX ``TensorScatter``) guarantees
  zero-copy in-place updates of network-input caches, but it is a separate layer that only writes,
  so the graph would need a second op and a different plugin contract (attention reading the
  updated cache), and it excludes TensorRT 10.9 - 10.14;
* aliasing is the documented in-place mechanism for plugins and keeps the one-node contract. When
  the aliased input is a network input, TensorRT "may insert copies"; the runtime binds
  ``present_key_i`` to the same address as ``past_key_i`` (``ssd_trt/engines/tensorrt.py``), so any copy
  TensorRT adds is a self-copy and the result is correct either way (past_key_i has no other reader).

Importing this module never imports TensorRT: :func:`register` does, on demand.
"""
import functools
from dataclasses import dataclass

import onnx

from ssd_trt_plugins.tree_attention.ptx import PtxKernel, compile_ptx
from ssd_trt_plugins.tree_attention.triton_kernel import KernelSpec

PLUGIN_NAMESPACE = "ssd"
PLUGIN_NAME = "tree_attention"
PLUGIN_VERSION = "1"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
NUM_INPUTS = 7
NUM_OUTPUTS = 3
FLOAT_POSITIONS = (0, 1, 2, 3, 4, 7, 8, 9)  # query, key/value new, key/value cache, and the outputs
INT_POSITIONS = (5, 6)  # cache_lengths, tree_mask
ALIASED_OUTPUTS = {1: 3, 2: 4}  # plugin output index -> plugin input index


@dataclass(frozen=True, slots=True)
class Tile:
    """Tile sizes of one tactic (see ``KernelSpec``)."""
    block_m: int
    block_s: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


# Tactic id -> tile. TensorRT times every tactic of a type combination and keeps the fastest.
# Small tiles suit decode / verification (few rows), large ones tree steps and prefill. All stay below
# 48 KiB of shared memory and spill no registers on sm_80 and sm_90 (tests/test_trt_plugin.py).
LOW_PRECISION_TACTICS = {1: Tile(16, 64, 32), 2: Tile(32, 64, 32)}
FP32_TACTICS = {3: Tile(16, 16, 16, num_stages=1)}

# trt.DataType member names -> kernel dtype names (by name, so this module needs no TensorRT).
_TRT_DTYPE_NAMES = {"FLOAT": "fp32", "HALF": "fp16", "BF16": "bf16"}


def tactics_for(dtype: str) -> dict[int, Tile]:
    """The tactics offered for a kernel dtype ("fp16", "bf16" or "fp32")."""
    if dtype == "fp32":
        return FP32_TACTICS
    if dtype in ("fp16", "bf16"):
        return LOW_PRECISION_TACTICS
    raise ValueError(f"tree_attention supports fp32, fp16 and bf16 tensors, not {dtype!r}")


def kernel_spec(dtype: str, num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                tactic: int) -> KernelSpec:
    """The kernel instance for one type combination and tactic."""
    tactics = tactics_for(dtype)
    if tactic not in tactics:
        # Tactic 0 is TensorRT's "default" when it does not time tactics: use the first one.
        if tactic != 0:
            raise ValueError(f"unknown tactic {tactic} for {dtype}; expected one of {sorted(tactics)}")
        tactic = min(tactics)
    tile = tactics[tactic]
    return KernelSpec(dtype, num_q_heads, num_kv_heads, head_dim, scale, block_m=tile.block_m,
                      block_s=tile.block_s, block_n=tile.block_n, num_warps=tile.num_warps,
                      num_stages=tile.num_stages)


def dtype_name(trt_dtype) -> str:
    """Kernel dtype name of a ``tensorrt.DataType``."""
    name = getattr(trt_dtype, "name", str(trt_dtype).rsplit(".", 1)[-1])
    if name not in _TRT_DTYPE_NAMES:
        raise ValueError(f"tree_attention supports FLOAT, HALF and BF16 tensors, got {name}")
    return _TRT_DTYPE_NAMES[name]


def static_dim(desc, index: int, what: str) -> int:
    """Build-time constant size of dimension ``index`` of a ``TensorDesc`` (head counts, head dim).

    Read from the symbolic shape when TensorRT folded it to a constant, else from the descriptor's
    concrete dims (static dimensions are not -1 there). These sizes are baked into the kernel.
    """
    expr = desc.shape_expr[index]
    if isinstance(expr, int):
        return expr
    if expr.is_constant:
        return int(expr.constant_value())
    try:
        size = int(desc.shape[index])
    except (AttributeError, ValueError):
        size = -1
    if size < 0:
        raise ValueError(f"{what} must be a static dimension in the ONNX graph (it is baked into the kernel)")
    return size


def launch_plan(spec: KernelSpec, kernel: PtxKernel, batch, num_new, capacity) -> dict[str, object]:
    """Launch parameters and extra kernel arguments of one kernel.

    ``batch``, ``num_new`` and ``capacity`` are ints (tests, torch) or TensorRT shape expressions
    (the AOT implementation): the arithmetic is the same.
    """
    grid_x, grid_y, grid_z = spec.grid(batch, num_new)
    return {"kernel_name": kernel.name, "grid": (grid_x, grid_y, grid_z), "block": (kernel.block_x, 1, 1),
            "shared_mem": kernel.shared_mem, "extra_args": (num_new, capacity)}


def validate_onnx_node(node: onnx.NodeProto) -> float:
    """Check that ``node`` is a TensorRT-flavour tree_attention node; return its ``scale``.

    Raises ValueError naming what is wrong (wrong namespace / version, wrong arity, no scale).
    """
    if node.op_type != PLUGIN_NAME:
        raise ValueError(f"node {node.name!r} is a {node.op_type}, not a {PLUGIN_NAME} node")
    attrs = {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}
    attrs = {name: value.decode() if isinstance(value, bytes) else value for name, value in attrs.items()}
    namespace, version = attrs.get("plugin_namespace"), attrs.get("plugin_version")
    if namespace != PLUGIN_NAMESPACE or version != PLUGIN_VERSION:
        raise ValueError(f"node {node.name!r} must carry plugin_namespace={PLUGIN_NAMESPACE!r} and plugin_version="
                         f"{PLUGIN_VERSION!r} for TensorRT to use the plugin (got {namespace!r}, {version!r}); "
                         "export the TensorRT flavour of the graph")
    if len(node.input) != NUM_INPUTS or len(node.output) != NUM_OUTPUTS:
        raise ValueError(f"node {node.name!r} has {len(node.input)} inputs and {len(node.output)} outputs; "
                         f"{PLUGIN_NAME} takes {NUM_INPUTS} and returns {NUM_OUTPUTS}")
    if "scale" not in attrs or not isinstance(attrs["scale"], float):
        raise ValueError(f"node {node.name!r} needs a float attribute 'scale'")
    return float(attrs["scale"])


@functools.cache
def register(sm: int) -> None:
    """Register ``ssd::tree_attention`` with TensorRT, compiling kernels for compute capability ``sm``.

    Call it before parsing an ONNX graph that contains the plugin node. Registration is global to the
    process (TensorRT's plugin registry), so it happens at most once; ``sm`` is that of the GPU the
    engine is built on (e.g. 90 for H100 / H200).
    """
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as error:
        raise RuntimeError("registering the tree_attention plugin needs TensorRT >= 10.9 (tensorrt.plugin with "
                           f"aot_impl): {error}") from error
    if not hasattr(trtp, "aot_impl"):
        raise RuntimeError(f"TensorRT {trt.__version__} has no tensorrt.plugin.aot_impl; TensorRT >= 10.9 is needed")
    _define_plugin(trt, trtp, sm)


def _define_plugin(trt, trtp, sm: int) -> None:
    """The ``tensorrt.plugin`` definitions (annotations must be real types: no postponed annotations)."""
    from typing import List, Tuple

    import numpy as np
    import numpy.typing as npt

    compile_cached = functools.lru_cache(maxsize=None)(compile_ptx)

    @trtp.register(PLUGIN_ID)
    def tree_attention_desc(query: trtp.TensorDesc, key_new: trtp.TensorDesc, value_new: trtp.TensorDesc,
                            key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc,
                            cache_lengths: trtp.TensorDesc, tree_mask: trtp.TensorDesc,
                            scale: npt.NDArray[np.float32],
                            ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        # Output like the query; caches aliased to their inputs (in place, see module docstring).
        return query.like(), key_cache.aliased(), value_cache.aliased()

    @trtp.autotune(PLUGIN_ID)
    def tree_attention_autotune(query: trtp.TensorDesc, key_new: trtp.TensorDesc, value_new: trtp.TensorDesc,
                                key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc,
                                cache_lengths: trtp.TensorDesc, tree_mask: trtp.TensorDesc,
                                outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
        combinations = []
        for types, tactics in (("FP16|BF16", LOW_PRECISION_TACTICS), ("FP32", FP32_TACTICS)):
            combination = trtp.AutoTuneCombination()
            combination.pos(list(FLOAT_POSITIONS), types)
            combination.pos(list(INT_POSITIONS), "INT32")
            combination.tactics(sorted(tactics))
            combinations.append(combination)
        return combinations

    @trtp.aot_impl(PLUGIN_ID)
    def tree_attention_aot(query: trtp.TensorDesc, key_new: trtp.TensorDesc, value_new: trtp.TensorDesc,
                           key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc,
                           cache_lengths: trtp.TensorDesc, tree_mask: trtp.TensorDesc,
                           scale: npt.NDArray[np.float32], outputs: Tuple[trtp.TensorDesc], tactic: int,
                           ) -> Tuple[str, str, trtp.KernelLaunchParams, trtp.SymExprs]:
        spec = kernel_spec(dtype_name(query.dtype), static_dim(query, 1, "query heads"),
                           static_dim(key_cache, 1, "kv heads"), static_dim(query, 3, "head dim"),
                           float(np.asarray(scale).reshape(-1)[0]), tactic)
        kernel = compile_cached(spec, sm)
        plan = launch_plan(spec, kernel, query.shape_expr[0], query.shape_expr[2], key_cache.shape_expr[2])
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y, launch.grid_z = plan["grid"]
        launch.block_x = kernel.block_x
        launch.shared_mem = kernel.shared_mem
        extra_args = trtp.SymIntExprs.from_tuple([trtp.SymInt32(expr) for expr in plan["extra_args"]])
        return kernel.name, kernel.ptx, launch, extra_args
