"""A recording fake of the TensorRT runtime API that ``ssd_trt/engines/tensorrt.py`` uses (no GPU here).

Every method has the name, parameters and answer of the real one (``tests/test_tensorrt_surface.py`` checks each
against ``tensorrt_rtx`` and the TensorRT 11.4 bindings), so a renamed call fails here as it would on a GPU. Each
context records its calls in order and refuses what TensorRT refuses (a shape outside its profile, a tensor the plan
does not have, an enqueue with an input shape or an I/O address missing).

Work enqueued by ``execute_async_v3`` is a "kernel" given to a :class:`~tests.fakes.fake_cuda.FakeCuda`: run at
once, or recorded while its stream is capturing and run again on replay. A kernel remembers the shapes, addresses
and profile its context held when it was enqueued; a context whose work a graph captured is frozen: changing its
profile, a shape or an address afterwards raises :class:`FakeStaleGraph` (the graph would replay on a context that
no longer holds what it was captured with), and so does a replay that finds its context changed.

A plan is a small JSON document (:func:`fake_step_plan`) that :class:`FakeRuntime` "deserialises".
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ssd_trt.engines.base import past_names, present_names
from ssd_trt.engines.profiles import Profile, mask_words


class FakeStaleGraph(AssertionError):
    """A captured graph would replay on a context that no longer holds what it was captured with."""


class FakeEnumMember:
    def __init__(self, owner: str, name: str) -> None:
        self.name, self._owner = name, owner

    def __repr__(self) -> str:
        return f"{self._owner}.{self.name}"


def _enum(owner: str, *names: str) -> type:
    return type(owner, (), {name: FakeEnumMember(owner, name) for name in names})


class FakeTensorRT:
    """Stands in for the ``tensorrt`` / ``tensorrt_rtx`` module: the enums and classes the runtime reaches through
    ``trt.``, and the record of every context any of its engines made (``contexts``, in creation order)."""

    ExecutionContextAllocationStrategy = _enum("ExecutionContextAllocationStrategy", "STATIC", "ON_PROFILE_CHANGE",
                                               "USER_MANAGED")
    TensorIOMode = _enum("TensorIOMode", "NONE", "INPUT", "OUTPUT")
    DataType = _enum("DataType", "FLOAT", "HALF", "BF16", "INT64", "INT32", "BOOL")

    class Logger:
        Severity = _enum("Severity", "INTERNAL_ERROR", "ERROR", "WARNING", "INFO", "VERBOSE")
        WARNING = Severity.WARNING

        def __init__(self, min_severity: Any = None) -> None:
            self.min_severity = min_severity

        def log(self, severity: Any, msg: str) -> None:
            pass

    def __init__(self, cuda: Any = None) -> None:
        self.cuda = cuda
        self.contexts: list[FakeExecutionContext] = []

    def Runtime(self, logger: Any) -> "FakeRuntime":  # noqa: N802 (the module's class name)
        return FakeRuntime(self, logger)


class FakeRuntime:
    def __init__(self, trt: FakeTensorRT, logger: Any) -> None:
        self._trt, self.logger = trt, logger

    def deserialize_cuda_engine(self, serialized_engine: bytes) -> "FakeCudaEngine | None":
        try:
            plan = json.loads(bytes(serialized_engine))
        except ValueError:
            return None                     # TensorRT answers None for a plan it cannot read
        return FakeCudaEngine(self._trt, plan)


class FakeCudaEngine:
    """An engine read from :func:`fake_step_plan`'s JSON."""

    def __init__(self, trt: FakeTensorRT, plan: dict) -> None:
        self._trt, self._plan = trt, plan
        self._tensors = {tensor["name"]: tensor for tensor in plan["tensors"]}
        self._names = [tensor["name"] for tensor in plan["tensors"]]

    @property
    def num_io_tensors(self) -> int:
        return len(self._names)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self._plan["profiles"])

    def get_tensor_name(self, index: int) -> str:
        return self._names[index]

    def get_tensor_mode(self, name: str) -> FakeEnumMember:
        return getattr(self._trt.TensorIOMode, "INPUT" if self._tensors[name]["input"] else "OUTPUT")

    def get_tensor_dtype(self, name: str) -> FakeEnumMember:
        return getattr(self._trt.DataType, self._tensors[name]["dtype"])

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name]["shape"])

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[tuple[int, ...]]:
        return [tuple(shape) for shape in self._plan["profiles"][profile_index][name]]

    def get_device_memory_size_for_profile_v2(self, profile_index: int) -> int:
        return self._plan["device_memory"][profile_index]

    def get_aliased_input_tensor(self, name: str) -> str | None:
        return self._plan["aliases"].get(name)

    def create_execution_context(self, strategy: Any = None) -> "FakeExecutionContext":
        context = FakeExecutionContext(self._trt, self, len(self._trt.contexts), strategy)
        self._trt.contexts.append(context)
        return context

    def _is_input(self, name: str) -> bool:
        return self._tensors[name]["input"]


