"""CUDA graph capture (``engines/cuda_graphs.py``): a failed capture leaves the allocator usable and its step running
eagerly, exactly once per call; captures are serialised over the whole process.

There is no GPU here, so the CUDA calls a capture makes go to a named fake (``tests/fakes/fake_cuda.py``): a capture
records the launches made on its stream without running them, a replay runs them, and a failing ``capture_end`` leaves
the allocator's capture list and the current stream as torch's does."""
from __future__ import annotations

import contextlib
import threading

import pytest

from ssd_trt.engines.cuda_graphs import GraphCapture, StepGraph
from tests.fakes.fake_cuda import FakeCuda, FakeStream


@pytest.mark.parametrize("capture_fails", [False, True])
def test_each_run_executes_the_step_once_whether_or_not_capture_works(capture_fails):
    cuda = FakeCuda(fail_capture_end=1 if capture_fails else 0)
    runs = []
    step = StepGraph(lambda: cuda.launch(lambda: runs.append("step")), GraphCapture(FakeStream(), cuda))
    with pytest.warns(RuntimeWarning, match="runs eagerly") if capture_fails else contextlib.nullcontext():
        step.capture()
    assert len(runs) == 1                           # the warm-up run before the capture
    for _ in range(3):
        step.run()
    assert len(runs) == 4                           # replayed, or run eagerly after a failed capture
    assert step.captured is not capture_fails
    assert (step.failure is not None and "operation not permitted" in step.failure) is capture_fails


def test_a_failed_capture_leaves_the_allocator_and_the_stream_usable():
    cuda = FakeCuda(fail_capture_end=1)
    stream = FakeStream()
    before = cuda.current_stream()
    capture = GraphCapture(stream, cuda)
    with pytest.raises(RuntimeError, match="operation not permitted"):
        capture.capture(lambda: cuda.launch(lambda: None))
    assert cuda.pools_under_capture == [], "the allocator still believes a capture is under way"
    assert len(cuda.released_pools) == 1, "the failed capture's pool was not released"
    assert cuda.current_stream() is before, "the capture stream was left current"
    graph = capture.capture(lambda: cuda.launch(lambda: None))     # and the next capture works
    assert graph.captured and len(graph.kernels) == 1


def test_a_step_that_raises_inside_the_capture_does_not_release_the_pool_twice():
    """capture_end ran (the allocator's hold ended there); the graph's own reset owns the pool then."""
    cuda = FakeCuda()

    def failing_launch():
        raise RuntimeError("TensorRT failed to enqueue")

    with pytest.raises(RuntimeError, match="failed to enqueue"):
        GraphCapture(FakeStream(), cuda).capture(failing_launch)
    assert cuda.pools_under_capture == [] and cuda.released_pools == []


def test_captures_are_serialised_over_the_process():
    """Two engines' captures (two GraphCapture objects, two threads) never overlap: the lock is the process's."""
    cuda_a, cuda_b = FakeCuda(), FakeCuda()
    first, second = GraphCapture(FakeStream(), cuda_a), GraphCapture(FakeStream(), cuda_b)
    assert first.PROCESS_LOCK is second.PROCESS_LOCK
    inside, release, order = threading.Event(), threading.Event(), []

    def slow_launch():
        order.append("a starts")
        inside.set()
        release.wait(5)
        order.append("a ends")

    thread = threading.Thread(target=first.capture, args=(slow_launch,))
    thread.start()
    assert inside.wait(5)
    other = threading.Thread(target=second.capture, args=(lambda: order.append("b"),))
    other.start()
    other.join(0.2)
    assert other.is_alive(), "a second capture started while the first was under way"
    release.set()
    thread.join(5)
    other.join(5)
    assert order == ["a starts", "a ends", "b"]
