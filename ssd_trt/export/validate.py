"""Validate an ORT-flavour step graph against the torch model with Polygraphy (CPU).

Polygraphy's own torch runner moves models to CUDA, so a small CPU runner feeds the same inputs to
the eager :class:`Decoder`. Each check is one (batch, new tokens) shape with a partly filled cache,
ragged lengths and a random tree mask, so prefill, decode and tree steps are all covered.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from ssd_trt_plugins.tree_attention.masks import pack_tree_mask
from ssd_trt.engines.base import GRAPH_OUTPUT_LOGITS
from ssd_trt.export.onnx_export import cache_names, io_names
from ssd_trt.models.config import DecoderConfig
from ssd_trt.models.decoder import Decoder

ATOL, RTOL = 1e-2, 1e-3   # fp32 logits of a 30-layer model differ ~1e-4 relative by summation order


def sample_feeds(c: DecoderConfig, batch: int, num_new: int, seed: int, capacity: int | None = None,
                 cache_dtype=np.float32) -> OrderedDict:
    """One step's inputs for a model of config ``c``; ``capacity`` fixes the caches' length (a graph with a
    static capacity)."""
    rng = np.random.default_rng(seed)
    capacity = capacity or 16 + num_new
    # every row keeps one slot free past its step: the scratch slot engines keep beyond max_context (the fused
    # graph writes a one-token step's copy there)
    lengths = rng.integers(0, capacity - num_new, size=batch).astype(np.int32)
    mask = np.tril(rng.random((batch, num_new, num_new)) < 0.6) | np.eye(num_new, dtype=bool)
    # logits for a random, ragged choice of the new tokens (every token when there is only one)
    picked = np.sort(rng.permuted(np.tile(np.arange(num_new), (batch, 1)), axis=1)[:, :max(1, num_new // 2)], axis=1)
    feeds = OrderedDict(input_ids=rng.integers(0, c.vocab_size, (batch, num_new)).astype(np.int64),
                        position_ids=(lengths[:, None] + np.arange(num_new)[None]).astype(np.int64),
                        tree_mask=pack_tree_mask(mask), cache_lengths=lengths, logit_indices=picked.astype(np.int64))
    for name in cache_names(c.num_layers)[0]:
        feeds[name] = rng.standard_normal((batch, c.num_kv_heads, capacity, c.head_dim)).astype(cache_dtype)
    return feeds


def _runner_base(example: OrderedDict):
    """A Polygraphy runner class fed ``example``'s inputs (names and dtypes, any shape); subclasses infer."""
    from polygraphy.backend.base import BaseRunner
    from polygraphy.common import TensorMetadata

    class FeedRunner(BaseRunner):
        def activate_impl(self) -> None:
            pass

        def deactivate_impl(self) -> None:
            pass

        def get_input_metadata_impl(self):
            metadata = TensorMetadata()
            for name, value in example.items():
                metadata.add(name, value.dtype, [None] * value.ndim)
            return metadata

    return FeedRunner


def _torch_runner(model: Decoder, example: OrderedDict):
    class TorchCpuRunner(_runner_base(example)):
        """Eager torch on CPU (Polygraphy's PytorchRunner calls .cuda())."""

        def __init__(self) -> None:
            super().__init__(name="torch-cpu")
            self.output_names = io_names(model.config.num_layers)[1]

        def infer_impl(self, feed_dict):
            start = time.perf_counter()
            with torch.no_grad():
                tensors = {n: torch.from_numpy(np.ascontiguousarray(feed_dict[n]))
                           for n in io_names(model.config.num_layers)[0]}
                # half-precision caches (a TensorRT-flavour graph) reach the fp32 model as the same values
                tensors = {n: t.float() if t.is_floating_point() else t for n, t in tensors.items()}
                caches = [tensors[n] for n in cache_names(model.config.num_layers)[0]]
                outputs = model(tensors["input_ids"], tensors["position_ids"], tensors["tree_mask"],
                                tensors["cache_lengths"], *caches, logit_indices=tensors["logit_indices"])
            self.inference_time = time.perf_counter() - start
            return OrderedDict((name, out.numpy()) for name, out in zip(self.output_names, outputs))

    return TorchCpuRunner()