@dataclass
class Enqueued:
    """What one ``execute_async_v3`` enqueued: the context's state then, and whether it ran from a capture."""
    context: int
    profile: int
    shapes: dict[str, tuple[int, ...]]
    addresses: dict[str, int]
    replayed: bool = False


@dataclass(eq=False)
class FakeExecutionContext:
    _trt: FakeTensorRT
    _engine: FakeCudaEngine
    index: int                                   # creation order over all engines of this FakeTensorRT
    strategy: Any
    calls: list[str] = field(default_factory=list)
    profile: int | None = None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    addresses: dict[str, int] = field(default_factory=dict)
    memory: tuple[int, int] | None = None
    communicator: Any = None
    enqueued: list[Enqueued] = field(default_factory=list)
    refusal: str = ""
    graphs: list = field(default_factory=list)   # the graphs that recorded this context's work


    def _call(self, name: str) -> None:
        self.calls.append(name)

    def _change(self, what: str) -> None:
        if captured(self):
            raise FakeStaleGraph(f"context {self.index} changes {what} after a CUDA graph captured its work: the graph "
                                 "would replay with state this context no longer holds")

    def set_device_memory(self, memory: int, size: int) -> None:
        self._call("set_device_memory")
        self.memory = (memory, size)

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        self._call("set_optimization_profile_async")
        if not 0 <= profile_index < self._engine.num_optimization_profiles:
            return False
        self._change(f"its profile to {profile_index}")
        self.profile, self.shapes = profile_index, {}     # a profile change drops the input shapes
        return True

    def set_communicator(self, communicator: Any) -> bool:
        self._call("set_communicator")
        self.communicator = communicator
        return communicator.hand_over(self)

    def set_input_shape(self, name: str, shape: tuple) -> bool:
        self._call("set_input_shape")
        if name not in self._engine._tensors or not self._engine._is_input(name) or self.profile is None:
            self.refusal = f"set_input_shape({name!r}): not an input, or no profile set"
            return False
        low, _, high = self._engine.get_tensor_profile_shape(name, self.profile)
        shape = tuple(int(size) for size in shape)
        if len(shape) != len(low) or any(not lo <= size <= hi for lo, size, hi in zip(low, shape, high)):
            self.refusal = f"set_input_shape({name!r}, {shape}) outside {low} .. {high}"
            return False
        if self.shapes.get(name) != shape:
            self._change(f"the shape of {name}")
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name: str, memory: int) -> bool:
        self._call("set_tensor_address")
        if name not in self._engine._tensors or not memory:
            self.refusal = f"set_tensor_address({name!r}, {memory})"
            return False
        if self.addresses.get(name) != memory:
            self._change(f"the address of {name}")
        self.addresses[name] = int(memory)
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        self._call("execute_async_v3")
        engine = self._engine
        missing_shapes = [name for name in engine._names if engine._is_input(name) and name not in self.shapes]
        missing_addresses = [name for name in engine._names if name not in self.addresses]
        if self.profile is None or missing_shapes or missing_addresses:
            self.refusal = f"enqueue with shapes missing for {missing_shapes}, addresses for {missing_addresses}"
            return False
        cuda = self._trt.cuda
        recording = cuda is not None and cuda.capturing is not None and cuda.current is cuda.capture_stream
        state = Enqueued(self.index, self.profile, dict(self.shapes), dict(self.addresses), replayed=recording)

        def kernel() -> None:
            if (self.profile, self.shapes, self.addresses) != (state.profile, state.shapes, state.addresses):
                raise FakeStaleGraph(f"a graph replays context {self.index}'s step, captured with profile "
                                     f"{state.profile} and {state.shapes}, but the context now holds profile "
                                     f"{self.profile} and {self.shapes}")
            self.enqueued.append(state)

        if cuda is None:
            kernel()
        else:
            if recording:
                self.graphs.append(cuda.capturing)
            cuda.launch(kernel)
        return True


