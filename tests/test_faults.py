"""Faults: a draft that crashes, hangs or talks garbage never changes SSD output; a target that fails
fails the request with its reason; a cancelled stream frees its KV slots.

Faults are injected by :class:`FaultyEngine`, which delegates to a real engine (ONNX Runtime on a tiny
random-weight build, or the exact trigram model) and misbehaves from its ``at``-th forward call on.
"""
from __future__ import annotations

import copy

import threading
import time

import numpy as np
import pytest

import ssd_trt
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.settings import AR, SD, SSD
from ssd_trt.engines.base import EngineDefaults
from ssd_trt.errors import Cancelled, EngineError
from ssd_trt.runtime import RuntimeOptions

PROMPTS = [[1, 5, 9, 33, 7], [1, 100, 3], [1, 42, 42, 42, 42, 8, 19], [1, 250]]
GREEDY = SamplingParams(max_new_tokens=24, stop_on_eos=False)
K = 3
AT_K = {"ar": AR(), "sd": SD(draft_len=K), "ssd": SSD(draft_len=K)}   # every mode at the K these tests use
SD_K, SSD_K = AT_K["sd"], AT_K["ssd"]


class InjectedFault(RuntimeError):
    pass


class FaultyEngine(EngineDefaults):
    """A real engine that misbehaves from forward call number ``at`` (0-based) on (``once``: only then).

    crash: raises | hang: sleeps ``hang_s`` then answers | garbage: random logits | nan: NaN logits |
    wide: logits over a larger vocabulary (token ids the target does not have) | short: one position
    fewer than asked | reset: crashes in reset (the worker's first job).
    """

    def __init__(self, inner, fault: str, at: int = 0, once: bool = False, hang_s: float = 1.0,
                 seed: int = 0) -> None:
        self.inner, self.fault, self.at, self.once, self.hang_s = inner, fault, at, once, hang_s
        self.counter = [0]                   # shared with row views: one count of forward calls
        self.rng = np.random.default_rng(seed)

    @property
    def calls(self) -> int:
        return self.counter[0]

    @property
    def spec(self):
        return self.inner.spec

    @property
    def takes_target_features(self) -> bool:
        return self.inner.takes_target_features

    def receive_target_features(self, row, first, features) -> None:
        self.inner.receive_target_features(row, first, features)

    @property
    def lengths(self) -> np.ndarray:
        return self.inner.lengths

    def reset(self, batch: int) -> None:
        if self.fault == "reset":
            raise InjectedFault("injected fault in reset")
        self.inner.reset(batch)

    def select_rows(self, order) -> None:
        if self.fault == "reset":          # the engine step's counterpart of reset: its first draft job
            raise InjectedFault("injected fault in select_rows")
        self.inner.select_rows(order)

    def rows(self, start: int, stop: int) -> "FaultyEngine":
        view = copy.copy(self)             # same fault, same call count, over the inner engine's rows
        view.inner = self.inner.rows(start, stop)
        return view

    def forward(self, input_ids, position_ids, tree_mask=None, logit_indices=None) -> np.ndarray:
        call = self.counter[0]
        self.counter[0] += 1
        if call < self.at or (self.once and call > self.at) or self.fault == "reset":
            return self.inner.forward(input_ids, position_ids, tree_mask, logit_indices)
        if self.fault == "crash":
            raise InjectedFault(f"injected crash at forward call {call}")
        if self.fault == "hang":
            time.sleep(self.hang_s)
        logits = self.inner.forward(input_ids, position_ids, tree_mask, logit_indices)
        if self.fault == "garbage":
            return (self.rng.standard_normal(logits.shape) * 10).astype(np.float32)
        if self.fault == "nan":
            return np.full_like(logits, np.nan)
        if self.fault == "wide":
            extra = np.full(logits.shape[:-1] + (64,), 1e4, dtype=np.float32)
            return np.concatenate([logits, extra], axis=-1)
        if self.fault == "short":
            return logits[:, :-1]
        return logits

    def rollback(self, lengths) -> None:
        self.inner.rollback(lengths)

    def keep(self, row, start, offsets) -> None:
        self.inner.keep(row, start, offsets)


@pytest.fixture(scope="module")
def gen(tiny_pairs):
    """A generator on the perturbed pair (partial acceptance: hits, misses and backups all happen)."""
    return ssd_trt.load(tiny_pairs["perturbed"], RuntimeOptions(draft_timeout_s=0.3))


@pytest.fixture(scope="module")
def reference(gen):
    return [r.token_ids for r in gen.generate_ids(PROMPTS, GREEDY, mode="ar")]


