"""CUDA graphs per shape bucket: which shapes get a graph, which graph a step replays, and the graph.

A CUDA graph replays a fixed sequence of kernel launches with fixed pointers and shapes, removing
the per-step launch overhead that dominates decode steps of a few tokens. The runtime keeps one
graph per *bucket* (batch, T): for the exact-T profiles (decode, verify) and for the small T ranges
(the draft's tree steps, T <= ``GRAPH_MAX_TOKENS``: powers of two and the maximum); prefill runs
eagerly. Measured on an H200 (docs/tensorrt.md): a graph-replayed step of a 135M-parameter model
costs 0.4-3 ms where the eager step costs 3-40 ms. A step may be padded up to a larger bucket:

* extra batch rows are dummy rows (length 0, identity mask) of the runtime's max_batch cache buffers,
  which no live sequence uses;
* extra tokens see only themselves and sit after the real ones, so real tokens never attend to them;
  their keys/values land in slots >= the new length, which the next step overwrites. That needs
  L_b + T_bucket <= S for every row, the ``room`` argument of :func:`select_bucket`.

Every bucket is captured when the engine loads, before any request (``DeviceStepEngine.capture_graphs``).

:func:`plan_buckets`, :func:`select_bucket` and :func:`pad_step` are plain Python / numpy; :class:`StepGraph` and
:class:`GraphCapture` make their CUDA calls through :class:`TorchCuda` (a named fake on CPU in the tests).
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ssd_trt_plugins.tree_attention.masks import pack_tree_mask
from ssd_trt.engines.base import all_indices
from ssd_trt.engines.profiles import Profile


# A ranged profile gets buckets when its longest step has at most this many tokens: SSD's draft tree
# steps (K+1 + K*B, 35 at K=2, B=16; 128 in the embedded recipe) are launch-bound on a GPU, prefill
# up to max_context is not (and would need a graph per length).
GRAPH_MAX_TOKENS = 256


@dataclass(frozen=True, slots=True, order=True)
class GraphBucket:
    """A captured step shape: ``batch`` rows of ``tokens`` new tokens, run under ``profile``."""
    batch: int
    tokens: int
    profile: int  # index into the engine's profiles

    @property
    def area(self) -> int:
        return self.batch * self.tokens


def doubling_sizes(low: int, high: int) -> tuple[int, ...]:
    """``low``, 2·low, 4·low, ... below ``high``, and ``high`` itself (the sizes a step is padded to)."""
    sizes, size = [], max(1, low)
    while size < high:
        sizes.append(size)
        size *= 2
    return tuple(sizes + [high])


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Batch buckets: powers of two below ``max_batch``, and ``max_batch`` itself."""
    return doubling_sizes(1, max_batch)


def token_sizes(profile: Profile) -> tuple[int, ...]:
    """Token buckets of a profile: its T when exact, doubling sizes over a small range, none for prefill."""
    low, _, high = profile.tokens
    if profile.exact_tokens:
        return (low,)
    return doubling_sizes(low, high) if high <= GRAPH_MAX_TOKENS else ()


def plan_buckets(profiles: tuple[Profile, ...]) -> tuple[GraphBucket, ...]:
    """Buckets for every exact-T profile and every small T range (a long range, prefill, runs eagerly)."""
    buckets = []
    for index, profile in enumerate(profiles):
        for tokens in token_sizes(profile):
            for batch in batch_sizes(profile.batch[2]):
                if batch >= profile.batch[0]:
                    buckets.append(GraphBucket(batch, tokens, index))
    return tuple(sorted(buckets, key=lambda b: (b.area, b.tokens, b.batch)))


def select_bucket(buckets: tuple[GraphBucket, ...], batch: int, tokens: int, room: int) -> GraphBucket | None:
    """The smallest bucket (fewest padded token slots) that fits a step, or None to run it eagerly.

    ``room`` is the free cache space of the fullest row, S - max_b L_b: a bucket's padded tokens must
    fit there too.
    """
    if tokens > room:
        raise ValueError(f"{tokens} new tokens do not fit: the fullest row has room for {room}")
    fitting = [b for b in buckets if b.batch >= batch and tokens <= b.tokens <= room]
    return min(fitting, key=lambda b: (b.area, b.tokens, b.batch)) if fitting else None


class TorchCuda:
    """The CUDA calls a capture makes, through torch (``tests/fakes/fake_cuda.py`` stands in for it on CPU)."""

    def stream(self, stream):
        import torch
        return torch.cuda.stream(stream)

    def current_stream(self):
        import torch
        return torch.cuda.current_stream()

    def set_stream(self, stream) -> None:
        import torch
        torch.cuda.set_stream(stream)

    def new_graph(self):
        import torch
        return torch.cuda.CUDAGraph()

    def new_pool(self):
        import torch
        return torch.cuda.graph_pool_handle()

    def graph(self, graph, pool, stream):
        import torch
        # thread_local: the other engine's thread may launch work (not capture: see GraphCapture) meanwhile
        return torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local")

    def end_allocate_to_pool(self, device: int, pool) -> None:
        import torch
        torch._C._cuda_endAllocateToPool(device, pool)

    def release_pool(self, device: int, pool) -> None:
        import torch
        torch._C._cuda_releasePool(device, pool)


