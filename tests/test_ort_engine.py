"""The ONNX Runtime engine: incremental steps equal one prefill, rollback and keep are exact."""
from __future__ import annotations

import numpy as np

import ssd_trt


def engine(build_dir):
    return ssd_trt.load(build_dir).engine("target")


def test_incremental_decode_equals_prefill(tiny_pairs):
    e = engine(tiny_pairs["self"])
    ids = np.random.default_rng(0).integers(3, 256, (2, 12))
    e.reset(2)
    full = e.forward(ids, np.arange(12)[None].repeat(2, 0))
    e.reset(2)
    parts = [e.forward(ids[:, :5], np.arange(5)[None].repeat(2, 0))]
    for i in range(5, 12):
        parts.append(e.forward(ids[:, i:i + 1], np.full((2, 1), i)))
    assert np.abs(np.concatenate(parts, 1) - full).max() < 1e-4


def test_rollback_then_redo_gives_same_logits(tiny_pairs):
    e = engine(tiny_pairs["self"])
    e.reset(1)
    e.forward(np.array([[5, 6, 7, 8]]), np.arange(4)[None])
    a = e.forward(np.array([[9]]), np.array([[4]]))
    e.rollback(np.array([4]))
    e.forward(np.array([[200, 201]]), np.array([[4, 5]]))     # overwrite with something else
    e.rollback(np.array([4]))
    b = e.forward(np.array([[9]]), np.array([[4]]))
    assert np.abs(a - b).max() < 1e-5


def test_tree_step_then_keep_equals_feeding_the_path(tiny_pairs):
    e = engine(tiny_pairs["self"])
    prefix = np.array([[5, 6, 7]])
    # tree: root r; children a, b; a's child c.  layout [r, a, b, c]
    tokens = np.array([[10, 11, 12, 13]])
    mask = np.array([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=bool)
    e.reset(1)
    e.forward(prefix, np.arange(3)[None])
    e.forward(tokens, np.array([[3, 4, 4, 5]]), mask)
    e.keep(0, 3, [0, 1, 3])                                     # path r -> a -> c
    after_keep = e.forward(np.array([[14]]), np.array([[6]]))
    e.reset(1)
    direct = e.forward(np.array([[5, 6, 7, 10, 11, 13, 14]]), np.arange(7)[None])[:, -1:]
    assert np.abs(after_keep - direct).max() < 1e-4


def test_capacity_grows_without_changing_results(tiny_pairs):
    e = engine(tiny_pairs["self"])
    e.reset(1)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 256, (1, 200))
    logits = e.forward(ids, np.arange(200)[None])          # crosses the initial 128-slot capacity
    assert e.cache.capacity >= 200
    e.reset(1)
    chunks = [e.forward(ids[:, i:i + 50], np.arange(i, i + 50)[None]) for i in range(0, 200, 50)]
    assert np.abs(np.concatenate(chunks, 1) - logits).max() < 1e-4


def test_one_token_steps_cross_the_capacity_and_fill_the_context(tiny_pairs):
    """A graph attending a one-token step twice writes one slot past the step: one-token steps from below the
    first 128-slot capacity up to the last position of the context still compute the prefill's logits."""
    e = engine(tiny_pairs["self"])
    assert e.attends_twice
    limit = e.spec.max_context
    ids = np.random.default_rng(2).integers(3, 256, (1, limit))
    e.reset(1)
    full = e.forward(ids, np.arange(limit)[None])
    e.reset(1)
    e.forward(ids[:, :120], np.arange(120)[None])
    steps = [e.forward(ids[:, i:i + 1], np.array([[i]])) for i in range(120, limit)]
    assert int(e.lengths[0]) == limit
    assert np.abs(np.concatenate(steps, 1) - full[:, 120:]).max() < 1e-4


def test_context_overflow_is_a_clear_error(tiny_pairs):
    import pytest
    from ssd_trt.errors import RequestError
    e = engine(tiny_pairs["self"])
    e.reset(1)
    with pytest.raises(RequestError, match="max context 256"):
        e.forward(np.zeros((1, 300), dtype=np.int64), np.arange(300)[None])