def captured(context: FakeExecutionContext) -> bool:
    """Whether a graph whose capture ended holds ``context``'s work (the context must not change then)."""
    return any(graph.captured for graph in context.graphs)


@dataclass
class FakeNcclGroup:
    """The ranks' communicator: which contexts each rank handed it to, in order (a collective call: every rank
    must make the same sequence of them)."""
    handed: dict[int, list[tuple[int, int | None]]] = field(default_factory=dict)

    def communicator(self, rank: int) -> "FakeNcclComm":
        self.handed[rank] = []
        return FakeNcclComm(self, rank)


@dataclass
class FakeNcclComm:
    group: FakeNcclGroup
    rank: int

    def hand_over(self, context: FakeExecutionContext) -> bool:
        ordinal = sum(1 for _ in self.group.handed[self.rank])
        self.group.handed[self.rank].append((ordinal, context.profile))
        return True


def fake_step_plan(profiles: tuple[Profile, ...], *, num_layers: int = 2, kv_heads: int = 2, head_dim: int = 8,
                   vocab: int = 32, capacity: int = 64, cache_dtype: str = "HALF", aliased: bool = True,
                   device_memory: int = 4096) -> bytes:
    """The JSON plan of a step graph (``engines/base.py``'s I/O) with these optimisation profiles."""
    tensors, ranges = [], {}

    def add(name: str, is_input: bool, dtype: str, shape: tuple[int, ...], roles: tuple[str, ...] = ()) -> None:
        tensors.append({"name": name, "input": is_input, "dtype": dtype, "shape": list(shape)})
        if is_input:
            ranges[name] = roles

    add("input_ids", True, "INT64", (-1, -1), ("batch", "tokens"))
    add("position_ids", True, "INT64", (-1, -1), ("batch", "tokens"))
    add("tree_mask", True, "INT32", (-1, -1, -1), ("batch", "tokens", "words"))
    add("cache_lengths", True, "INT32", (-1,), ("batch",))
    add("logit_indices", True, "INT64", (-1, -1), ("batch", "tokens"))
    for layer in range(num_layers):
        for name in past_names(layer):
            add(name, True, cache_dtype, (-1, kv_heads, capacity, head_dim), ("batch", kv_heads, capacity, head_dim))
    add("logits", False, "FLOAT", (-1, -1, vocab))
    for layer in range(num_layers):
        for name in present_names(layer):
            add(name, False, cache_dtype, (-1, kv_heads, capacity, head_dim))

    def shape(roles: tuple, batch: int, tokens: int) -> list[int]:
        sizes = {"batch": batch, "tokens": tokens, "words": mask_words(tokens)}
        return [sizes[role] if isinstance(role, str) else role for role in roles]

    profile_shapes = [{name: [shape(roles, b, t) for b, t in zip(profile.batch, profile.tokens)]
                       for name, roles in ranges.items()} for profile in profiles]
    aliases = {present: past for layer in range(num_layers)
               for past, present in zip(past_names(layer), present_names(layer))} if aliased else {}
    return json.dumps({"tensors": tensors, "profiles": profile_shapes, "aliases": aliases,
                       "device_memory": [device_memory] * len(profiles)}).encode()


FAKE_CLASSES = {"Runtime": FakeRuntime, "ICudaEngine": FakeCudaEngine, "IExecutionContext": FakeExecutionContext,
                "Logger": FakeTensorRT.Logger}
