"""The serving loop under faults: steps that raise, a step thread that dies or wedges, slow readers, shutdown; and
incremental detokenizing. In process over the real embedded pair (``ServingCore`` over a real ``LLMEngine`` wrapped
in the test-only fault injector, ``tests/fault_injection.py``), and tokens of the build's real tokenizer."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

import ssd_trt
from ssd_trt.detokenize import Detokenizer
from ssd_trt.serve.core import Final, ServingCore, ServingStopped
from tests.fault_injection import FaultInjector, nothing_held

TEXTS = ["Hello, world! Ünïcödé façade — naïve café", "数学是科学的语言。東京タワー", "emoji 🎉🚀👩‍👩‍👧 and 𝔘𝔫𝔦",
         "def f(x):\n    return x ** 2  # ½ ≤ ∞", "Ελληνικά κείμενα, русский текст, עברית"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_build):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_build / "tokenizer")


@pytest.mark.parametrize("hold", [0, 3])
def test_incremental_detokenizing_equals_a_full_decode_and_decodes_each_token_a_bounded_number_of_times(
        tokenizer, hold):
    decoded = [0]

    def decode(ids: list[int]) -> str:
        decoded[0] += len(ids)
        return tokenizer.decode(ids, skip_special_tokens=True)
    rng = random.Random(0)
    for text in TEXTS:
        ids = tokenizer.encode(text * 8, add_special_tokens=False)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        for sizes in ([1] * len(ids), [rng.randint(1, 6) for _ in ids]):
            detok, pieces, at, decoded[0] = Detokenizer(decode, hold), [], 0, 0
            for size in sizes:
                if at >= len(ids):
                    break
                pieces.append(detok.push(ids[at:at + size]))
                at += size
                assert "\ufffd" not in pieces[-1] or "\ufffd" in full
                assert full.startswith("".join(pieces))          # never text that a later token changes
            pieces.append(detok.finish(full))
            assert "".join(pieces) == full
            assert decoded[0] <= 8 * len(ids), "decoding grows with the stream: not incremental"


@pytest.fixture(scope="module")
def generator(smollm2_build):
    return ssd_trt.load(smollm2_build)


def serving(generator, fail_rate: float = 0.0, stall_after_s: float = 60.0) -> tuple[ServingCore, FaultInjector]:
    injectors: list[FaultInjector] = []

    def wrap(llm):
        injectors.append(FaultInjector(llm, fail_rate, seed=1))
        return injectors[0]
    core = ServingCore(generator, 4, log=lambda message: None, calibrate=False, stall_after_s=stall_after_s,
                       wrap_engine=wrap)
    return core, injectors[0]


def submit(core: ServingCore, prompt: str, max_tokens: int, stream: bool, mode: str = "ar"):
    handle = Answers()
    ids = core.generator.encode(prompt)
    core.submit(core.check(ids, ssd_trt.SamplingParams(max_new_tokens=max_tokens), mode, stream), handle)
    return handle


class Answers:
    """A handle that keeps what the loop answered: chunks, then one final result or one error."""

    def __init__(self) -> None:
        self.chunks: list[str] = []
        self.result: Final | None = None
        self.failure: BaseException | None = None
        self.done = threading.Event()

    def chunk(self, text: str, token_ids: list[int], logprobs=None) -> None:   # noqa: ARG002
        self.chunks.append(text)

    def final(self, result: Final) -> None:
        self.result = result
        self.done.set()

    def error(self, exc: BaseException) -> None:
        self.failure = exc
        self.done.set()

    def cancelled(self) -> bool:
        return False


def test_steps_that_raise_answer_every_request_and_leave_the_engine_holding_nothing(generator):
    core, injector = serving(generator, fail_rate=0.3)
    try:
        for wave in range(3):
            handles = [submit(core, f"Request {wave}.{i}:", 12, stream=i % 2 == 0, mode=("ar", "sd", "ssd")[i % 3])
                       for i in range(8)]
            assert all(h.done.wait(60) for h in handles), "a request was never answered"
            assert all((h.result is None) != (h.failure is None) for h in handles)
        assert injector.failures > 0
        assert nothing_held(injector) == dict.fromkeys(injector.held(), 0)
        assert core.health()["status"] == "ok" and not core.jobs
        ok = submit(core, "After the faults,", 8, stream=False)           # the engines stay usable
        injector.fail_rate = 0.0
        assert ok.done.wait(60) and (ok.result is not None or ok.failure is not None)
    finally:
        core.close()


def test_a_dead_step_thread_fails_every_pending_request_and_health_says_dead(generator):
    core, injector = serving(generator)
    try:
        injector.hang()                                       # the first step waits until the kill is armed
        handles = [submit(core, f"Doomed {i}", 64, stream=i % 2 == 0) for i in range(4)]
        injector.kill()
        injector.released.set()
        assert all(h.done.wait(30) for h in handles), "a request waits on a dead loop"
        assert all(isinstance(h.failure, ServingStopped) for h in handles)
        health = core.health()
        assert health["status"] == "dead" and "StepThreadKilled" in health["detail"]
        with pytest.raises(ServingStopped, match="restarted"):
            submit(core, "too late", 4, stream=False)
        assert nothing_held(injector) == dict.fromkeys(injector.held(), 0)
    finally:
        core.close(timeout=5)


def test_a_wedged_step_makes_health_stalled_and_an_idle_loop_is_healthy(generator):
    core, injector = serving(generator, stall_after_s=0.5)
    try:
        time.sleep(1.0)
        assert core.health()["status"] == "ok"                 # idle for longer than the threshold: fine
        injector.hang()
        handle = submit(core, "Wedged", 4, stream=False)
        time.sleep(1.0)
        assert core.health()["status"] == "stalled"
        injector.released.set()
        assert handle.done.wait(30) and handle.result is not None
        assert core.health()["status"] == "ok"
    finally:
        core.close()


def test_drain_lets_short_requests_finish_and_ends_long_ones_with_an_error(generator):
    core, injector = serving(generator)
    try:
        short = submit(core, "Short", 2, stream=True)
        long = submit(core, "Long", 1500, stream=True)     # seconds even on the CPU kernel engine (~400 tok/s)
        assert core.drain(grace_s=0.3) is False
        assert short.done.wait(10) and short.result is not None
        assert long.done.wait(10) and isinstance(long.failure, ServingStopped) and "grace" in str(long.failure)
        assert core.health()["status"] == "stopping"
        with pytest.raises(ServingStopped):
            submit(core, "refused", 2, stream=False)
        assert nothing_held(injector) == dict.fromkeys(injector.held(), 0)
    finally:
        core.close()


def test_a_stream_whose_reader_stops_reading_is_ended_with_an_error_not_buffered_forever():
    from ssd_trt.serve.openai.stream import Answers, SlowReader

    async def run(choices: int) -> tuple[int, list]:
        answers = Answers(asyncio.get_running_loop(), choices, max_pending=8)
        handles = [answers.handle(i) for i in range(choices)]
        failed = None
        for i in range(40):
            try:
                handles[i % choices].chunk("x", [i])
            except ConnectionError:
                failed = i
                break
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        items = [answers.queue.get_nowait() for _ in range(answers.queue.qsize())]
        with pytest.raises(ConnectionError):          # the request's other choices are ended too
            handles[0].final(None)
        return failed, items
    for choices in (1, 2):                          # the bound is per choice: 8 chunks each
        at, items = asyncio.run(run(choices))
        assert at == 8 * choices and len(items) == 8 * choices + 1
        kind, index, error = items[-1]
        assert kind == "error" and index == at % choices and isinstance(error, SlowReader)


def test_time_to_first_token_counts_from_the_requests_arrival_before_tokenizing(generator):
    core, _ = serving(generator)
    try:
        ids = core.generator.encode("Arrived long ago")
        handle = Answers()
        arrived = time.perf_counter() - 5.0               # as if tokenizing had taken 5 s
        core.submit(core.check(ids, ssd_trt.SamplingParams(max_new_tokens=2), "ar", False), handle, arrived)
        assert handle.done.wait(30) and handle.result is not None
        assert core.metrics.ttft.count == 1 and core.metrics.ttft.sum >= 5.0
        assert core.metrics.e2e.sum >= 5.0
    finally:
        core.close()
