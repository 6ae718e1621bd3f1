"""A fake of the CUDA calls a graph capture makes (``ssd_trt.engines.cuda_graphs.TorchCuda``'s interface).

It models what the capture logic depends on: a capture records the launches made on the capturing stream instead of
running them, and a replay runs what was recorded; torch's caching allocator keeps a list of captures under way,
which ``torch.cuda.graph`` ends in ``CUDAGraph.capture_end`` only *after* ``cudaStreamEndCapture`` succeeds (torch's
``aten/src/ATen/cuda/CUDAGraph.cpp``), and while one is listed the next capture fails; a failing ``capture_end``
leaves the capture stream current (``torch.cuda.graph.__exit__`` exits its stream context after it)."""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class FakeDevice:
    index: int = 0


class FakeStream:
    """A CUDA stream: its handle (what TensorRT takes), its device, and synchronize."""
    _handles = itertools.count(0x5000)

    def __init__(self, device: int = 0) -> None:
        self.device = FakeDevice(device)
        self.cuda_stream = next(self._handles)
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


@dataclass
class FakeGraph:
    """A captured graph: the launches recorded on the capturing stream, run again by replay."""
    kernels: list[Callable[[], None]] = field(default_factory=list)
    captured: bool = False
    replays: int = 0

    def replay(self) -> None:
        assert self.captured, "replay of a graph whose capture did not end"
        self.replays += 1
        for kernel in self.kernels:
            kernel()


class FakeCuda:
    """Streams, graphs, capture and the allocator's capture list. ``fail_capture_end``: how many of the next captures
    fail in ``capture_end`` (an invalidated capture: ``cudaStreamEndCapture`` returns an error)."""

    def __init__(self, fail_capture_end: int = 0) -> None:
        self.fail_capture_end = fail_capture_end
        self.default = FakeStream()
        self.current = self.default
        self.capturing: FakeGraph | None = None
        self.capture_stream: FakeStream | None = None
        self.pools_under_capture: list[tuple[int, int]] = []
        self.released_pools: list[tuple[int, int]] = []
        self.executed = 0                       # launches run (not recorded)
        self._pool_ids = itertools.count(1)

    # -- TorchCuda's interface -------------------------------------------------------------------------
    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def current_stream(self) -> FakeStream:
        return self.current

    def set_stream(self, stream: FakeStream) -> None:
        self.current = stream

    def new_graph(self) -> FakeGraph:
        return FakeGraph()

    def new_pool(self) -> tuple[int, int]:
        return (0, next(self._pool_ids))

    @contextlib.contextmanager
    def graph(self, graph: FakeGraph, pool, stream: FakeStream):
        # torch.cuda.graph.__enter__: the stream becomes current, then capture_begin (allocator first)
        if self.pools_under_capture:
            raise RuntimeError("the caching allocator has a capture under way (a failed capture was never ended)")
        previous, self.current = self.current, stream
        self.pools_under_capture.append(pool)
        self.capturing, self.capture_stream = graph, stream
        try:
            yield
        finally:
            self.capturing = self.capture_stream = None     # cudaStreamEndCapture ends the capture either way
            if self.fail_capture_end:
                self.fail_capture_end -= 1
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            self.pools_under_capture.remove(pool)           # CUDACachingAllocator::endAllocateToPool
            graph.captured = True
            self.current = previous                         # torch.cuda.graph.__exit__: the stream context exits

    def end_allocate_to_pool(self, device: int, pool) -> None:
        if pool not in self.pools_under_capture:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.pools_under_capture.remove(pool)

    def release_pool(self, device: int, pool) -> None:
        self.released_pools.append(pool)

    # -- what a launch does --------------------------------------------------------------------------
    def launch(self, kernel: Callable[[], None]) -> None:
        """Record ``kernel`` when its stream is capturing, else run it."""
        if self.capturing is not None and self.current is self.capture_stream:
            self.capturing.kernels.append(kernel)
        else:
            self.executed += 1
            kernel()
