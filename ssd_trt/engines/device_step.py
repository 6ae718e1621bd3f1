"""The engine interface over a step function that runs on a torch device: caches, buckets, CUDA graphs.

What this runtime owns and why (shared by the TensorRT engine and the torch/Triton engine, which only
differ in how one step is enqueued, :meth:`DeviceStepEngine._launch`):

* **KV caches**: one [max_batch, Hkv, S, D] buffer per layer and per K/V, allocated once. A step
  updates them in place (the tree-attention kernel writes the T new slots), so it costs O(T) cache
  writes and rollback is just a length change. Batch b < max_batch uses the leading-dimension slice
  [:b] (contiguous, same base address).
* **CUDA graphs** per shape bucket (``ssd_trt/engines/cuda_graphs.py``), every one captured when the engine loads
  (:meth:`DeviceStepEngine.capture_graphs`, before any request): decode / verify / tree steps are padded to a
  bucket, their inputs copied into the bucket's static buffers and the graph replayed; prefill runs eagerly. A
  bucket's launch is :meth:`DeviceStepEngine._graph_launch`, which a launcher with per-shape state overrides
  (TensorRT: one execution context per graph, bound once, which no other step touches).
* **A stream** per engine (on a GPU): draft and target run concurrently from two threads on two
  streams or two GPUs (:func:`place_draft_and_target`); the target's stream gets the priority.
* **Timing**: CUDA events around every step (``last_step_ms``); wall time on CPU.

On a CPU device there is no stream and no graph: every step runs eagerly. That is how the tests run
this exact code path (forward, padding, rollback, keep) on machines without a GPU.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ssd_trt.engines.base import EngineDefaults, EngineSpec, check_batch, check_keep, check_room, checked_rollback
from ssd_trt.engines.cuda_graphs import GraphBucket, GraphCapture, StepGraph, idle_step, pad_step, plan_buckets, \
    select_bucket
from ssd_trt.engines.profiles import Profile, select_profile
from ssd_trt.engines.rows import PaddedRows, check_order, reorder


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
        raise ValueError("the GPU runtime needs at least one CUDA device")
    if num_gpus >= 2:
        return Placement(device=1), Placement(device=0)
    return Placement(device=0, stream_priority=0), Placement(device=0, stream_priority=-1)


def causal_mask(batch: int, tokens: int) -> np.ndarray:
    """bool [B,T,T] lower-triangular mask (the chain case)."""
    return np.broadcast_to(np.tril(np.ones((tokens, tokens), dtype=bool)), (batch, tokens, tokens)).copy()


@dataclass(frozen=True, slots=True)
class StepExtras:
    """A feature pair's per-token I/O beyond the step graph's (``engines/base.py``): a target returns its
    ``features`` [B,T,F]; a feature draft (EAGLE-3) takes ``features``, ``draft_hidden``, ``from_target`` and
    returns ``hidden`` [B,T,H]. ``inputs``: (name, width or None for [B,T], dtype); ``output``: (name, width,
    dtype)."""
    inputs: tuple[tuple[str, int | None, torch.dtype], ...] = ()
    output: tuple[str, int, torch.dtype] | None = None

    @classmethod
    def feature_draft(cls, feature_width: int, hidden_width: int, dtype: torch.dtype) -> "StepExtras":
        return cls((("features", feature_width, dtype), ("draft_hidden", hidden_width, dtype),
                    ("from_target", None, torch.bool)), ("hidden", hidden_width, dtype))

    @classmethod
    def target_features(cls, feature_width: int, dtype: torch.dtype) -> "StepExtras":
        return cls((), ("features", feature_width, dtype))

    @property
    def widths(self) -> dict[str, int]:
        """Each per-token input's last dimension (``FeatureDraftEngine`` sizes what it feeds from these)."""
        return {name: width for name, width, _ in self.inputs if width is not None}


