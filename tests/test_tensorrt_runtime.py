"""The TensorRT runtime (``engines/tensorrt.py``) against a recording fake of TensorRT, on CPU.

``TensorRTEngine`` runs here exactly as on a GPU but over ``tests/fakes/recording_tensorrt.py`` (the runtime API with
the real names, parameters and answers, checked in ``test_tensorrt_surface.py``) and a fake CUDA whose captures
record the enqueued work and whose replays run it again (``tests/fakes/fake_cuda.py``). The fake freezes a context
once a graph captured its work, so a graph that would replay on a re-bound context fails here.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from ssd_trt.engines.base import past_names, present_names
from ssd_trt.engines.communicator import RankCommunicator
from ssd_trt.engines.cuda_graphs import GraphCapture, plan_buckets
from ssd_trt.engines.limits import EngineLimits
from ssd_trt.engines.profiles import derive_profiles
from ssd_trt.engines.tensorrt import TensorRTEngine, TensorRTPlan
from tests.fakes.fake_cuda import FakeCuda, FakeStream
from tests.fakes.recording_tensorrt import FakeExecutionContext, FakeNcclGroup, FakeTensorRT, captured, \
    fake_step_plan

# max_context above GRAPH_MAX_TOKENS: prefill runs eagerly, decode / verify / tree steps replay graphs
LIMITS = EngineLimits(max_batch=4, max_context=512, max_draft_len=3, max_tree_size=8)
PROFILES = derive_profiles(LIMITS)
LAYERS = 2


def open_engine(tmp_path, *, graphs: bool = True, communicator=None, aliased: bool = True,
                cuda: FakeCuda | None = None) -> tuple[FakeTensorRT, TensorRTEngine]:
    cuda = cuda or FakeCuda()
    trt = FakeTensorRT(cuda)
    path = tmp_path / f"engine{len(list(tmp_path.iterdir()))}.plan"
    path.write_bytes(fake_step_plan(PROFILES, num_layers=LAYERS, capacity=LIMITS.max_context, aliased=aliased))
    engine = TensorRTEngine(TensorRTPlan.load(trt, path), name="target", device="cpu", use_cuda_graphs=graphs,
                            capture=GraphCapture(FakeStream(), cuda), communicator=communicator)
    return trt, engine


def run_steps(engine: TensorRTEngine) -> None:
    """Prefills (eager: T > the tree's 8), decode, verify and tree steps (graphs) of several sizes, a prefill between
    them, and a batch change: every kind of step touching every kind of context."""
    rng = np.random.default_rng(0)

    def step(tokens: int) -> None:
        batch = len(engine.lengths)
        ids = rng.integers(0, 32, (batch, tokens))
        positions = engine.lengths[:, None] + np.arange(tokens)
        engine.forward(ids, positions)

    engine.reset(2)
    for tokens in (12, 1, 1, 4, 3, 6, 1, 300, 1, 4, 2):
        step(tokens)
    engine.reset(3)
    for tokens in (20, 1, 4, 8, 5):
        step(tokens)
    engine.reset(1)
    for tokens in (10, 1, 1, 4, 2):
        step(tokens)


def graph_contexts(trt: FakeTensorRT) -> list[FakeExecutionContext]:
    return trt.contexts[len(PROFILES):]


def test_every_graph_is_captured_at_load_on_a_context_of_its_own(tmp_path):
    trt, engine = open_engine(tmp_path)
    buckets = plan_buckets(PROFILES)
    assert set(engine.captured_buckets) == set(buckets), "every bucket's graph is captured when the engine loads"
    contexts = graph_contexts(trt)
    assert len(trt.contexts) == len(PROFILES) + len(buckets)
    assert all(map(captured, contexts)) and not any(map(captured, trt.contexts[:len(PROFILES)]))
    for bucket, context in zip(buckets, contexts):
        assert context.profile == bucket.profile
        assert context.shapes["input_ids"] == (bucket.batch, bucket.tokens)
    run_steps(engine)                               # a stale replay raises FakeStaleGraph
    replayed = [record for context in contexts for record in context.enqueued if record.replayed]
    assert replayed, "decode / verify / tree steps should replay their graphs"
    for context in contexts:                        # a graph's context only ever ran its own bucket's shapes
        assert len({tuple(sorted(record.shapes.items())) for record in context.enqueued}) == 1
    assert set(engine.captured_buckets) == set(buckets), "no capture happens after load"


def test_calls_come_in_order_and_every_input_and_output_is_bound(tmp_path):
    trt, engine = open_engine(tmp_path)
    run_steps(engine)
    names = {tensor.name for tensor in engine.layout.tensors}
    inputs = {tensor.name for tensor in engine.layout.inputs}
    setup = r"set_device_memory,set_optimization_profile_async,"
    binding = rf"(set_input_shape,){{{len(inputs)}}}(set_tensor_address,){{{len(names)}}}"
    eager = re.compile(rf"{setup}({binding}execute_async_v3,)*")
    graph = re.compile(rf"{setup}{binding}execute_async_v3,execute_async_v3,")      # warm-up, capture; then replays
    for index, context in enumerate(trt.contexts):
        calls = ",".join(context.calls) + ","
        assert (eager if index < len(PROFILES) else graph).fullmatch(calls), f"context {index}: {context.calls}"
        for record in context.enqueued:
            assert set(record.addresses) == names and set(record.shapes) == inputs
    assert sum(len(context.enqueued) for context in trt.contexts[:len(PROFILES)]) >= 3   # the eager prefills ran


def test_past_and_present_caches_share_one_buffer(tmp_path):
    trt, engine = open_engine(tmp_path)
    run_steps(engine)
    for context in trt.contexts:
        for record in context.enqueued:
            for layer, (key, value) in enumerate(engine.caches):
                for past, present, cache in zip(past_names(layer), present_names(layer), (key, value)):
                    assert record.addresses[present] == record.addresses[past] == cache.data_ptr()


def test_every_rank_hands_its_communicator_to_its_contexts_in_one_order(tmp_path):
    group = FakeNcclGroup()
    ranks = []
    for rank in range(2):
        folder = tmp_path / f"rank{rank}"
        folder.mkdir()
        ranks.append(open_engine(folder, communicator=RankCommunicator(group.communicator(rank), ())))
    assert group.handed[0] == group.handed[1]
    for trt, _ in ranks:
        assert len(group.handed[0]) == len(trt.contexts)
        for context in trt.contexts:                # once each, before anything is bound or enqueued
            assert context.calls[:3] == ["set_device_memory", "set_optimization_profile_async", "set_communicator"]
            assert context.calls.count("set_communicator") == 1


def test_a_failed_capture_runs_that_bucket_eagerly_on_its_own_context(tmp_path):
    cuda = FakeCuda(fail_capture_end=1)
    with pytest.warns(RuntimeWarning, match="runs eagerly"):
        trt, engine = open_engine(tmp_path, cuda=cuda)
    first = plan_buckets(PROFILES)[0]
    assert first not in engine.captured_buckets and len(engine.captured_buckets) == len(plan_buckets(PROFILES)) - 1
    assert cuda.pools_under_capture == []
    run_steps(engine)
    eager_graph = graph_contexts(trt)[0]
    assert not captured(eager_graph) and len(eager_graph.enqueued) > 1    # decode 1 x 1 ran eagerly, on its context
    assert len({tuple(sorted(record.shapes.items())) for record in eager_graph.enqueued}) == 1


def test_a_refused_call_names_the_tensor_the_shape_and_the_profile(tmp_path, monkeypatch):
    _, engine = open_engine(tmp_path, graphs=False)
    engine.reset(1)
    refuse = FakeExecutionContext.set_input_shape
    monkeypatch.setattr(FakeExecutionContext, "set_input_shape",
                        lambda self, name, shape: name != "cache_lengths" and refuse(self, name, shape))
    with pytest.raises(RuntimeError, match=r"refused input cache_lengths of shape \(1,\) for target under profile 3 "
                                           r"\(batch 1-4 x T 1-512\), which admits \(1,\) \.\. \(4,\)"):
        engine.forward(np.ones((1, 12), dtype=np.int64), np.arange(12)[None])
    monkeypatch.setattr(FakeExecutionContext, "set_input_shape", refuse)
    monkeypatch.setattr(FakeExecutionContext, "execute_async_v3", lambda self, stream_handle: False)
    with pytest.raises(RuntimeError, match=r"failed to enqueue a step of 1 x 1 tokens for target under profile 0"):
        engine.forward(np.ones((1, 1), dtype=np.int64), np.zeros((1, 1), dtype=np.int64))


def test_a_refused_profile_or_context_fails_the_load_clearly(tmp_path, monkeypatch):
    monkeypatch.setattr(FakeExecutionContext, "set_optimization_profile_async",
                        lambda self, profile_index, stream_handle: False)
    with pytest.raises(RuntimeError, match=r"refused profile 0 \(batch 1-4 x T 1-1\)"):
        open_engine(tmp_path)
    monkeypatch.undo()
    from tests.fakes.recording_tensorrt import FakeCudaEngine
    monkeypatch.setattr(FakeCudaEngine, "create_execution_context", lambda self, strategy=None: None)
    with pytest.raises(RuntimeError, match="could not create an execution context"):
        open_engine(tmp_path)


def test_a_plan_that_copies_its_caches_is_named_at_load(tmp_path):
    with pytest.warns(RuntimeWarning, match=rf"does not alias {2 * LAYERS} of {2 * LAYERS} cache outputs"):
        open_engine(tmp_path, aliased=False)


def test_a_plan_that_cannot_be_read_fails_clearly(tmp_path):
    path = tmp_path / "broken.plan"
    path.write_bytes(b"not a plan")
    with pytest.raises(RuntimeError, match="could not deserialise"):
        TensorRTPlan.load(FakeTensorRT(), path)


def test_a_split_target_refuses_to_start_when_tensorrt_runs_another_nccl(tmp_path, monkeypatch):
    from ssd_trt.engines import tensorrt as runtime
    from tests.test_nccl_libraries import SYSTEM_NCCL, TORCH_NCCL, WITH_TENSORRTS

    monkeypatch.setattr(runtime, "process_maps", lambda: WITH_TENSORRTS)
    group = FakeNcclGroup()
    with pytest.raises(RuntimeError, match=f"loaded .*{SYSTEM_NCCL}.* with {TORCH_NCCL}"):
        open_engine(tmp_path, communicator=RankCommunicator(group.communicator(0), (TORCH_NCCL,)))
