"""TensorRT engine runtime behind the common :class:`~ssd_trt.engines.base.Engine` interface (GPU).

The caches, CUDA-graph buckets, streams and timing are :class:`~ssd_trt.engines.device_step.DeviceStepEngine`'s
(shared with the torch/Triton GPU engine, which is how that code has run on a GPU without TensorRT).
What is TensorRT's own:

* **Bindings** by tensor name; ``past_*_i`` and ``present_*_i`` are bound to the same cache buffer
  (updated in place: by the plugin in a data-centre plan, ``plugins/tree_attention/trt_plugin.py``; by the
  native KV-cache update layer in a TensorRT for RTX plan, ``export/native_graph.py``). At load the plan is asked
  whether it really aliases them (``ICudaEngine.get_aliased_input_tensor``); where it does not, TensorRT copies the
  whole cache of that layer every step, and a warning says so.
* **Execution contexts**: one per optimisation profile for eager steps (prefill, and every step without CUDA
  graphs), re-bound before each; and **one per captured CUDA graph**, bound once to its bucket's static buffers when
  the engine loads and never touched again. A graph replays the launches recorded from its context with that
  context's shapes; were the context shared, a later ``set_input_shape`` for another bucket (or an eager prefill)
  would change what the context holds under a graph that cannot see it. Every context shares one user-managed
  device-memory block: they all run on this engine's one stream, one at a time. Several contexts may use one
  profile: profile sharing is on, and cannot be turned off, since TensorRT 10.0 (``PreviewFeature::
  kPROFILE_SHARING_0806``, "Deprecated in TensorRT 10.0. The default value for this flag is on and can not be
  changed", NvInfer.h; https://docs.rs/trtx-sys/latest/trtx_sys/real_bindings/nvinfer1/enum.PreviewFeature.html).
* **Every call's answer checked**: ``deserialize_cuda_engine`` and ``create_execution_context`` (None),
  ``set_optimization_profile_async``, ``set_communicator``, ``set_input_shape``, ``set_tensor_address`` and
  ``execute_async_v3`` (False); the error names the tensor, the shape and the profile.
* A tensor-parallel rank's contexts each get the ranks' NCCL communicator (``engines/communicator.py``), in the same
  order on every rank (each hand-over waits for all ranks): the profiles' contexts, then the graphs' in bucket
  order; then TensorRT's NCCL is checked to be the library torch's process group runs.

:data:`RUNTIME_API` lists every TensorRT attribute this module and ``bindings.py`` use; the tests check it against
``tensorrt_rtx`` and the TensorRT 11.4 bindings, and that the source uses nothing else.

Importing this module never imports TensorRT; loading a plan from a file first runs the subprocess
probe (``availability.py``) and raises RuntimeError with its reason when TensorRT or a GPU is missing.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from ssd_trt.engines.availability import probe_tensorrt, probe_tensorrt_rtx
from ssd_trt.engines.base import EngineSpec, past_names, present_names
from ssd_trt.engines.bindings import BindingLayout
from ssd_trt.engines.communicator import check_same_nccl, process_maps
from ssd_trt.engines.cuda_graphs import GraphBucket, GraphCapture
from ssd_trt.engines.device_step import DeviceStepEngine, Placement, StepBuffers, StepExtras, causal_mask, \
    place_draft_and_target
from ssd_trt.engines.editions import EDITIONS
from ssd_trt.engines.profiles import Profile

__all__ = ["Placement", "RUNTIME_API", "TensorRTEngine", "TensorRTPlan", "causal_mask", "check_spec",
           "place_draft_and_target"]

# Every TensorRT class member the runtime uses (here and in bindings.py), by class. ``engine.x`` is an ICudaEngine's,
# ``context.x`` an IExecutionContext's, ``runtime.x`` a Runtime's, ``trt.C.x`` the module's: the tests derive those
# from the source and check them against this table, and the table against tensorrt_rtx and the 11.4 bindings.
RUNTIME_API: dict[str, tuple[str, ...]] = {
    "Logger": ("WARNING",),
    "Runtime": ("deserialize_cuda_engine",),
    "ICudaEngine": ("create_execution_context", "get_aliased_input_tensor", "get_device_memory_size_for_profile_v2",
                    "get_tensor_dtype", "get_tensor_mode", "get_tensor_name", "get_tensor_profile_shape",
                    "get_tensor_shape", "num_io_tensors", "num_optimization_profiles"),
    "IExecutionContext": ("execute_async_v3", "set_communicator", "set_device_memory", "set_input_shape",
                          "set_optimization_profile_async", "set_tensor_address"),
    "ExecutionContextAllocationStrategy": ("USER_MANAGED",),
    "TensorIOMode": ("INPUT",),
}


def check_spec(expected: EngineSpec | None, found: EngineSpec, path: Path) -> None:
    """ValueError when the engine file does not implement the model ``expected`` describes."""
    if expected is None:
        return
    for field in ("vocab_size", "num_layers", "num_kv_heads", "head_dim"):
        if getattr(expected, field) != getattr(found, field):
            raise ValueError(f"{path}: engine has {field} = {getattr(found, field)}, the manifest says "
                             f"{getattr(expected, field)}: rebuild the engine")
    for field in ("max_batch", "max_context"):
        if getattr(found, field) < getattr(expected, field):
            raise ValueError(f"{path}: engine supports {field} {getattr(found, field)} < {getattr(expected, field)} "
                             "asked for: rebuild with the recipe's limits")


def layout_extras(layout: BindingLayout) -> StepExtras:
    """A feature pair's extra I/O as the plan declares it (``BindingLayout``): a target's features output, or a
    feature draft's inputs and hidden output, in the plan's types."""
    names = {tensor.name for tensor in layout.tensors}
    if "draft_hidden" in names:
        features, hidden = layout.tensor("features"), layout.tensor("draft_hidden")
        if features.dtype != hidden.dtype:
            raise ValueError(f"the plan's features ({features.dtype}) and draft_hidden ({hidden.dtype}) differ in type")
        return StepExtras.feature_draft(features.shape[-1], hidden.shape[-1], getattr(torch, features.dtype))
    if "features" in names:
        features = layout.tensor("features")
        return StepExtras.target_features(features.shape[-1], getattr(torch, features.dtype))
    return StepExtras()


def open_tensorrt(edition: str) -> Any:
    """``edition``'s TensorRT module (``engines/editions.py``), after the subprocess probe says it can run here."""
    if edition == "rtx":
        probe = probe_tensorrt_rtx()
        available, reason = probe["run"], probe["reason"]
    else:
        available, reason = probe_tensorrt()
    if not available:
        raise RuntimeError(f"TensorRTEngine ({edition}) needs its TensorRT and a CUDA GPU: {reason}")
    return EDITIONS[edition].import_module()