class GraphCapture:
    """Captures step graphs on one stream, one capture at a time in the whole process.

    Why the lock is the process's (a class attribute) and not an object a runtime owns: torch documents that "only one
    capture may be underway at a time in the process" (``torch.cuda.graph``), because what a capture changes is the
    process's own -- the caching allocator routes the capturing stream's allocations to the graph's private pool, and
    entering ``torch.cuda.graph`` synchronises the device and empties the cache. A lock per engine or per runtime would
    let two runtimes of one process (a server with two builds, the tests) capture at once.

    A capture that fails leaves the allocator usable: ``CUDAGraph.capture_end`` raises at ``cudaStreamEndCapture``
    (an invalidated capture) *before* it tells the allocator the capture is over (torch's ``CUDAGraph.cpp``), which
    would leave the allocator believing a capture is under way and fail every later one; :meth:`capture` ends that
    capture's hold on the allocator and releases its pool itself, and restores the current stream that
    ``torch.cuda.graph`` does not restore when its exit raises.
    """

    PROCESS_LOCK = threading.Lock()

    def __init__(self, stream, cuda=None) -> None:
        self.stream = stream
        self.cuda = TorchCuda() if cuda is None else cuda

    def capture(self, launch: Callable[[], None]):
        """A CUDA graph of ``launch`` on this stream; RuntimeError (after the clean-up above) if it cannot be one."""
        cuda = self.cuda
        with self.PROCESS_LOCK:
            previous = cuda.current_stream()
            graph, pool = cuda.new_graph(), cuda.new_pool()
            ended = False
            try:
                with cuda.graph(graph, pool, self.stream):
                    launch()
                ended = True
            finally:
                if not ended:
                    self._abandon(pool)
                    cuda.set_stream(previous)
        return graph

    def _abandon(self, pool) -> None:
        """End a failed capture's hold on the allocator. If ``capture_end`` got as far as ending it itself, the
        allocator says so ("not currently recording") and the graph's own reset releases the pool; otherwise the
        pool is released here."""
        device = self.stream.device.index
        try:
            self.cuda.end_allocate_to_pool(device, pool)
        except RuntimeError:
            return
        self.cuda.release_pool(device, pool)


class StepGraph:
    """One CUDA graph of ``launch`` (a step over static buffers), captured by :meth:`capture` when the engine loads.

    ``launch`` enqueues the step on the current stream and reads/writes only buffers whose addresses
    never change. :meth:`capture` runs it once eagerly first (a TensorRT context must enqueue once with its shapes
    before its work can be captured, and the Triton kernel compiles on its first call), then captures it;
    :meth:`run` replays the graph.

    A capture that fails (an engine or kernel that cannot be captured: a host synchronisation inside it, an
    allocation, an unsupported TensorRT layer) costs speed, never a request: the bucket runs eagerly and
    :attr:`failure` says why. Nothing of the failed capture ran (capture records launches, it does not execute them).
    """

    def __init__(self, launch: Callable[[], None], capture: GraphCapture) -> None:
        self._launch = launch
        self._capture = capture
        self._graph = None
        self.failure: str | None = None

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def capture(self) -> None:
        """Run the step once eagerly, then capture it (or record why it cannot be, and warn)."""
        stream = self._capture.stream
        with self._capture.cuda.stream(stream):
            self._launch()
        stream.synchronize()
        try:
            self._graph = self._capture.capture(self._launch)
        except RuntimeError as error:
            text = str(error).strip()
            self.failure = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
            warnings.warn(f"CUDA graph capture failed ({self.failure}); this step shape runs eagerly", RuntimeWarning,
                          stacklevel=2)

    def run(self) -> None:
        """Run the step on the graph's stream: a replay, or the eager launch when it could not be captured."""
        with self._capture.cuda.stream(self._capture.stream):
            if self._graph is not None:
                self._graph.replay()
            else:
                self._launch()


def idle_step(rows: int, tokens: int) -> dict[str, np.ndarray]:
    """Host inputs of a step of ``rows`` x ``tokens`` padding only (what a graph is captured on, before any request):
    every token sees only itself, every row has length 0."""
    no_rows = np.zeros((0, 1), dtype=np.int64)
    return pad_step(no_rows, no_rows, np.ones((0, 1, 1), dtype=bool), np.zeros(0, dtype=np.int32), rows, tokens)


def pad_step(input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray, lengths: np.ndarray,
             rows: int, tokens: int, extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Host inputs of one step padded to ``rows`` x ``tokens`` (a bucket), mask packed.

    ``tree_mask`` is bool [B,T,T]. Padded tokens repeat the row's last position and see only
    themselves; padded rows have length 0, token 0 and an identity mask. Real tokens see exactly what
    they saw before, so their outputs are unchanged (tests/test_trt_build.py checks this with the
    reference attention). ``extra`` (a feature draft's per-token inputs [B,T,...]) is zero-padded.
    """
    batch, num_new = input_ids.shape
    if rows < batch or tokens < num_new:
        raise ValueError(f"cannot pad a {batch} x {num_new} step down to {rows} x {tokens}")
    ids = np.zeros((rows, tokens), dtype=np.int64)
    ids[:batch, :num_new] = input_ids
    positions = np.zeros((rows, tokens), dtype=np.int64)
    positions[:batch, :num_new] = position_ids
    positions[:batch, num_new:] = position_ids[:, -1:]
    mask = np.broadcast_to(np.eye(tokens, dtype=bool), (rows, tokens, tokens)).copy()
    mask[:batch, :num_new, :num_new] = tree_mask
    cache_lengths = np.zeros(rows, dtype=np.int32)
    cache_lengths[:batch] = lengths
    padded = {}
    for name, value in (extra or {}).items():
        padded[name] = np.zeros((rows, tokens) + value.shape[2:], dtype=value.dtype)
        padded[name][:batch, :num_new] = value
    return {"input_ids": ids, "position_ids": positions, "tree_mask": pack_tree_mask(mask),
            "cache_lengths": cache_lengths, "logit_indices": all_indices(rows, tokens).copy(), **padded}
