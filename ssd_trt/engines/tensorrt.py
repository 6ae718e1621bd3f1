"""TensorRT engine runtime behind the common :class:`~ssd_trt.engines.base.Engine` interface (GPU).

The caches, CUDA-graph buckets, streams and timing are :class:`~ssd_trt.engines.device_step.DeviceStepEngine`'s
(shared with the torch/Triton GPU engine, which is how that code has run on a GPU without TensorRT).
What is TensorRT's own:

* **Bindings** by tensor name; ``past_*_i`` and ``present_*_i`` are bound to the same cache buffer
  (updated in place: by the plugin in a data-centre plan, ``plugins/tree_attention/trt_plugin.py``; by the
  native KV-cache update layer in a TensorRT for RTX plan, ``export/native_graph.py``).
* **Execution contexts**: one per optimisation profile (decode, verify, tree, prefill), all
  sharing one user-managed device-memory block: they run one at a time on this engine's stream.

Importing this module never imports TensorRT; constructing an engine first runs the subprocess
probe (``availability.py``) and raises RuntimeError with its reason when TensorRT or a GPU is missing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ssd_trt.engines.base import EngineSpec, past_names, present_names
from ssd_trt.engines.device_step import DeviceStepEngine, Placement, StepBuffers, StepExtras, causal_mask, \
    place_draft_and_target
from ssd_trt.engines.availability import probe_tensorrt, probe_tensorrt_rtx
from ssd_trt.engines.editions import EDITIONS
from ssd_trt.engines.bindings import BindingLayout
from ssd_trt.engines.profiles import Profile

__all__ = ["Placement", "TensorRTEngine", "causal_mask", "check_spec", "place_draft_and_target"]


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


class TensorRTEngine(DeviceStepEngine):
    """One model's TensorRT engine; caches and CUDA graphs as in :class:`DeviceStepEngine`."""

    def __init__(self, engine_path: Path | str, spec: EngineSpec | None = None, *, name: str | None = None,
                 placement: Placement = Placement(), use_cuda_graphs: bool = True, edition: str = "datacenter",
                 communicator: Any = None) -> None:
        """Load ``engine_path`` onto ``placement`` with ``edition``'s TensorRT (``trt/editions.py``). ``spec``
        (e.g. from the manifest) is checked against the engine; without it the spec is read from the engine's
        bindings and profiles. Callers check the plan first (``plans.check_plan``). ``communicator``: a
        tensor-parallel rank plan's NCCL communicator (``engines/communicator.py``), handed to every execution
        context before its first step; every rank creates its contexts in the same order, as each hand-over waits
        for all ranks."""
        if edition == "rtx":
            probe = probe_tensorrt_rtx()
            available, reason = probe["run"], probe["reason"]
        else:
            available, reason = probe_tensorrt()
        if not available:
            raise RuntimeError(f"TensorRTEngine ({edition}) needs its TensorRT and a CUDA GPU: {reason}")
        trt = EDITIONS[edition].import_module()

        self._trt = trt
        device = torch.device("cuda", placement.device)
        engine_path = Path(engine_path)
        with torch.cuda.device(device):
            self._logger = trt.Logger(trt.Logger.WARNING)
            self._runtime = trt.Runtime(self._logger)
            self._engine = self._runtime.deserialize_cuda_engine(engine_path.read_bytes())
            if self._engine is None:
                raise RuntimeError(f"TensorRT could not deserialise {engine_path} (built for another GPU or "
                                   "TensorRT version?)")
            self.layout = BindingLayout.from_trt_engine(self._engine, trt)
            profiles = self._read_profiles()
            capacity = self.layout.static_capacity() or self._engine.get_tensor_profile_shape(
                past_names(0)[0], 0)[2][2]
            found = EngineSpec(name=name or (spec.name if spec else engine_path.stem),
                               vocab_size=self.layout.vocab_size, num_layers=self.layout.num_layers,
                               num_kv_heads=self.layout.num_kv_heads, head_dim=self.layout.head_dim,
                               max_batch=max(profile.batch[2] for profile in profiles), max_context=capacity)
            check_spec(spec, found, engine_path)
        super().__init__(found, profiles, device=device, cache_dtype=getattr(torch, self.layout.cache_dtype),
                         logits_dtype=getattr(torch, self.layout.logits_dtype),
                         stream_priority=placement.stream_priority, use_cuda_graphs=use_cuda_graphs,
                         extras=layout_extras(self.layout))
        with torch.cuda.device(device):
            self._contexts = self._make_contexts(communicator)

    # -- setup ---------------------------------------------------------------------------------------
    def _read_profiles(self) -> tuple[Profile, ...]:
        """Profiles as built (batch and T ranges read back from the engine's input_ids)."""
        profiles = []
        for index in range(self._engine.num_optimization_profiles):
            low, opt, high = (tuple(shape) for shape in self._engine.get_tensor_profile_shape("input_ids", index))
            profiles.append(Profile(f"profile{index}", (low[0], opt[0], high[0]), (low[1], opt[1], high[1])))
        return tuple(profiles)

    def _make_contexts(self, communicator: Any = None) -> list:
        trt, engine = self._trt, self._engine
        if hasattr(engine, "get_device_memory_size_for_profile_v2"):  # newer TensorRT: per-profile sizes
            sizes = [engine.get_device_memory_size_for_profile_v2(i) for i in range(engine.num_optimization_profiles)]
        else:
            sizes = [engine.device_memory_size]
        self._scratch = torch.empty(max(sizes + [1]), dtype=torch.uint8, device=self._device)
        contexts = []
        for index in range(engine.num_optimization_profiles):
            context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            if hasattr(context, "set_device_memory"):
                context.set_device_memory(self._scratch.data_ptr(), self._scratch.numel())
            else:
                context.device_memory = self._scratch.data_ptr()
            context.set_optimization_profile_async(index, self._stream.cuda_stream)
            if communicator is not None and not context.set_communicator(communicator):
                raise RuntimeError(f"TensorRT refused the ranks' NCCL communicator for profile {index} of "
                                   f"{self.spec.name} (see the TensorRT log)")
            contexts.append(context)
        self._stream.synchronize()
        return contexts

    # -- execution -----------------------------------------------------------------------------------
    def _launch(self, profile: int, buffers: StepBuffers) -> None:
        """Bind every tensor by name and enqueue the step on the current stream."""
        context = self._contexts[profile]
        for name, tensor in buffers.inputs.items():
            context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, tensor.data_ptr())
        for layer, (key, value) in enumerate(self.caches):
            for past, present, cache in zip(past_names(layer), present_names(layer), (key, value)):
                rows = cache[:buffers.rows]  # leading-dimension slice: contiguous, same base address
                context.set_input_shape(past, tuple(rows.shape))
                context.set_tensor_address(past, rows.data_ptr())
                context.set_tensor_address(present, rows.data_ptr())  # in place: aliased to past
        context.set_tensor_address("logits", buffers.logits.data_ptr())
        if self.extras.output is not None:            # a feature pair's features / hidden
            context.set_tensor_address(self.extras.output[0], buffers.extra_output.data_ptr())
        if not context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise RuntimeError("TensorRT failed to enqueue the step (see the TensorRT log)")