class TensorRTPlan:
    """A deserialised plan: its TensorRT module, engine, binding layout and profiles."""

    def __init__(self, trt: Any, engine: Any, path: Path, runtime: Any = None) -> None:
        self.trt, self.engine, self.path = trt, engine, Path(path)
        self._runtime = runtime        # the engine must not outlive the runtime that deserialised it
        self.layout = BindingLayout.from_trt_engine(engine, trt)
        self.profiles = tuple(self._profile(index) for index in range(engine.num_optimization_profiles))

    @classmethod
    def load(cls, trt: Any, path: Path | str) -> "TensorRTPlan":
        """Deserialise the plan at ``path`` with ``trt`` (on the current CUDA device)."""
        path = Path(path)
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise RuntimeError(f"TensorRT could not deserialise {path} (built for another GPU or TensorRT version?)")
        return cls(trt, engine, path, runtime)

    def _profile(self, index: int) -> Profile:
        """A profile as built (batch and T ranges read back from the engine's input_ids)."""
        low, opt, high = (tuple(shape) for shape in self.engine.get_tensor_profile_shape("input_ids", index))
        return Profile(f"profile{index}", (low[0], opt[0], high[0]), (low[1], opt[1], high[1]))

    def describe(self, profile: int) -> str:
        """``profile`` as an error names it: its index and ranges."""
        ranges = self.profiles[profile]
        return (f"profile {profile} (batch {ranges.batch[0]}-{ranges.batch[2]} x T {ranges.tokens[0]}-"
                f"{ranges.tokens[2]})")

    def input_range(self, name: str, profile: int) -> str:
        """The (min .. max) shapes ``profile`` admits for input ``name``."""
        low, _, high = (tuple(shape) for shape in self.engine.get_tensor_profile_shape(name, profile))
        return f"{low} .. {high}"

    def scratch_bytes(self) -> int:
        """Device memory one context needs under its largest profile (every context shares one block)."""
        engine = self.engine
        return max([engine.get_device_memory_size_for_profile_v2(i) for i in range(len(self.profiles))] + [1])

    def unaliased_caches(self) -> list[tuple[str, str, str | None]]:
        """(output, the input it should alias, what TensorRT aliases it to) for each cache output the plan does not
        update in place. ``get_aliased_input_tensor`` names the input an output shares memory with, None if none
        (its docstring in both editions' bindings)."""
        gaps = []
        for output, expected in self.layout.aliases:
            found = self.engine.get_aliased_input_tensor(output)
            if found != expected:
                gaps.append((output, expected, found))
        return gaps

    def warn_unaliased(self, name: str) -> None:
        """Warn, once per plan, when TensorRT copies caches instead of updating them in place."""
        gaps = self.unaliased_caches()
        if not gaps:
            return
        shown = ", ".join(f"{output} -> {found or 'no input'} (expected {expected})" for output, expected, found in
                          gaps[:4])
        warnings.warn(f"{name} ({self.path}): TensorRT does not alias {len(gaps)} of {len(self.layout.aliases)} "
                      f"cache outputs to their inputs ({shown}{', ...' if len(gaps) > 4 else ''}): it copies those "
                      "caches every step (O(context) per layer per step), so decode will be slow; the steps stay "
                      "correct because each present_* is bound to its past_* buffer. Rebuild the plan with the "
                      "in-place cache (data-centre: the plugin's aliased outputs, PreviewFeature."
                      "ALIASED_PLUGIN_IO_10_03; RTX: the KV-cache update layer)", RuntimeWarning, stacklevel=3)