@pytest.fixture
def inject(gen):
    """Swap one role's engine for a faulty wrapper for the duration of a test."""
    real = {role: gen.engine(role) for role in ("target", "draft")}

    def swap(role: str, fault: str, **kwargs) -> FaultyEngine:
        gen.engines.opened[role] = FaultyEngine(real[role], fault, **kwargs)
        return gen.engines.opened[role]
    yield swap
    # A hung draft call can outlive its request: the runtime retires that (wrapped) engine, but the real
    # engine inside is handed back below, and the abandoned worker thread would still feed and roll it
    # back when its sleep ends -- in the middle of a later test. Let such threads finish first.
    for thread in threading.enumerate():
        if thread.name.startswith("ssd-draft"):
            thread.join(timeout=30)
    gen.engines.opened.update(real)


def slots_held(engine) -> int:
    try:
        return int(engine.lengths.sum())
    except AttributeError:           # never reset: no cache at all
        return 0


def assert_no_slots_held(gen) -> None:
    for role, engine in gen.engines.opened.items():
        assert slots_held(engine) == 0, f"{role} engine still holds KV slots {engine.lengths.tolist()}"


# -- draft faults in SSD mode: output identical to AR, the failure recorded ---------------------------
# Forward calls of the draft: 0..K-1 the first just-in-time speculation (prefix + bonus, then K-1
# steps; K-1 gives its last, unfed draw), K the first glue decode, K+1..2K its tree steps (2K the last,
# unfed), later rounds after that.
JIT_LAST, TREE_LAST = K - 1, 2 * K
DRAFT_FAULTS = [("reset", 0), ("crash", 0), ("crash", 2), ("crash", K + 1), ("crash", K + 3), ("crash", 40),
                ("hang", 0), ("hang", K + 2), ("short", 0), ("short", K + 1), ("wide", 0), ("wide", K + 1)]


@pytest.mark.parametrize("fault,at", DRAFT_FAULTS)
def test_failing_draft_gives_autoregressive_output_and_is_logged(gen, reference, inject, fault, at):
    draft = inject("draft", fault, at=at, once=fault == "hang")
    results = gen.generate_ids(PROMPTS, GREEDY, mode=SSD_K)
    assert [r.token_ids for r in results] == reference
    stats = results[0].stats
    assert stats["fallback"] == "autoregressive (draft failed)"
    assert len(stats["draft_failures"]) == 1
    expected = {"reset": "InjectedFault", "crash": "InjectedFault", "hang": "TimeoutError"}.get(fault, "Error")
    assert expected in stats["draft_failures"][0]
    assert draft.calls >= min(at, 1)
    assert_no_slots_held(gen)


@pytest.mark.parametrize("fault", ["garbage", "nan"])
def test_draft_talking_garbage_cannot_change_greedy_output(gen, reference, inject, fault):
    inject("draft", fault, at=K + 1)
    results = gen.generate_ids(PROMPTS, GREEDY, mode=SSD_K)
    assert [r.token_ids for r in results] == reference
    assert_no_slots_held(gen)


def test_draft_proposing_token_ids_outside_the_vocabulary_is_refused_in_tree_rounds(gen, reference, inject):
    inject("draft", "wide", at=TREE_LAST, once=True)   # only the last tree step's (unfed) draws
    # misses use prompt lookup, never the draft
    results = gen.generate_ids(PROMPTS, GREEDY, mode=SSD(draft_len=K, backup="ngram"))
    assert [r.token_ids for r in results] == reference
    assert "malformed cache entry" in results[0].stats["draft_failures"][0]


def test_draft_proposing_token_ids_outside_the_vocabulary_in_a_jit_speculation_falls_back(gen, reference,
                                                                                           inject):
    inject("draft", "wide", at=JIT_LAST, once=True)    # only the last (unfed) draw of the first jit
    results = gen.generate_ids(PROMPTS, GREEDY, mode=SSD_K)
    assert [r.token_ids for r in results] == reference
    assert results[0].stats["draft_failures"]


def test_a_hung_draft_times_out_within_the_deadline(gen, reference, inject):
    inject("draft", "hang", at=K + 1, once=True, hang_s=1.0)
    started = time.perf_counter()
    results = gen.generate_ids(PROMPTS, GREEDY, mode=SSD_K)
    assert [r.token_ids for r in results] == reference
    assert "TimeoutError" in results[0].stats["draft_failures"][0]
    assert time.perf_counter() - started < 1.0 + 3.0      # timeout 0.3 s + the hung call + AR tail


def test_a_draft_hung_for_long_does_not_hold_the_request(gen, reference, inject):
    inject("draft", "hang", at=K + 1, once=True, hang_s=4.0)
    started = time.perf_counter()
    results = gen.generate_ids(PROMPTS, GREEDY, mode=SSD_K)
    elapsed = time.perf_counter() - started
    assert [r.token_ids for r in results] == reference
    assert elapsed < 3.0, f"request took {elapsed:.1f} s with draft_timeout_s 0.3"


@pytest.mark.parametrize("mode", [SD_K, SD(tree_widths=(2, 2, 1))], ids=["chain", "tree"])
@pytest.mark.parametrize("fault,at,message", [("crash", 2, "InjectedFault: injected crash"),
                                              ("wide", 2, "ValueError"), ("short", 1, "Error")])