def _ort_in_place_runner(session, example: OrderedDict):
    """ONNX Runtime run as the engine runs the ``ort`` flavour (engines/ort.py): each present_* cache bound
    to its past_* buffer, written in place. The fused graph (export/fused_graph.py) updates only the new
    slots of a shared buffer, so run any other way its present_* would not be the whole cache."""
    import onnxruntime as ort

    class OrtInPlaceRunner(_runner_base(example)):
        def __init__(self) -> None:
            super().__init__(name="onnxrt-in-place")

        def infer_impl(self, feed_dict):
            binding, caches = session.io_binding(), {}
            binding.bind_output(GRAPH_OUTPUT_LOGITS)      # first bound: get_outputs()[0]
            held = {name: np.ascontiguousarray(value) for name, value in feed_dict.items()}   # alive until the run
            for name, value in held.items():
                if name.startswith("past_"):
                    # a copy (the feeds stay intact) that the run writes and the outputs return
                    caches[name.replace("past_", "present_", 1)] = cache = np.array(value)
                    bound = ort.OrtValue.ortvalue_from_numpy(cache)
                    binding.bind_ortvalue_input(name, bound)
                    binding.bind_ortvalue_output(name.replace("past_", "present_", 1), bound)
                else:
                    binding.bind_cpu_input(name, value)
            start = time.perf_counter()
            session.run_with_iobinding(binding)
            self.inference_time = time.perf_counter() - start
            return OrderedDict([(GRAPH_OUTPUT_LOGITS, np.array(binding.get_outputs()[0].numpy())), *caches.items()])

    return OrtInPlaceRunner()


def validate_with_polygraphy(model: Decoder, onnx_path: Path, shapes: list[tuple[int, int]],
                             threads: int = 2, capacity: int | None = None, cache_dtype=np.float32,
                             atol: float = ATOL, in_place: bool = False) -> dict:
    """Run torch and ONNX Runtime on the same inputs; return per-output max errors and a verdict.
    ``in_place``: run ONNX Runtime with each cache written in place, as the ORT engine runs its graph.

    The graph is checked with fp32 activations in ONNX Runtime's fused 4/8-bit MatMuls (accuracy level 1):
    what is validated is the graph (its weights and ops). Int8 activations (level 4) are a runtime kernel
    choice, an approximation whose effect is measured on real prompts (docs/weights.md)."""
    import onnxruntime as ort
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.comparator import Comparator

    from polygraphy.logger import G_LOGGER
    G_LOGGER.module_severity = G_LOGGER.ERROR
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3     # errors only: TensorScatter notes each copy of a cache it cannot alias on CPU
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    feeds = [sample_feeds(model.config, batch, num_new, seed, capacity, cache_dtype)
             for seed, (batch, num_new) in enumerate(shapes)]
    runners = [_torch_runner(model, feeds[0]),
               _ort_in_place_runner(session, feeds[0]) if in_place else OnnxrtRunner(lambda: session)]
    results = Comparator.run(runners, data_loader=feeds)
    (_, torch_runs), (_, ort_runs) = results[0], results[1]
    max_abs, worst_scaled, same_infinities, masked = 0.0, 0.0, True, 0
    for torch_out, ort_out, feed in zip(torch_runs, ort_runs, feeds):
        for name in list(torch_out.keys()):
            expected, got = torch_out[name], ort_out[name].astype(np.float32)
            if name.startswith("present"):
                got = _scratch_slots_as_expected(got, expected, feed)
            ort_out[name] = got
            # A reduced draft head gives -inf logits (q = 0) off its token subset. Those must match exactly
            # (checked here); Polygraphy then compares the finite values only (inf - inf would be NaN).
            finite = np.isfinite(expected)
            same_infinities &= bool(np.array_equal(expected[~finite], got[~finite]))
            if finite.any():
                error = float(np.abs(expected[finite] - got[finite]).max())
                max_abs = max(max_abs, error)
                # the error relative to the output's own scale (for half-precision graphs)
                worst_scaled = max(worst_scaled, error / max(float(np.abs(expected[finite]).max()), 1e-30))
            if not finite.all():
                masked += int((~finite).sum())
                torch_out[name], ort_out[name] = np.where(finite, expected, 0), np.where(finite, got, 0)
    verdict = Comparator.compare_accuracy(results, compare_func=_compare_func(atol))
    return {"tool": "polygraphy", "shapes": [list(s) for s in shapes], "atol": atol, "rtol": RTOL,
            **({"caches": "written in place, as the engine runs the graph"} if in_place else {}),
            "max_abs_error": max_abs, "max_scaled_error": worst_scaled, "non_finite_compared_exactly": masked,
            "passed": bool(verdict) and same_infinities}