def _device_scope(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class TensorRTEngine(DeviceStepEngine):
    """One model's TensorRT engine; caches and CUDA graphs as in :class:`DeviceStepEngine`."""

    def __init__(self, plan: Path | str | TensorRTPlan, spec: EngineSpec | None = None, *, name: str | None = None,
                 placement: Placement = Placement(), use_cuda_graphs: bool = True, edition: str = "datacenter",
                 communicator: Any = None, device: torch.device | str | None = None,
                 capture: GraphCapture | None = None) -> None:
        """Load ``plan`` (a plan file, or a deserialised :class:`TensorRTPlan`) onto ``placement`` with
        ``edition``'s TensorRT (``engines/editions.py``), and capture its CUDA graphs. ``spec`` (e.g. from the
        manifest) is checked against the engine; without it the spec is read from the engine's bindings and
        profiles. Callers check the plan first (``plans.check_plan``). ``communicator``: a tensor-parallel rank
        plan's ``RankCommunicator`` (``engines/communicator.py``). ``device`` and ``capture``: where the buffers
        live and what captures graphs (defaults: the placement's GPU, CUDA graphs on the engine's stream; the tests
        run a recording fake of TensorRT on CPU with a fake CUDA)."""
        device = torch.device("cuda", placement.device) if device is None else torch.device(device)
        if not isinstance(plan, TensorRTPlan):
            trt = open_tensorrt(edition)
            with _device_scope(device):
                plan = TensorRTPlan.load(trt, plan)
        self.plan = plan
        self.layout = plan.layout
        capacity = self.layout.static_capacity() or plan.engine.get_tensor_profile_shape(past_names(0)[0], 0)[2][2]
        found = EngineSpec(name=name or (spec.name if spec else plan.path.stem),
                           vocab_size=self.layout.vocab_size, num_layers=self.layout.num_layers,
                           num_kv_heads=self.layout.num_kv_heads, head_dim=self.layout.head_dim,
                           max_batch=max(profile.batch[2] for profile in plan.profiles), max_context=capacity)
        check_spec(spec, found, plan.path)
        super().__init__(found, plan.profiles, device=device, cache_dtype=getattr(torch, self.layout.cache_dtype),
                         logits_dtype=getattr(torch, self.layout.logits_dtype),
                         stream_priority=placement.stream_priority, use_cuda_graphs=use_cuda_graphs,
                         extras=layout_extras(self.layout), capture=capture)
        self._communicator = communicator
        with _device_scope(device):
            plan.warn_unaliased(found.name)
            self._scratch = torch.empty(plan.scratch_bytes(), dtype=torch.uint8, device=device)
            self._eager = [self._new_context(profile) for profile in range(len(plan.profiles))]
            if communicator is not None:
                check_same_nccl(communicator.nccl_libraries, process_maps())
            if self._stream is not None:
                self._stream.synchronize()
            self.capture_graphs()

    # -- contexts ------------------------------------------------------------------------------------
    @property
    def _stream_handle(self) -> int:
        """The engine's CUDA stream as TensorRT takes it (0 when there is none: a fake TensorRT on CPU)."""
        return self._stream.cuda_stream if self._stream is not None else 0

    def _new_context(self, profile: int) -> Any:
        """A context on the shared device memory, set to ``profile`` on this engine's stream, holding the ranks'
        communicator when there is one."""
        trt, engine = self.plan.trt, self.plan.engine
        context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if context is None:
            raise RuntimeError(f"TensorRT could not create an execution context for {self.spec.name} "
                               f"({self.plan.describe(profile)}; see the TensorRT log)")
        context.set_device_memory(self._scratch.data_ptr(), self._scratch.numel())
        if not context.set_optimization_profile_async(profile, self._stream_handle):
            raise RuntimeError(f"TensorRT refused {self.plan.describe(profile)} for a context of {self.spec.name} "
                               "(see the TensorRT log)")
        if self._communicator is not None and not context.set_communicator(self._communicator.capsule):
            raise RuntimeError(f"TensorRT refused the ranks' NCCL communicator for a context of {self.spec.name} "
                               f"under {self.plan.describe(profile)} (see the TensorRT log)")
        return context

    def _bind(self, context: Any, profile: int, buffers: StepBuffers) -> None:
        """Every input's shape and every input's and output's address for one step over ``buffers``; present_*
        shares its past_* buffer (the first ``buffers.rows`` rows: a leading slice, same base address)."""
        inputs = dict(buffers.inputs)
        outputs = {"logits": buffers.logits}
        if self.extras.output is not None:              # a feature pair's features / hidden
            outputs[self.extras.output[0]] = buffers.extra_output
        for layer, (key, value) in enumerate(self.caches):
            for past, present, cache in zip(past_names(layer), present_names(layer), (key, value)):
                inputs[past] = outputs[present] = cache[:buffers.rows]
        unbound = {tensor.name for tensor in self.layout.tensors} - set(inputs) - set(outputs)
        if unbound:
            raise RuntimeError(f"{self.spec.name}: the plan has tensors the runtime does not bind: {sorted(unbound)}")
        for name, tensor in inputs.items():
            if not context.set_input_shape(name, tuple(tensor.shape)):
                raise RuntimeError(f"TensorRT refused input {name} of shape {tuple(tensor.shape)} for "
                                   f"{self.spec.name} under {self.plan.describe(profile)}, which admits "
                                   f"{self.plan.input_range(name, profile)} (see the TensorRT log)")
        for name, tensor in {**inputs, **outputs}.items():
            if not context.set_tensor_address(name, tensor.data_ptr()):
                raise RuntimeError(f"TensorRT refused the address of {name} (shape {tuple(tensor.shape)}) for "
                                   f"{self.spec.name} under {self.plan.describe(profile)} (see the TensorRT log)")

    def _enqueue(self, context: Any, profile: int, buffers: StepBuffers) -> None:
        if not context.execute_async_v3(self._stream_handle):
            raise RuntimeError(f"TensorRT failed to enqueue a step of {buffers.rows} x {buffers.tokens} tokens for "
                               f"{self.spec.name} under {self.plan.describe(profile)} (see the TensorRT log)")

    # -- execution -----------------------------------------------------------------------------------
    def _launch(self, profile: int, buffers: StepBuffers) -> None:
        """An eager step: the profile's own context, bound for these buffers, enqueued on the engine's stream."""
        context = self._eager[profile]
        self._bind(context, profile, buffers)
        self._enqueue(context, profile, buffers)

    def _graph_launch(self, bucket: GraphBucket, buffers: StepBuffers) -> Callable[[], None]:
        """A graph's step: a context of its own, bound once to the bucket's static buffers."""
        context = self._new_context(bucket.profile)
        self._bind(context, bucket.profile, buffers)
        return functools.partial(self._enqueue, context, bucket.profile, buffers)
