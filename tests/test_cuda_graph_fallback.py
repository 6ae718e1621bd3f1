"""A step shape whose CUDA-graph capture fails keeps running, eagerly, and exactly once per call.

There is no GPU here, so the CUDA calls StepGraph makes are replaced by a named fake (FakeCuda): a stream, a
graph and a capture context that, like CUDA's, records the launches made inside it without executing them, and
fails at the end of the capture as an uncapturable engine does."""
from __future__ import annotations

import contextlib

import pytest
import torch

from ssd_trt.engines.cuda_graphs import StepGraph


class FakeCuda:
    """Stands in for torch.cuda's stream / CUDAGraph / graph capture (no GPU here)."""

    def __init__(self, capture_fails: bool) -> None:
        self.capture_fails, self.capturing, self.executed, self.replayed = capture_fails, False, 0, 0

    def launch(self) -> None:           # the step: executed unless it is being recorded
        if not self.capturing:
            self.executed += 1

    def stream(self, _stream):
        return contextlib.nullcontext()

    def CUDAGraph(self):  # noqa: N802 (torch's name)
        fake = self

        class Graph:
            def replay(self) -> None:
                fake.executed += 1
                fake.replayed += 1
        return Graph()

    @contextlib.contextmanager
    def graph(self, _graph, stream=None, capture_error_mode=None):
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False
        if self.capture_fails:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


class FakeStream:
    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("capture_fails", [False, True])
def test_each_run_executes_the_step_once_whether_or_not_capture_works(monkeypatch, capture_fails):
    cuda = FakeCuda(capture_fails)
    for name in ("stream", "CUDAGraph", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    step = StepGraph(cuda.launch, FakeStream())
    with pytest.warns(RuntimeWarning, match="runs eagerly") if capture_fails else contextlib.nullcontext():
        step.run()
    for _ in range(3):
        step.run()
    assert cuda.executed == 4
    assert step.captured is not capture_fails and cuda.replayed == (0 if capture_fails else 3)
    assert (step.failure is not None and "operation not permitted" in step.failure) is capture_fails
