"""Binding layout of a step graph: which tensors go in and out, their roles, shapes and types.

Derived from the graph itself (an ONNX model before the build, a TensorRT engine at run time), and
checked against the step-graph contract of :mod:`ssd_trt.engines.base`:

  inputs   input_ids [B,T] int64, position_ids [B,T] int64, tree_mask [B,T,W] int32,
           cache_lengths [B] int32, logit_indices [B,L] int64, past_key_i / past_value_i [B,Hkv,S,D] float
  outputs  logits [B,L,V] float (L = T as the GPU runtime binds it), present_key_i / present_value_i [B,Hkv,S,D] (same type as past),
           optionally features [B,T,F] (a target's hidden states for a feature draft; F static)
  a feature draft's graph (EAGLE-3) also takes features [B,T,F], draft_hidden [B,T,H], from_target [B,T] bool
  and returns hidden [B,T,H] (H static)

Each dimension has a *role* (batch, tokens, mask_words, capacity, kv_heads, head_dim, vocab). The
runtime's shapes come from roles, never from the exporter's symbolic dimension names; kv_heads,
head_dim and vocab must be static (they size the cache buffers and are baked into the kernel).
``present_*_i`` is bound to the same memory as ``past_*_i`` (the in-place cache, see
``plugins/tree_attention/trt_plugin.py``): :attr:`BindingLayout.aliases` lists those pairs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import onnx

from ssd_trt.engines.base import EAGLE3_OUTPUT_HIDDEN, GRAPH_INPUTS, GRAPH_OUTPUT_FEATURES, GRAPH_OUTPUT_LOGITS, \
    past_names, present_names
from ssd_trt.engines.limits import EngineLimits
from ssd_trt.engines.profiles import Profile, mask_words

Dim = int | str  # a static size, or the name of a dynamic dimension ("?" when unnamed)

_ONNX_TYPES = {
    onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.INT64: "int64", onnx.TensorProto.INT32: "int32", onnx.TensorProto.BOOL: "bool",
}
_TRT_TYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32",
              "BOOL": "bool"}
FLOAT_TYPES = ("float32", "float16", "bfloat16")

_CACHE_ROLES = ("batch", "kv_heads", "capacity", "head_dim")
_FIXED_ROLES = {
    "input_ids": (("batch", "tokens"), ("int64",)),
    "position_ids": (("batch", "tokens"), ("int64",)),
    "tree_mask": (("batch", "tokens", "mask_words"), ("int32",)),
    "cache_lengths": (("batch",), ("int32",)),
    # the GPU runtime asks for every position's logits (L = T, picked on the host): same role as the tokens
    "logit_indices": (("batch", "tokens"), ("int64",)),
    GRAPH_OUTPUT_LOGITS: (("batch", "tokens", "vocab"), FLOAT_TYPES),
    GRAPH_OUTPUT_FEATURES: (("batch", "tokens", "feature_width"), FLOAT_TYPES),   # optional (a feature draft's)
    # a feature draft's own graph (EAGLE-3): per-token inputs, its hidden out (engines/base.py EAGLE3_*)
    "draft_hidden": (("batch", "tokens", "hidden_width"), FLOAT_TYPES),
    "from_target": (("batch", "tokens"), ("bool",)),
    EAGLE3_OUTPUT_HIDDEN: (("batch", "tokens", "hidden_width"), FLOAT_TYPES),
}
_CACHE_NAME = re.compile(r"^(past|present)_(key|value)_(\d+)$")


@dataclass(frozen=True, slots=True)
class IOTensor:
    """One graph input or output as the graph declares it."""
    name: str
    is_input: bool
    dtype: str  # float32 | float16 | bfloat16 | int64 | int32
    shape: tuple[Dim, ...]
    roles: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BindingLayout:
    """The checked I/O of a step graph plus the model facts it implies."""
    inputs: tuple[IOTensor, ...]
    outputs: tuple[IOTensor, ...]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    cache_dtype: str
    logits_dtype: str
    aliases: tuple[tuple[str, str], ...]  # (output name, input name) sharing memory

    @property
    def tensors(self) -> tuple[IOTensor, ...]:
        return self.inputs + self.outputs

    def tensor(self, name: str) -> IOTensor:
        for tensor in self.tensors:
            if tensor.name == name:
                return tensor
        raise KeyError(name)

    def static_capacity(self) -> int | None:
        """Cache capacity S if the graph fixes it, else None."""
        capacity = self.tensor(past_names(0)[0]).shape[2]
        return capacity if isinstance(capacity, int) else None

    def shape_for(self, name: str, batch: int, tokens: int, capacity: int) -> tuple[int, ...]:
        """Concrete shape of tensor ``name`` for one step."""
        tensor = self.tensor(name)
        sizes = {"batch": batch, "tokens": tokens, "mask_words": mask_words(tokens), "capacity": capacity,
                 "kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "vocab": self.vocab_size,
                 "feature_width": tensor.shape[-1], "hidden_width": tensor.shape[-1]}
        return tuple(sizes[role] for role in tensor.roles)

    def input_ranges(self, profile: Profile, limits: EngineLimits,
                     ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """(min, opt, max) shape of every input for one optimisation profile."""
        capacity = self.static_capacity() or limits.max_context
        if capacity != limits.max_context:
            raise ValueError(f"the graph's cache capacity is fixed at {capacity} but engine.max_context is "
                             f"{limits.max_context}: re-export with a dynamic capacity or change the recipe")
        ranges = {}
        for tensor in self.inputs:
            ranges[tensor.name] = tuple(
                self.shape_for(tensor.name, batch, tokens, capacity)
                for batch, tokens in zip(profile.batch, profile.tokens))
            for position, dim in enumerate(tensor.shape):
                if isinstance(dim, int):
                    wanted = {shape[position] for shape in ranges[tensor.name]}
                    if wanted != {dim}:
                        raise ValueError(f"input {tensor.name} has static dimension {position} = {dim}, but profile "
                                         f"{profile.name} needs {sorted(wanted)}: export it as a dynamic dimension")
        return ranges

    @classmethod
    def from_io(cls, tensors: list[IOTensor]) -> "BindingLayout":
        """Assign roles to the declared I/O and check it against the step-graph contract."""
        by_name = {tensor.name: tensor for tensor in tensors}
        if len(by_name) != len(tensors):
            raise ValueError("duplicate tensor names in the graph I/O")
        missing = [name for name in (*GRAPH_INPUTS, GRAPH_OUTPUT_LOGITS) if name not in by_name]
        if missing:
            raise ValueError(f"the step graph lacks {missing}; see ssd_trt/engines/base.py for its I/O")
        layers: dict[tuple[str, str], set[int]] = {}
        for tensor in tensors:
            match = _CACHE_NAME.match(tensor.name)
            if match:
                layers.setdefault((match.group(1), match.group(2)), set()).add(int(match.group(3)))
            elif tensor.name not in _FIXED_ROLES:
                raise ValueError(f"unexpected graph {'input' if tensor.is_input else 'output'} {tensor.name!r}: the "
                                 "runtime feeds only the step-graph I/O of ssd_trt/engines/base.py")
        # "features" is a target's output, or (with draft_hidden) a feature draft's input
        feature_draft = "draft_hidden" in by_name
        num_layers = len(layers.get(("past", "key"), ()))
        for group in (("past", "key"), ("past", "value"), ("present", "key"), ("present", "value")):
            if layers.get(group, set()) != set(range(num_layers)) or num_layers == 0:
                raise ValueError(f"{group[0]}_{group[1]}_i must exist exactly for layers 0..{num_layers - 1} "
                                 f"(found {sorted(layers.get(group, ()))})")
        placed = []
        for tensor in tensors:
            match = _CACHE_NAME.match(tensor.name)
            if match:
                roles, allowed, should_be_input = _CACHE_ROLES, FLOAT_TYPES, match.group(1) == "past"
            else:
                roles, allowed = _FIXED_ROLES[tensor.name]
                should_be_input = tensor.name not in (GRAPH_OUTPUT_LOGITS, EAGLE3_OUTPUT_HIDDEN) and \
                    (tensor.name != GRAPH_OUTPUT_FEATURES or feature_draft)
            if tensor.is_input != should_be_input:
                raise ValueError(f"{tensor.name} must be a graph {'input' if should_be_input else 'output'}")
            if len(tensor.shape) != len(roles):
                raise ValueError(f"{tensor.name} must have rank {len(roles)} ({', '.join(roles)}), "
                                 f"got shape {tensor.shape}")
            if tensor.dtype not in allowed:
                raise ValueError(f"{tensor.name} must be {' or '.join(allowed)}, got {tensor.dtype}")
            placed.append(IOTensor(tensor.name, tensor.is_input, tensor.dtype, tensor.shape, roles))
        facts = {}
        for tensor in placed:
            for role, dim in zip(tensor.roles, tensor.shape):
                if role in ("kv_heads", "head_dim", "vocab", "feature_width", "hidden_width"):
                    if not isinstance(dim, int):
                        raise ValueError(f"{tensor.name}: the {role} dimension must be static, got {dim!r}")
                    if facts.setdefault(role, dim) != dim:
                        raise ValueError(f"{tensor.name}: {role} = {dim} disagrees with {facts[role]} elsewhere")
        cache_types = {t.dtype for t in placed if _CACHE_NAME.match(t.name)}
        if len(cache_types) != 1:
            raise ValueError(f"all past/present caches must share one dtype, found {sorted(cache_types)}")
        aliases = tuple((present_names(i)[j], past_names(i)[j]) for i in range(num_layers) for j in (0, 1))
        return cls(inputs=tuple(t for t in placed if t.is_input), outputs=tuple(t for t in placed if not t.is_input),
                   num_layers=num_layers, num_kv_heads=facts["kv_heads"], head_dim=facts["head_dim"],
                   vocab_size=facts["vocab"], cache_dtype=cache_types.pop(),
                   logits_dtype=by_name[GRAPH_OUTPUT_LOGITS].dtype, aliases=aliases)

    @classmethod
    def from_onnx(cls, model: onnx.ModelProto | str | Path) -> "BindingLayout":
        """Layout of an ONNX step graph (weights are not loaded when given a path)."""
        if not isinstance(model, onnx.ModelProto):
            model = onnx.load(str(model), load_external_data=False)
        initializers = {init.name for init in model.graph.initializer}
        tensors = [_onnx_io(value, True) for value in model.graph.input if value.name not in initializers]
        tensors += [_onnx_io(value, False) for value in model.graph.output]
        return cls.from_io(tensors)

    @classmethod
    def from_trt_engine(cls, engine, trt) -> "BindingLayout":
        """Layout of a deserialised ``ICudaEngine`` of either edition (``trt``: its module; dynamic dims are -1)."""
        tensors = []
        for index in range(engine.num_io_tensors):
            name = engine.get_tensor_name(index)
            is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            dtype_name = engine.get_tensor_dtype(name).name
            if dtype_name not in _TRT_TYPES:
                raise ValueError(f"engine tensor {name} has unsupported type {dtype_name}")
            shape = tuple(dim if dim >= 0 else "?" for dim in engine.get_tensor_shape(name))
            tensors.append(IOTensor(name, is_input, _TRT_TYPES[dtype_name], shape))
        return cls.from_io(tensors)


def _onnx_io(value: onnx.ValueInfoProto, is_input: bool) -> IOTensor:
    tensor_type = value.type.tensor_type
    if tensor_type.elem_type not in _ONNX_TYPES:
        raise ValueError(f"graph {'input' if is_input else 'output'} {value.name} has unsupported ONNX element type "
                         f"{onnx.TensorProto.DataType.Name(tensor_type.elem_type)}")
    if not tensor_type.HasField("shape"):
        raise ValueError(f"graph I/O {value.name} has no shape; export with shapes")
    shape = tuple(dim.dim_value if dim.HasField("dim_value") else (dim.dim_param or "?")
                  for dim in tensor_type.shape.dim)
    return IOTensor(value.name, is_input, _ONNX_TYPES[tensor_type.elem_type], shape)
