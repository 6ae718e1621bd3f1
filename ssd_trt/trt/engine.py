"""TensorRT engine runtime behind the common :class:`~ssd_trt.engines.base.Engine` interface (GPU).

What the runtime owns and why:

* **KV caches**: one [max_batch, Hkv, S, D] buffer per layer and per K/V, allocated once. Both
  ``past_*_i`` and ``present_*_i`` are bound to it (the plugin updates it in place, see
  ``plugins/tree_attention/trt_plugin.py``), so a step costs O(T) cache writes, and rollback is
  just a length change. Batch b < max_batch binds the leading-dimension slice [:b] (contiguous).
* **Execution contexts**: one per optimisation profile (decode, verify, tree, prefill), all
  sharing one user-managed device-memory block: they run one at a time on this engine's stream.
* **CUDA graphs** per shape bucket (``cuda_graphs.py``): decode / verify / tree steps are padded to
  a bucket, their inputs copied into the bucket's static buffers and the graph replayed; prefill
  runs eagerly. Bindings are by tensor name.
* **A stream and a device** (:class:`Placement`): draft and target run on two GPUs, or on two streams
  of one GPU (:func:`place_draft_and_target`), concurrently from two threads.
* **CUDA events** around every step: :attr:`TensorRTEngine.last_step_ms`.

Importing this module never imports TensorRT; constructing an engine first runs the subprocess
probe (``availability.py``) and raises RuntimeError with its reason when TensorRT or a GPU is missing.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ssd_trt.engines.base import EngineSpec, past_names, present_names
from ssd_trt.trt.availability import probe_tensorrt
from ssd_trt.trt.bindings import BindingLayout
from ssd_trt.trt.cuda_graphs import GraphBucket, StepGraph, pad_step, plan_buckets, select_bucket
from ssd_trt.trt.profiles import Profile, select_profile

@dataclass(frozen=True, slots=True)
class Placement:
    """Where an engine runs: a CUDA device and the priority of its own stream (lower = more urgent)."""
    device: int = 0
    stream_priority: int = 0


def place_draft_and_target(num_gpus: int) -> tuple[Placement, Placement]:
    """(draft, target) placement: two GPUs when there are, else two streams of GPU 0.

    On one GPU the target's stream gets the higher priority: its verification is the critical path,
    the draft's speculation fills the gaps.
    """
    if num_gpus < 1:
        raise ValueError("the TensorRT runtime needs at least one CUDA device")
    if num_gpus >= 2:
        return Placement(device=1), Placement(device=0)
    return Placement(device=0, stream_priority=0), Placement(device=0, stream_priority=-1)


def causal_mask(batch: int, tokens: int) -> np.ndarray:
    """bool [B,T,T] lower-triangular mask (the chain case)."""
    return np.broadcast_to(np.tril(np.ones((tokens, tokens), dtype=bool)), (batch, tokens, tokens)).copy()


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


class _StepBuffers:
    """Device tensors for one step shape (rows x tokens); static when they belong to a graph bucket."""

    def __init__(self, device: torch.device, layout: BindingLayout, rows: int, tokens: int) -> None:
        words = (tokens + 31) // 32
        self.rows, self.tokens = rows, tokens
        self.inputs = {
            "input_ids": torch.zeros((rows, tokens), dtype=torch.int64, device=device),
            "position_ids": torch.zeros((rows, tokens), dtype=torch.int64, device=device),
            "tree_mask": torch.zeros((rows, tokens, words), dtype=torch.int32, device=device),
            "cache_lengths": torch.zeros((rows,), dtype=torch.int32, device=device),
        }
        self.logits = torch.empty((rows, tokens, layout.vocab_size),
                                  dtype=getattr(torch, layout.logits_dtype), device=device)

    def upload(self, host: dict[str, np.ndarray]) -> None:
        for name, tensor in self.inputs.items():
            tensor.copy_(torch.from_numpy(np.ascontiguousarray(host[name])), non_blocking=False)


class TensorRTEngine:
    """One model's TensorRT engine, its KV caches and its CUDA graphs (see module docstring)."""

    def __init__(self, engine_path: Path | str, spec: EngineSpec | None = None, *, name: str | None = None,
                 placement: Placement = Placement(), use_cuda_graphs: bool = True) -> None:
        """Load ``engine_path`` onto ``placement``. ``spec`` (e.g. from the manifest) is checked against the
        engine; without it the spec is read from the engine's bindings and profiles."""
        available, reason = probe_tensorrt()
        if not available:
            raise RuntimeError(f"TensorRTEngine needs TensorRT >= 10.9 and a CUDA GPU: {reason}")
        import tensorrt as trt

        self._trt = trt
        self._device = torch.device("cuda", placement.device)
        engine_path = Path(engine_path)
        with torch.cuda.device(self._device):
            self._stream = torch.cuda.Stream(self._device, priority=placement.stream_priority)
            self._logger = trt.Logger(trt.Logger.WARNING)
            self._runtime = trt.Runtime(self._logger)
            self._engine = self._runtime.deserialize_cuda_engine(engine_path.read_bytes())
            if self._engine is None:
                raise RuntimeError(f"TensorRT could not deserialise {engine_path} (built for another GPU or "
                                   "TensorRT version?)")
            self.layout = BindingLayout.from_trt_engine(self._engine)
            self._profiles = self._read_profiles()
            capacity = self.layout.static_capacity() or self._engine.get_tensor_profile_shape(
                past_names(0)[0], 0)[2][2]
            max_batch = max(profile.batch[2] for profile in self._profiles)
            self.spec = EngineSpec(name=name or (spec.name if spec else engine_path.stem),
                                   vocab_size=self.layout.vocab_size, num_layers=self.layout.num_layers,
                                   num_kv_heads=self.layout.num_kv_heads, head_dim=self.layout.head_dim,
                                   max_batch=max_batch, max_context=capacity)
            check_spec(spec, self.spec, engine_path)
            self._contexts = self._make_contexts()
            cache_dtype = getattr(torch, self.layout.cache_dtype)
            shape = (max_batch, self.layout.num_kv_heads, capacity, self.layout.head_dim)
            self._caches = [(torch.zeros(shape, dtype=cache_dtype, device=self._device),
                             torch.zeros(shape, dtype=cache_dtype, device=self._device))
                            for _ in range(self.layout.num_layers)]
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
        self._buckets = plan_buckets(self._profiles) if use_cuda_graphs else ()
        self._graphs: dict[GraphBucket, tuple[StepGraph, _StepBuffers]] = {}
        self._lengths = np.zeros(0, dtype=np.int32)
        self.last_step_ms = 0.0

    # -- setup ---------------------------------------------------------------------------------------
    def _read_profiles(self) -> tuple[Profile, ...]:
        """Profiles as built (batch and T ranges read back from the engine's input_ids)."""
        profiles = []
        for index in range(self._engine.num_optimization_profiles):
            low, opt, high = (tuple(shape) for shape in self._engine.get_tensor_profile_shape("input_ids", index))
            profiles.append(Profile(f"profile{index}", (low[0], opt[0], high[0]), (low[1], opt[1], high[1])))
        return tuple(profiles)

    def _make_contexts(self) -> list:
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
            contexts.append(context)
        self._stream.synchronize()
        return contexts

    # -- Engine interface ----------------------------------------------------------------------------
    def reset(self, batch: int) -> None:
        """Start ``batch`` empty sequences (cache contents are simply overwritten later)."""
        if not 1 <= batch <= self.spec.max_batch:
            raise ValueError(f"batch must be in [1, {self.spec.max_batch}] (engine.max_batch), got {batch}")
        self._lengths = np.zeros(batch, dtype=np.int32)

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths.copy()

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray,
                tree_mask: np.ndarray | None = None) -> np.ndarray:
        """Append ``input_ids`` [B,T] to every row; return float32 logits [B,T,V]."""
        ids = np.asarray(input_ids, dtype=np.int64)
        positions = np.asarray(position_ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[0] != len(self._lengths) or positions.shape != ids.shape:
            raise ValueError(f"input_ids and position_ids must both be [{len(self._lengths)}, T] (call reset(batch) "
                             f"first); got {ids.shape} and {positions.shape}")
        batch, tokens = ids.shape
        mask = causal_mask(batch, tokens) if tree_mask is None else np.asarray(tree_mask, dtype=bool)
        if mask.shape != (batch, tokens, tokens) or not mask[:, np.arange(tokens), np.arange(tokens)].all():
            raise ValueError(f"tree_mask must be bool [{batch}, {tokens}, {tokens}] with every token seeing itself")
        room = self.spec.max_context - int(self._lengths.max())
        if tokens > room:
            raise ValueError(f"{tokens} new tokens overflow the cache (room {room} of {self.spec.max_context}); "
                             "roll back or raise engine.max_context")
        profile = select_profile(self._profiles, batch, tokens)
        bucket = select_bucket(self._buckets, batch, tokens, room) if self._buckets else None
        rows, padded = (bucket.batch, bucket.tokens) if bucket else (batch, tokens)
        host = pad_step(ids, positions, mask, self._lengths, rows, padded)
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            self._start.record(self._stream)
            if bucket is not None:
                graph, buffers = self._graph_for(bucket)
                buffers.upload(host)
                graph.run()
            else:
                buffers = _StepBuffers(self._device, self.layout, rows, padded)
                buffers.upload(host)
                self._launch(profile, buffers)
            self._end.record(self._stream)
            logits = buffers.logits[:batch, :tokens].float().cpu()
        self.last_step_ms = self._start.elapsed_time(self._end)
        self._lengths = self._lengths + tokens
        return logits.numpy()

    def rollback(self, lengths: np.ndarray) -> None:
        """Truncate every row to ``lengths`` [B] (<= current): later steps overwrite the tail."""
        new = np.asarray(lengths, dtype=np.int32)
        if new.shape != self._lengths.shape or (new < 0).any() or (new > self._lengths).any():
            raise ValueError(f"rollback lengths must be [{len(self._lengths)}] ints in [0, current lengths "
                             f"{self._lengths.tolist()}], got {new.tolist()}")
        self._lengths = new.copy()

    def keep(self, row: int, start: int, offsets: Sequence[int]) -> None:
        """Keep slots ``start + offsets[i]`` of ``row`` as slots ``start + i`` (the accepted tree path)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        if not 0 <= row < len(self._lengths):
            raise ValueError(f"row must be in [0, {len(self._lengths)}), got {row}")
        length = int(self._lengths[row])
        if not 0 <= start <= length or (offsets < 0).any() or (start + offsets >= length).any():
            raise ValueError(f"keep: slots start + offsets must lie in [start, {length}) for row {row}; got start "
                             f"{start}, offsets {offsets.tolist()}")
        if len(offsets):
            with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                source = torch.as_tensor(start + offsets, device=self._device)
                for key, value in self._caches:
                    for cache in (key, value):
                        # Gather first (a copy), then write: source and destination slots may overlap.
                        cache[row, :, start:start + len(offsets)] = cache[row, :, source]
            self._stream.synchronize()
        self._lengths[row] = start + len(offsets)

    # -- execution -----------------------------------------------------------------------------------
    def _graph_for(self, bucket: GraphBucket) -> tuple[StepGraph, _StepBuffers]:
        if bucket not in self._graphs:
            buffers = _StepBuffers(self._device, self.layout, bucket.batch, bucket.tokens)
            graph = StepGraph(lambda: self._launch(bucket.profile, buffers), self._stream)
            self._graphs[bucket] = (graph, buffers)
        return self._graphs[bucket]

    def _launch(self, profile: int, buffers: _StepBuffers) -> None:
        """Bind every tensor by name and enqueue the step on the current stream."""
        context = self._contexts[profile]
        for name, tensor in buffers.inputs.items():
            context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, tensor.data_ptr())
        for layer, (key, value) in enumerate(self._caches):
            for past, present, cache in zip(past_names(layer), present_names(layer), (key, value)):
                rows = cache[:buffers.rows]  # leading-dimension slice: contiguous, same base address
                context.set_input_shape(past, tuple(rows.shape))
                context.set_tensor_address(past, rows.data_ptr())
                context.set_tensor_address(present, rows.data_ptr())  # in place: aliased to past
        context.set_tensor_address("logits", buffers.logits.data_ptr())
        if not context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise RuntimeError("TensorRT failed to enqueue the step (see the TensorRT log)")