def _scratch_slots_as_expected(got: np.ndarray, expected: np.ndarray, feed) -> np.ndarray:
    """A present cache [B, H, S, D] with the slots from each row's end (L_b + T) on taken from ``expected``:
    those slots are scratch the engine never reads (the fused graph writes a one-token step's copy there)."""
    ends = np.asarray(feed["cache_lengths"]).astype(np.int64) + np.asarray(feed["input_ids"]).shape[1]
    scratch = np.arange(got.shape[2])[None, :] >= ends[:, None]          # [B, S]
    return np.where(scratch[:, None, :, None], expected, got)


def _compare_func(atol: float):
    from polygraphy import comparator
    if hasattr(comparator, "SimpleCompareFunc"):
        return comparator.SimpleCompareFunc(atol=atol, rtol=RTOL, infinities_compare_equal=True)
    return comparator.CompareFunc.simple(atol=atol, rtol=RTOL, infinities_compare_equal=True)


def validate_eagle3_graph(model, onnx_path: Path, shapes: list[tuple[int, int]], capacity: int | None = None,
                          atol: float = ATOL) -> dict:
    """A feature draft's step graph (``onnx_export.trace_eagle3_step_graph``) against its torch module: random
    steps of each (batch, new tokens) shape over a filled cache, every token carrying a random target feature or
    a random draft hidden; logits (finite ones; the -inf off the draft vocabulary compared exactly), the cache
    and the output hidden. ``capacity`` fixes the caches' length (a graph with a static capacity)."""
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")   # the graph, as above
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    c = model.config.layer
    max_abs, same_infinities = 0.0, True
    past, present = cache_names(c.num_layers)
    for seed, (batch, num_new) in enumerate(shapes):
        feeds = dict(sample_feeds(c, batch, num_new, seed, capacity))
        rng = np.random.default_rng(1000 + seed)
        feeds.update(features=rng.standard_normal((batch, num_new, 3 * c.hidden_size)).astype(np.float32),
                     draft_hidden=rng.standard_normal((batch, num_new, c.hidden_size)).astype(np.float32),
                     from_target=rng.random((batch, num_new)) < 0.5)
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        with torch.no_grad():
            t = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in feeds.items()}
            logits, hidden, *caches = model(t["input_ids"], t["position_ids"], t["tree_mask"], t["cache_lengths"],
                                            t["features"], t["draft_hidden"], t["from_target"],
                                            *[t[name] for name in past], logit_indices=t["logit_indices"])
        for name, want in (("logits", logits), *zip(present, caches), ("hidden", hidden)):
            want = want.numpy()
            finite = np.isfinite(want)
            same_infinities &= bool(np.array_equal(want[~finite], got[name][~finite]))
            max_abs = max(max_abs, float(np.abs(want[finite] - got[name][finite]).max()))
    return {"tool": "onnxruntime vs torch (eagle3 step graph)", "shapes": [list(s) for s in shapes], "atol": atol,
            "max_abs_error": max_abs, "passed": bool(max_abs <= atol and same_infinities)}