class StepBuffers:
    """Device tensors for one step shape (rows x tokens); static when they belong to a graph bucket."""

    def __init__(self, device: torch.device, vocab_size: int, logits_dtype: torch.dtype, rows: int,
                 tokens: int, extras: StepExtras = StepExtras()) -> None:
        words = (tokens + 31) // 32
        self.rows, self.tokens = rows, tokens
        self.inputs = {
            "input_ids": torch.zeros((rows, tokens), dtype=torch.int64, device=device),
            "position_ids": torch.zeros((rows, tokens), dtype=torch.int64, device=device),
            "tree_mask": torch.zeros((rows, tokens, words), dtype=torch.int32, device=device),
            "cache_lengths": torch.zeros((rows,), dtype=torch.int32, device=device),
            "logit_indices": torch.zeros((rows, tokens), dtype=torch.int64, device=device),
        }
        for name, width, dtype in extras.inputs:
            shape = (rows, tokens) if width is None else (rows, tokens, width)
            self.inputs[name] = torch.zeros(shape, dtype=dtype, device=device)
        self.logits = torch.empty((rows, tokens, vocab_size), dtype=logits_dtype, device=device)
        self.extra_output = None if extras.output is None else \
            torch.empty((rows, tokens, extras.output[1]), dtype=extras.output[2], device=device)

    def upload(self, host: dict[str, np.ndarray]) -> None:
        for name, tensor in self.inputs.items():
            tensor.copy_(torch.from_numpy(np.ascontiguousarray(host[name])), non_blocking=False)


