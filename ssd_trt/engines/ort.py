"""ONNX Runtime engine (CPU execution provider) for the ORT-flavour step graph.

The KV cache lives in numpy buffers owned by :class:`KVCache`. Each step binds every past buffer as
both the input ``past_*`` and the output ``present_*`` (IOBinding over the same memory): ORT's
ScatterElements skips its input->output copy when the two are the same buffer, so a decode step
writes only its T new entries instead of re-copying the cache (measured in tests/test_ort_engine.py
and docs/weights.md: step time does not grow with unused capacity).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np

from ssd_trt_plugins.tree_attention.masks import causal_tree_mask, pack_tree_mask
from ssd_trt.engines.base import EAGLE3_INPUTS, EAGLE3_OUTPUT_HIDDEN, GRAPH_META_ONE_TOKEN_TWICE, \
    GRAPH_OUTPUT_FEATURES, GRAPH_OUTPUT_LOGITS, EngineDefaults, EngineSpec, all_indices, check_room, checked_rollback, \
    past_names, present_names
from ssd_trt.engines.kv_cache import KVCache
from ssd_trt.engines.rows import CacheRows, check_order


class OrtEngine(EngineDefaults):
    def __init__(self, onnx_path: Path, spec: EngineSpec, threads: int = 1,
                 cores: Sequence[int] | None = None, spin: bool = True, int8_activations: bool = False,
                 alone_threads: int = 1, alone_cores: Sequence[int] | None = None) -> None:
        """``spin=False`` stops idle intra-op threads from spin-waiting: needed when another session
        shares these cores (measured: SD with two 2-thread sessions on 2 cores, 27.7 -> 40.7 tok/s).
        ``alone_threads`` > ``threads``: two more sessions of the same graph, with that many threads on
        ``alone_cores``, run the steps taken inside :meth:`alone` (while the other model is idle) on the same KV
        buffers. Their logits are bit-identical (ONNX Runtime's CPU kernels split work across threads by rows and
        heads, never inside a dot product; tests/test_embedded_pair.py), and on two cores a one-token step of the
        embedded target costs 0.85x (batch 1) to 0.66x (batch 16) what it costs on one, a prefill 0.53-0.58x
        (research/cpu/measure_alone.py, docs/bench/target_alone.json). One of the two stops its threads spinning
        the moment a step is over (the other model's job follows, on a core they share: an SD round); the other
        lets them spin between steps, for stretches the other model sits out (AR rounds, paused SSD: a one-token
        step 5-10% faster than with the threads put to sleep after every step). The weights are held three
        times (the embedded target: +147 MB resident for the third).
        ``int8_activations``: block-quantized weights' fused MatMuls (MatMulNBits) quantize activations to
        int8 (accuracy level 4) instead of keeping them fp32 (level 1); no effect on a float graph.

        Row-exact steps: ONNX Runtime computes a one-token step's attention on another kernel than a step of
        two or more tokens, and the two disagree (logits by up to 0.53 at batch 1, 1.16 at batch 16, int8
        activations). The fused graph attends a one-token step as two queries itself (``export/fused_graph.py``,
        marked in its metadata) and writes one KV slot past the step. A graph without that mark (the traced
        form) with int8 activations is fed each one-token step with a second, discarded token here instead: the
        same effect, but the projections then compute two tokens per row (a 16-row one-token step: 51.2 ms
        against 35.1 ms in-graph, one core; research/cpu/measure_row_exact.py). Every int8 graph is now fed that
        way, marked or not: on an AVX2-only CPU MatMulNBits multiplies a one-row step on a kernel of its own,
        whose results differ from the same row's in a wider step. Either way a token's logits do not depend on
        the chain step that computed them (SD / SSD chains token-identical to AR), and the KV cache keeps one
        scratch slot beyond max_context."""
        import onnxruntime as ort
        self.spec = spec
        self.int8_activations = int8_activations
        self._ort = ort
        self.cores = tuple(cores) if cores else None
        options = _session_options(ort, threads, self.cores, spin, int8_activations)
        self.session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        self.alone_sessions: dict[bool, object] = {}       # spinning? -> the wider session
        if alone_threads > threads:
            for spinning in (False, True):
                wide = _session_options(ort, alone_threads, tuple(alone_cores) if alone_cores else None, spin,
                                        int8_activations)
                if not spinning:
                    wide.add_session_config_entry("session.force_spinning_stop", "1")
                self.alone_sessions[spinning] = ort.InferenceSession(str(onnx_path), wide,
                                                                     providers=["CPUExecutionProvider"])
        self._alone: bool | None = None                # inside alone(): whether its threads may spin
        self.attends_twice = GRAPH_META_ONE_TOKEN_TWICE in self.session.get_modelmeta().custom_metadata_map
        # MatMulNBits' int8 path computes a one-row product on another kernel than two or more rows where MLAS has a
        # GEMV for it (AVX2-only x86: logits apart by 0.6 from the same token in a 3-token step, while 2 and 3 rows
        # agree), so every one-token step of an int8 graph is fed as two tokens, whether or not its graph attends a
        # one-token step twice itself
        self.pad_single_rows = int8_activations
        # MatMulNBits' int8 path can give two identical rows of one step different results (a tree's siblings)
        self.exact_trees = not int8_activations
        scratch_slot = self.attends_twice or self.pad_single_rows
        self._cache_spec = replace(spec, max_context=spec.max_context + 1) if scratch_slot else spec
        # a target exported for a feature draft also returns its hidden states: kept per step, for the draft
        outputs = {output.name for output in self.session.get_outputs()}
        self.has_features = GRAPH_OUTPUT_FEATURES in outputs
        self.last_features: np.ndarray | None = None
        # a feature draft's graph (EAGLE-3) takes per-token inputs beyond the step graph's and returns its hidden
        self.extra_inputs = tuple(i.name for i in self.session.get_inputs() if i.name in EAGLE3_INPUTS)
        self.extra_widths = {i.name: i.shape[-1] for i in self.session.get_inputs()
                             if i.name in self.extra_inputs and isinstance(i.shape[-1], int) and len(i.shape) == 3}
        self.has_hidden = EAGLE3_OUTPUT_HIDDEN in outputs
        self.last_hidden: np.ndarray | None = None
        self.cache: KVCache | None = None
        self._bindings: dict = {}
        self.warm_up()

    def warm_up(self) -> None:
        """One tiny step per session so the first request does not pay ORT's first-run allocations (TTFT)."""
        for alone in (None, *self.alone_sessions):
            self.reset(1)
            with self.alone(alone) if alone is not None else nullcontext():
                self.forward(np.zeros((1, 2), dtype=np.int64), np.arange(2)[None], extra=self._zero_extra(1, 2))
        self.cache = None

    @contextmanager
    def alone(self, spin: bool = False) -> Iterator[None]:
        """Steps inside run on a wider session, when there is one (the caller vouches the other model is idle; with
        ``spin``, that it stays idle after them: the threads may spin on)."""
        previous, self._alone = self._alone, spin if self.alone_sessions else None
        try:
            yield
        finally:
            self._alone = previous

    def _active_session(self):
        """The session a step runs on now: a wider one inside :meth:`alone`."""
        return self.session if self._alone is None else self.alone_sessions[self._alone]

    def _zero_extra(self, batch: int, tokens: int) -> dict[str, np.ndarray] | None:
        """Placeholder extra inputs of a feature draft's graph (every token carrying zero target features)."""
        if not self.extra_inputs:
            return None
        widths = self.extra_widths
        return {"features": np.zeros((batch, tokens, widths["features"]), dtype=np.float32),
                "draft_hidden": np.zeros((batch, tokens, widths["draft_hidden"]), dtype=np.float32),
                "from_target": np.ones((batch, tokens), dtype=bool)}

    def reset(self, batch: int) -> None:
        self.cache = KVCache(self._cache_spec, batch)
        self._bindings = {}

    def select_rows(self, order: Sequence[int | None]) -> None:
        """Continuous batching (``engines/rows.py``): keep these rows, in this order (None: a new empty row)."""
        if self.cache is None:
            check_order(order, 0)
            self.reset(len(order))
        elif self.cache.select_rows(order):    # rows moved in place keep their bindings; new buffers do not
            self._bindings = {}

    def rows(self, start: int, stop: int) -> CacheRows:
        """Rows ``start .. stop-1`` alone: a step of the view computes those rows only, in place in the cache."""
        return CacheRows(self, start, stop)

    def _binding_for(self, start: int, stop: int):
        """The IO binding of rows ``start .. stop-1``: each past buffer's slice bound as its present too
        (written in place), made once per cache allocation, row range and session, so that a step rebinds only its small
        inputs and its logits (no per-step work that scales with layers)."""
        key = (start, stop, self._alone)
        if key not in self._bindings:
            ortvalue = self._ort.OrtValue.ortvalue_from_numpy
            values = [ortvalue(buffer[start:stop]) for buffer in self.cache.buffers]   # leading axis: contiguous
            binding = self._active_session().io_binding()
            for layer in range(self.spec.num_layers):
                for kind, (past, present) in enumerate(zip(past_names(layer), present_names(layer))):
                    binding.bind_ortvalue_input(past, values[2 * layer + kind])
                    binding.bind_ortvalue_output(present, values[2 * layer + kind])
            self._bindings[key] = (binding, values)
        return self._bindings[key][0]

    @property
    def lengths(self) -> np.ndarray:
        return self.cache.lengths.copy()

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray | None = None,
                logit_indices: np.ndarray | None = None,
                extra: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """``extra``: a feature draft's per-token inputs [B,T,...] (``EAGLE3_INPUTS``; engines/feature_draft.py)."""
        if input_ids.shape[0] != self.cache.batch:
            raise ValueError(f"{self.spec.name}: batch {input_ids.shape[0]} does not match the reset batch "
                             f"{self.cache.batch}")
        return self.forward_rows(0, self.cache.batch, input_ids, position_ids, tree_mask, logit_indices, extra)

    def forward_rows(self, start: int, stop: int, input_ids: np.ndarray, position_ids: np.ndarray,
                     tree_mask: np.ndarray | None = None, logit_indices: np.ndarray | None = None,
                     extra: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """:meth:`forward` for rows ``start .. stop-1`` of the batch only."""
        batch, num_new = input_ids.shape
        if set(extra or ()) != set(self.extra_inputs):
            raise ValueError(f"{self.spec.name}: the graph takes extra inputs {list(self.extra_inputs)}, got "
                             f"{sorted(extra or ())}")
        if batch != stop - start or not 0 <= start < stop <= self.cache.batch:
            raise ValueError(f"{self.spec.name}: {batch} rows fed to rows {start}..{stop - 1} of a batch of "
                             f"{self.cache.batch}")
        check_room(self.spec, int(self.cache.lengths[start:stop].max()), num_new)
        if not (self.pad_single_rows and num_new == 1):
            return self._step(start, stop, input_ids, position_ids, tree_mask, logit_indices, extra)
        # the discarded second row repeats the first (any valid token and position would do: no real
        # row attends to it) and its KV slot is rolled back at once
        logits = self._step(start, stop, np.repeat(input_ids, 2, axis=1), np.repeat(position_ids, 2, axis=1), None,
                            all_indices(batch, 1) if logit_indices is None else logit_indices,
                            None if extra is None else {k: np.repeat(v, 2, axis=1) for k, v in extra.items()})
        self.cache.lengths[start:stop] -= 1
        if self.last_features is not None:
            self.last_features = self.last_features[:, :1]
        if self.last_hidden is not None:
            self.last_hidden = self.last_hidden[:, :1]
        return logits

    def _step(self, start: int, stop: int, input_ids: np.ndarray, position_ids: np.ndarray,
              tree_mask: np.ndarray | None, logit_indices: np.ndarray | None,
              extra: Mapping[str, np.ndarray] | None) -> np.ndarray:
        cache = self.cache
        batch, num_new = input_ids.shape
        # a graph attending a one-token step twice writes the copy's key one slot past the step
        if cache.reserve(num_new + int(self.attends_twice and num_new == 1)):
            self._bindings = {}
        packed = causal_tree_mask(batch, num_new) if tree_mask is None else pack_tree_mask(tree_mask)
        indices = np.ascontiguousarray(all_indices(batch, num_new) if logit_indices is None else logit_indices,
                                       dtype=np.int64)
        binding = self._binding_for(start, stop)     # the caches are bound already
        # bind_cpu_input holds no reference: these arrays must live until the run is over
        inputs = {"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                  "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64), "tree_mask": packed,
                  "cache_lengths": np.ascontiguousarray(cache.lengths[start:stop]), "logit_indices": indices,
                  **{name: np.ascontiguousarray(value) for name, value in (extra or {}).items()}}
        for name, value in inputs.items():
            binding.bind_cpu_input(name, value)
        # a fresh array per step: the caller may keep the logits while the next step runs
        logits = np.empty((batch, indices.shape[1], self.spec.vocab_size), dtype=np.float32)
        binding.bind_output(GRAPH_OUTPUT_LOGITS, "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        extra_output = GRAPH_OUTPUT_FEATURES if self.has_features else EAGLE3_OUTPUT_HIDDEN if self.has_hidden else None
        if extra_output:
            binding.bind_output(extra_output)
        self._active_session().run_with_iobinding(binding)
        cache.lengths[start:stop] += num_new
        if extra_output:     # bound last, after the presents and the logits: the binding's last output
            value = binding.get_outputs()[-1].numpy()
            self.last_features = value if self.has_features else None
            self.last_hidden = value if self.has_hidden else None
        else:
            self.last_features = self.last_hidden = None
        return logits

    def rollback(self, lengths: np.ndarray) -> None:
        self.cache.rollback(lengths)

    def keep(self, row: int, start: int, offsets: Sequence[int]) -> None:
        self.cache.keep(row, start, offsets)


def _session_options(ort, threads: int, cores: tuple[int, ...] | None, spin: bool, int8_activations: bool):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "4" if int8_activations else "1")
    if cores and threads > 1:
        # threads 2..n of the intra-op pool; thread 1 is the caller, pinned by the runtime (affinity.pinned).
        options.add_session_config_entry("session.intra_op_thread_affinities",
                                         ";".join(str(cores[i % len(cores)] + 1)
                                                  for i in range(1, threads)))
    return options