def test_draft_failure_in_plain_speculative_mode_finishes_the_request_exactly(gen, reference, inject, mode, fault,
                                                                              at, message):
    """SD, too, finishes without the draft (the engine step runs its rows as AR rounds from then on), whether the
    draft raises or proposes tokens the target does not have (``wide`` at the chain's and the tree's last,
    unfed draws: refused before the target sees them)."""
    inject("draft", fault, at=at, once=fault == "wide")
    results = gen.generate_ids(PROMPTS, GREEDY, mode=mode)
    assert [r.token_ids for r in results] == reference
    assert results[0].stats["fallback"] == "autoregressive (draft failed)"
    assert message in results[0].stats["draft_failures"][0]
    assert_no_slots_held(gen)


# -- target faults: the request fails with the reason; the next request is unharmed ------------------
@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
@pytest.mark.parametrize("at", [0, 3])
def test_target_failure_fails_the_request_with_its_reason(gen, reference, inject, mode, at):
    inject("target", "crash", at=at)
    with pytest.raises(EngineError, match=f"{mode} generation failed: InjectedFault: injected crash at "
                                          f"forward call {at}"):
        gen.generate_ids(PROMPTS, GREEDY, mode=AT_K[mode])
    assert_no_slots_held(gen)
    gen.engines.opened["target"] = gen.engines.opened["target"].inner
    assert [r.token_ids for r in gen.generate_ids(PROMPTS, GREEDY, mode=AT_K[mode])] == reference


def test_the_draft_worker_thread_ends_with_the_request(gen, inject):
    """The draft lane's worker ("ssd-draft*") is gone once the request whose draft failed has ended; other threads
    of the process (a client library's, a previous test's daemon) are not this test's business."""
    inject("draft", "crash", at=K + 1)
    before = {t for t in threading.enumerate() if t.name.startswith("ssd-draft")}
    gen.generate_ids(PROMPTS, GREEDY, mode=SSD_K)
    started = [t for t in threading.enumerate() if t.name.startswith("ssd-draft") and t not in before]
    for thread in started:
        thread.join(timeout=10)
    assert not [t.name for t in started if t.is_alive()], "a draft worker outlived its request"


# -- cancellation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_cancelling_a_stream_returns_what_was_streamed_and_frees_the_slots(gen, reference, mode):
    streamed: list[list[int]] = [[] for _ in PROMPTS]

    def on_tokens(row: int, tokens: list[int]) -> None:
        streamed[row] += tokens
        if sum(map(len, streamed)) >= 10:
            raise Cancelled

    results = gen.generate_ids(PROMPTS, GREEDY, mode=AT_K[mode], on_tokens=on_tokens)
    assert [r.token_ids for r in results] == streamed
    assert all(r.stats["cancelled"] for r in results)
    assert 10 <= sum(map(len, streamed)) < sum(map(len, reference))
    for row, tokens in enumerate(streamed):
        assert tokens == reference[row][:len(tokens)]           # a prefix of the full answer
    assert_no_slots_held(gen)
    assert [r.token_ids for r in gen.generate_ids(PROMPTS, GREEDY, mode=AT_K[mode])] == reference


def test_a_failing_callback_raises_its_own_exception(gen):
    def on_tokens(row, tokens):
        raise KeyError("client went away")

    with pytest.raises(KeyError, match="client went away"):
        gen.generate_ids(PROMPTS, GREEDY, mode=SSD_K, on_tokens=on_tokens)
    assert_no_slots_held(gen)


# -- sampling: a draft failing mid-request keeps the output distribution exact ------------------------
def test_sampling_stays_lossless_when_the_draft_fails_mid_request():
    from tests.test_sampling_lossless import DRAFT, assert_lossless
    from tests.trigram import TrigramEngine

    # every request's draft fails at its fifth step (its first speculation; a fresh draft for each request)
    stats = assert_lossless(SSD(draft_len=2, fan_out_budget=4, backup="jit"), 1.0,
                            draft=lambda: FaultyEngine(TrigramEngine(DRAFT, name="draft"), "crash", at=4))
    assert all(s["draft_failures"] for s in stats)


def test_fallback_matches_autoregressive_on_the_exact_model():
    from tests.trigram import TrigramEngine, trigram_generator, random_log_table

    table = random_log_table(7, seed=3)
    params = SamplingParams(max_new_tokens=12, stop_on_eos=False)
    prompts = [[0, 1], [2, 3, 4], [5]]
    reference = [r.token_ids for r in trigram_generator(table).generate_ids(prompts, params, mode="ar")]
    for at in range(0, 12, 2):
        gen = trigram_generator(table, lambda: FaultyEngine(TrigramEngine(random_log_table(7, seed=4)), "crash", at=at))
        results = gen.generate_ids(prompts, params, mode=SSD(draft_len=2, fan_out_budget=4))
        assert [r.token_ids for r in results] == reference, at
        assert results[0].stats["draft_failures"], at