class DeviceStepEngine(EngineDefaults):
    """Engine interface (``engines/base.py``) over :meth:`_launch`, which subclasses implement.

    ``_launch(profile, buffers)`` must enqueue one step on the current stream: read
    ``buffers.inputs`` and the first ``buffers.rows`` rows of :attr:`caches`, write the T new
    keys/values into those caches in place, the logits into ``buffers.logits`` (and a feature pair's
    output into ``buffers.extra_output``), touching no other
    memory whose address changes between calls (so that it can be captured in a CUDA graph).
    Subclasses call :meth:`capture_graphs` once their launcher is ready, at the end of their construction.

    ``capture``: the engine's stream and what captures the buckets' graphs on it (default on a GPU: a new stream of
    ``stream_priority``, CUDA graphs when ``use_cuda_graphs``; the tests give a :class:`GraphCapture` over a fake
    CUDA to run the graph path on CPU).
    """

    def __init__(self, spec: EngineSpec, profiles: tuple[Profile, ...], *, device: torch.device,
                 cache_dtype: torch.dtype, logits_dtype: torch.dtype, stream_priority: int = 0,
                 use_cuda_graphs: bool = True, extras: StepExtras = StepExtras(),
                 capture: GraphCapture | None = None) -> None:
        self.spec = spec
        self.extras = extras
        # what OrtEngine offers a feature pair (decoding/feature_relay.py, engines/feature_draft.py)
        self.extra_inputs = tuple(name for name, _, _ in extras.inputs)
        self.extra_widths = extras.widths
        self.has_features = extras.output is not None and extras.output[0] == "features"
        self.last_features: np.ndarray | None = None
        self.last_hidden: np.ndarray | None = None
        self._profiles = profiles
        self._device = device
        self._logits_dtype = logits_dtype
        on_gpu = device.type == "cuda"
        self._on_gpu = on_gpu
        if capture is None and on_gpu:        # the engine's stream, which its graphs are captured on
            capture = GraphCapture(torch.cuda.Stream(device, priority=stream_priority))
        self._stream = capture.stream if capture is not None else None
        shape = (spec.max_batch, spec.num_kv_heads, spec.max_context, spec.head_dim)
        self.caches = [(torch.zeros(shape, dtype=cache_dtype, device=device),
                        torch.zeros(shape, dtype=cache_dtype, device=device))
                       for _ in range(spec.num_layers)]
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if on_gpu else None
        self._capture = capture if use_cuda_graphs else None
        self._buckets = plan_buckets(profiles) if self._capture is not None else ()
        self._graphs: dict[GraphBucket, tuple[StepGraph, StepBuffers]] = {}
        self._lengths = np.zeros(0, dtype=np.int32)
        self.last_step_ms = 0.0

    def _on_device(self):
        """Make this engine's device and stream current; nothing to do on CPU."""
        if not self._on_gpu:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self._device))
        stack.enter_context(torch.cuda.stream(self._stream))
        return stack

    @property
    def captured_buckets(self) -> tuple[GraphBucket, ...]:
        """The buckets whose CUDA graph has been captured so far."""
        return tuple(bucket for bucket, (graph, _) in self._graphs.items() if graph.captured)

    # -- Engine interface ----------------------------------------------------------------------------
    def reset(self, batch: int) -> None:
        """Start ``batch`` empty sequences (cache contents are simply overwritten later)."""
        check_batch(self.spec, batch)
        self._lengths = np.zeros(batch, dtype=np.int32)

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths.copy()

    def select_rows(self, order: Sequence[int | None]) -> None:
        """Continuous batching (``engines/rows.py``): keep these rows in this order (None: a new empty row); a
        gather on the device."""
        check_order(order, len(self._lengths))
        check_batch(self.spec, len(order))
        kept = [(new, old) for new, old in enumerate(order) if old is not None]
        if kept:
            with self._on_device():
                source = torch.as_tensor([old for _, old in kept], device=self._device)
                target = torch.as_tensor([new for new, _ in kept], device=self._device)
                for key, value in self.caches:
                    for cache in (key, value):
                        cache[target] = cache[source]        # gathered first (a copy): rows may overlap
            if self._stream is not None:
                self._stream.synchronize()
        self._lengths = reorder(self._lengths, order)

    def rows(self, start: int, stop: int) -> PaddedRows:
        """Rows ``start .. stop-1``: the whole batch steps, the other rows padded (on a GPU a step's cost barely
        depends on its row count)."""
        return PaddedRows(self, start, stop)

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray | None = None,
                logit_indices: np.ndarray | None = None, extra: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """Append ``input_ids`` [B,T] to every row; return float32 logits [B,L,V] (``logit_indices`` [B,L];
        None: all T). On a device the step computes every position's logits (the LM head is cheap there,
        and one static shape per bucket keeps CUDA graphs simple); the pick happens on the device, so only the
        L picked rows cross to the host (a prefill of 2000 tokens with a 128k vocabulary would otherwise copy
        1 GB to keep one row).
        ``extra``: a feature draft's per-token inputs (``StepExtras``)."""
        if set(extra or ()) != set(self.extra_inputs):
            raise ValueError(f"{self.spec.name}: the step takes extra inputs {list(self.extra_inputs)}, got "
                             f"{sorted(extra or ())}")
        ids = np.asarray(input_ids, dtype=np.int64)
        positions = np.asarray(position_ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[0] != len(self._lengths) or positions.shape != ids.shape:
            raise ValueError(f"input_ids and position_ids must both be [{len(self._lengths)}, T] (call reset(batch) "
                             f"first); got {ids.shape} and {positions.shape}")
        batch, tokens = ids.shape
        mask = causal_mask(batch, tokens) if tree_mask is None else np.asarray(tree_mask, dtype=bool)
        if mask.shape != (batch, tokens, tokens) or not mask[:, np.arange(tokens), np.arange(tokens)].all():
            raise ValueError(f"tree_mask must be bool [{batch}, {tokens}, {tokens}] with every token seeing itself")
        check_room(self.spec, int(self._lengths.max()), tokens)
        room = self.spec.max_context - int(self._lengths.max())
        profile = select_profile(self._profiles, batch, tokens)
        bucket = select_bucket(self._buckets, batch, tokens, room) if self._buckets else None
        rows, padded = (bucket.batch, bucket.tokens) if bucket else (batch, tokens)
        host = pad_step(ids, positions, mask, self._lengths, rows, padded, extra)
        started = time.perf_counter()
        with self._on_device():
            if self._events:
                self._events[0].record(self._stream)
            if bucket is not None:
                if bucket not in self._graphs:
                    raise RuntimeError(f"{self.spec.name}: its step graphs are captured when it loads "
                                       "(capture_graphs), and they were not")
                graph, buffers = self._graphs[bucket]
                buffers.upload(host)
                graph.run()
            else:
                buffers = StepBuffers(self._device, self.spec.vocab_size, self._logits_dtype, rows, padded,
                                      self.extras)
                buffers.upload(host)
                self._launch(profile, buffers)
            if self._events:
                self._events[1].record(self._stream)
            logits = buffers.logits[:batch, :tokens]
            if logit_indices is not None:
                picked = torch.tensor(np.asarray(logit_indices, dtype=np.int64), device=logits.device)
                logits = torch.take_along_dim(logits, picked[..., None], dim=1)
            logits = logits.float().cpu()  # waits for the stream
            if self.extras.output is not None:
                out = buffers.extra_output[:batch, :tokens].float().cpu().numpy()
                if self.has_features:
                    self.last_features = out
                else:
                    self.last_hidden = out
        self.last_step_ms = self._events[0].elapsed_time(self._events[1]) if self._events else \
            (time.perf_counter() - started) * 1000.0
        self._lengths = self._lengths + tokens
        return logits.numpy()

    def rollback(self, lengths: np.ndarray) -> None:
        """Truncate every row to ``lengths`` [B] (<= current): later steps overwrite the tail."""
        self._lengths = checked_rollback(self._lengths, lengths)

    def keep(self, row: int, start: int, offsets: Sequence[int]) -> None:
        """Keep slots ``start + offsets[i]`` of ``row`` as slots ``start + i`` (the accepted tree path)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        check_keep(self._lengths, row, start, offsets)
        if len(offsets):
            with self._on_device():
                source = torch.as_tensor(start + offsets, device=self._device)
                for key, value in self.caches:
                    for cache in (key, value):
                        # Gather first (a copy), then write: source and destination slots may overlap.
                        cache[row, :, start:start + len(offsets)] = cache[row, :, source]
            if self._stream is not None:
                self._stream.synchronize()
        self._lengths[row] = start + len(offsets)

    # -- execution -----------------------------------------------------------------------------------
    def capture_graphs(self) -> None:
        """Capture every bucket's graph now (at load: a request never waits for a capture, and no capture runs while
        the other engine serves one). Each bucket gets its own static buffers, filled with a padding-only step
        (:func:`idle_step`) for the warm-up run; a bucket that cannot be captured runs eagerly (``StepGraph``)."""
        if self._graphs:
            raise RuntimeError(f"{self.spec.name}: the CUDA graphs were already captured")
        with self._on_device():
            for bucket in self._buckets:
                buffers = StepBuffers(self._device, self.spec.vocab_size, self._logits_dtype, bucket.batch,
                                      bucket.tokens, self.extras)
                buffers.upload(idle_step(bucket.batch, bucket.tokens))
                graph = StepGraph(self._graph_launch(bucket, buffers), self._capture)
                graph.capture()
                self._graphs[bucket] = (graph, buffers)

    def _graph_launch(self, bucket: GraphBucket, buffers: StepBuffers) -> Callable[[], None]:
        """What ``bucket``'s graph captures: one step over its static ``buffers`` (by default the eager launch;
        a launcher whose launches carry per-shape state overrides it with state of the graph's own)."""
        return functools.partial(self._launch, bucket.profile, buffers)

    def _launch(self, profile: int, buffers: StepBuffers) -> None:
        raise NotImplementedError
