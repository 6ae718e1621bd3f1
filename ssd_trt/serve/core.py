"""The serving loop every frontend shares: requests into the engine step, their tokens and text out to the clients.

A frontend (Triton's Python backend, the OpenAI HTTP server) turns its protocol into a :class:`Submission` (checked
by :meth:`ServingCore.check`, the runtime's one request check) and hands it to :meth:`ServingCore.submit` with a
:class:`Handle`: the frontend's way of answering that one client. From there this module does the rest, once for
every frontend:

* one step thread (:class:`StepLoop`) runs the engine's steps (``batching/engine.py``: continuous batching) while any
  request is unfinished; it only hands each step's new tokens over, and times their arrival for the latency metrics,
  so it goes on computing meanwhile;
* one sender thread detokenizes (holding back the beginning of a stop string, ``detokenize.py``), answers through each
  request's handle (chunks, then the final result with the usage and the request's speculation statistics, or an
  error), asks the handles every ``CANCEL_POLL_S`` whether their client cancelled or went away and aborts those
  requests (their rows are freed at the next step), and runs the frontend's metric exporters;
* the metrics (``serve/metrics.py``): the engine step's totals and the loop's own (tokens, finished requests, time to
  first token, inter-token and end-to-end latency).

A send that fails (the client is gone) marks the request gone: nothing more is sent to it and it is aborted; the
other requests never notice. A step that raises (or whose outputs cannot be handed over) fails the requests in the
engine with an error (the engines stay usable); a queue that is full refuses the request at :meth:`ServingCore.submit`
(``CapacityError``).

The engine forgets every request it was given: a finished request's result is taken when it is delivered, and the
results of failed or aborted requests (whose answer was already an error) are taken too, when their abort shows up
in a later step's outputs or, after a failed step, at once (``_take_results``). Should the step thread itself die,
every pending request gets an error, the scheduler is emptied, and :meth:`ServingCore.health` says so (a frontend's
health probe fails, so an orchestrator restarts the server); it says so too when the loop has requests and made no
progress for ``stall_after_s``.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ssd_trt.batching.engine import LLMEngine, RequestOutput
from ssd_trt.batching.scheduler import CapacityError
from ssd_trt.decoding.logprobs import TokenLogprob
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.sequence import SequenceState
from ssd_trt.decoding.settings import DEFAULT_MODE, ResolvedMode, Settings
from ssd_trt.detokenize import Detokenizer
from ssd_trt.engines.affinity import pin
from ssd_trt.errors import RequestError, SsdTrtError
from ssd_trt.runtime import MODES, Generator
from ssd_trt.serve.metrics import FINISHED_REASON, Family, ServingMetrics
from ssd_trt.serve.metrics import families as metric_families

WARMUP_PROMPT = "Hello"
CANCEL_POLL_S = 0.1     # how often the sender thread asks the handles whether their client cancelled
METRICS_EVERY_S = 0.5   # how often the sender thread runs the frontends' metric exporters
STALL_AFTER_S = 120.0   # a loop with requests and no finished step for this long is reported stalled (one step of a
                        # long prefill on a slow CPU takes seconds; minutes means it is wedged)


class RequestCancelled(RequestError):
    """The request was aborted because its client cancelled it or went away."""


class ServingStopped(SsdTrtError):
    """The serving loop cannot take or finish requests: it is shutting down, or its step thread died."""


@dataclass(frozen=True)
class Submission:
    """One request, checked against the build: what the engine step needs, and whether the client streams."""
    prompt_ids: list[int]
    params: SamplingParams
    mode: ResolvedMode              # resolved once, when the request was checked
    stream: bool


@dataclass
class Final:
    """How a request ended. Streamed, ``text`` and ``token_ids`` are what was not sent in chunks yet (the chunks and
    these concatenate to the whole); otherwise the whole text and every token."""
    text: str
    token_ids: list[int]
    finish_reason: str              # the engine's: eos | stop | length
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any]           # request_stats
    logprobs: list[TokenLogprob] | None = None          # of ``token_ids``, when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None   # of the prompt's tokens but the first, when asked for


class Handle(Protocol):
    """A frontend's answer channel for one request; called on the sender thread only. A method that raises marks
    the request gone (the client went away): it is aborted and nothing more is sent."""

    def chunk(self, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None = None) -> None: ...

    def final(self, result: Final) -> None: ...

    def error(self, exc: BaseException) -> None: ...

    def cancelled(self) -> bool: ...


@dataclass
class Job:
    """A submitted request, until it is answered."""
    request_id: str
    submission: Submission
    handle: Handle
    detokenizer: Detokenizer | None
    received: float = field(default_factory=time.perf_counter)   # its arrival (before tokenizing), for TTFT
    last_tokens_at: float | None = None       # the step thread's clock when its latest tokens arrived
    gone: bool = False                        # the client is gone (a send failed, the HTTP side left): send nothing
    cancelled: bool = False                   # the client cancelled (Triton): no more chunks, a CANCELLED final
    aborting: bool = False                    # the engine was asked to abort it


def request_stats(seq: SequenceState) -> dict[str, Any]:
    """One request's own speculation numbers (None where they do not apply, e.g. mode ar or nothing drafted)."""
    summary = seq.stats.summary()
    return {"mode": seq.resolved.name, "generated_tokens": len(seq.tokens), "accepted_tokens": seq.stats.accepted,
            "speculative_rounds": seq.stats.rounds, "acceptance_rate": summary["acceptance_rate"],
            "cache_hit_rate": summary["cache_hit_rate"]}


def warm_up(generator: Generator) -> None:
    """A 2-token request per mode: the engines' first runs (allocations, graph optimizations) happen before a
    client waits on them."""
    ids = generator.encode(WARMUP_PROMPT)
    for mode in MODES:
        generator.generate_ids([ids], SamplingParams(max_new_tokens=2), mode=mode)


class StepLoop:
    """One thread that runs the engine's steps while any request is unfinished, and sleeps otherwise.

    A step that raises, or whose outputs cannot be handed over, goes to ``on_error`` and the loop goes on. Anything
    else that ends the thread (``on_error`` itself raising, a BaseException) is kept in :attr:`died` and handed to
    ``on_death`` as the thread ends, so that no request waits on a loop that is gone."""

    def __init__(self, llm: LLMEngine, on_outputs: Callable[[list[RequestOutput]], None],
                 on_error: Callable[[BaseException], None], on_death: Callable[[BaseException], None],
                 cores: tuple[int, ...] | None) -> None:
        self.llm, self.on_outputs, self.on_error, self.on_death, self.cores = llm, on_outputs, on_error, on_death, cores
        self.died: BaseException | None = None
        self.progressed = time.monotonic()       # when the loop last finished a step or woke up to work
        self._idle = True
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="ssd-trt-step", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        if self._idle:                           # work starts now: an idle loop is not a stalled one
            self.progressed = time.monotonic()
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self.died is None and self._thread.is_alive()

    def stalled_for(self) -> float:
        """Seconds since the loop last made progress while it has requests (0 while it has none)."""
        if self._idle and not self.llm.has_unfinished():
            return 0.0
        return time.monotonic() - self.progressed

    def close(self, timeout: float = 30.0) -> bool:
        """Finish the requests in the engine, then stop; whether the thread ended within ``timeout``."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        try:
            pin(self.cores)                      # this thread is the target's device
            while True:
                self._idle = True
                self._wake.wait()
                self._wake.clear()
                self._idle, self.progressed = False, time.monotonic()
                while self.llm.has_unfinished():
                    try:
                        self.on_outputs(self.llm.step())
                    except Exception as exc:  # noqa: BLE001 -- every request must still get an answer
                        self.on_error(exc)
                    self.progressed = time.monotonic()
                if self._stopping:
                    return
        except BaseException as exc:  # noqa: BLE001 -- the thread ends: say why, and answer everyone
            self.died = exc
            self.on_death(exc)


# what serves instead of the engine step (a test's fault injector wraps it): frontends pass it through by this name
EngineWrapper = Callable[[LLMEngine], LLMEngine]


class ServingCore:
    """The engine step over a loaded build, with its step thread, its sender thread and its metrics."""

    def __init__(self, generator: Generator, max_running: int, log: Callable[[str], None] = print,
                 max_waiting: int = 1024, calibrate: bool = True, stall_after_s: float = STALL_AFTER_S,
                 wrap_engine: EngineWrapper | None = None, default_mode: str = DEFAULT_MODE) -> None:
        """``stall_after_s``: see :meth:`health`. ``wrap_engine``: what serves instead of the engine step (a test's
        fault injector around it). ``default_mode``: the mode of a request that names none."""
        if default_mode not in MODES:
            raise ValueError(f"default_mode must be one of {', '.join(MODES)}, got {default_mode!r}")
        self.default_mode = default_mode
        self.generator = generator
        self.log = log
        self.max_running = max_running
        self.llm = LLMEngine(generator, max_running=max_running, max_waiting=max_waiting, calibrate=calibrate)
        if wrap_engine is not None:
            self.llm = wrap_engine(self.llm)
        self.stall_after_s = stall_after_s
        self.metrics = ServingMetrics()
        self.exporters: list[Callable[[], None]] = []    # run on the sender thread: periodically, before each final
        self.jobs: dict[str, Job] = {}
        self.stopping: str | None = None                  # why new requests are refused (shutting down)
        self._untaken: set[str] = set()                   # ids in the engine whose result was not taken yet
        self._ids = 0
        self._lock = threading.Lock()
        self._outbox: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="ssd-trt-send", daemon=True)
        self._sender.start()
        self.loop = StepLoop(self.llm, self._deliver, self.fail_all, self._loop_died, generator.options.step_cores)

    def decode(self, token_ids: list[int]) -> str:
        return self.generator.tokenizer.decode(token_ids, skip_special_tokens=True)

    # -- requests (any thread) -----------------------------------------------------------------------------------
    def check(self, prompt_ids: list[int], params: SamplingParams, settings: Settings | str, stream: bool
              ) -> Submission:
        """The runtime's one request check (prompt within the context, K and tree within the engine's limits):
        a RequestError names what is wrong."""
        [ids], resolved = self.generator.check_request([prompt_ids], params, settings)
        return Submission(ids, params, resolved, stream)

    def submit(self, submission: Submission, handle: Handle, arrived: float | None = None) -> str:
        """Queue a checked request; its answers go to ``handle``. ``arrived``: when the request arrived
        (``time.perf_counter()``, before it was tokenized: time to first token counts from there; default now).
        Raises CapacityError when the queue is full, ServingStopped when the loop takes no more requests."""
        refusal = self.refusal()
        if refusal is not None:
            raise ServingStopped(refusal)
        hold = max((len(text) for text in submission.params.stop), default=1) - 1
        detokenizer = Detokenizer(self.decode, hold) if submission.stream else None
        with self._lock:
            self._ids += 1
            request_id = str(self._ids)
            self.jobs[request_id] = Job(request_id, submission, handle, detokenizer)
            if arrived is not None:
                self.jobs[request_id].received = arrived
            self._untaken.add(request_id)
        try:
            self.llm.add_request(submission.prompt_ids, submission.params, submission.mode, request_id=request_id)
        except BaseException:
            with self._lock:
                self.jobs.pop(request_id, None)
                self._untaken.discard(request_id)
            raise
        with self._lock:
            self.metrics.prompt_tokens += len(submission.prompt_ids)
            failed = request_id not in self.jobs      # a failed step answered it while it was being added
        if failed:
            self.llm.abort(request_id)
        self.loop.wake()
        if not self.loop.alive:                        # died meanwhile: _loop_died may have missed it
            self._fail_jobs(ServingStopped(self.refusal() or "the serving loop stopped"))
        return request_id

    def count_refusal(self, exc: BaseException) -> None:
        """Count a request refused before it was queued (``request_rejected_total``): a full queue
        (CapacityError) or a bad request (RequestError and the like). A stopping or dead loop refuses every request
        (ServingStopped): not the request's doing, /health reports it, so it is not counted here."""
        if isinstance(exc, CapacityError):
            reason = "queue_full"
        elif isinstance(exc, (RequestError, ValueError, TypeError, OverflowError)):
            reason = "bad_request"
        else:
            return
        self.count_rejected(reason)

    def count_rejected(self, reason: str) -> None:
        """One more request refused for ``reason`` (``serve/metrics.py``'s REJECTED_REASONS)."""
        with self._lock:
            self.metrics.rejected[reason] += 1

    def refusal(self) -> str | None:
        """Why no request is taken now (None: they are)."""
        if self.loop.died is not None:
            return f"the serving loop died ({type(self.loop.died).__name__}: {self.loop.died}); the server must be " \
                   f"restarted"
        return self.stopping

    def health(self) -> dict[str, Any]:
        """``status``: ok | dead (the step thread died) | stalled (requests, and no step finished for
        ``stall_after_s``) | stopping (shutting down); what the loop holds; ``detail`` where not ok."""
        stalled = self.loop.stalled_for()
        with self._lock:
            held = {"pending": len(self.jobs), "untaken": len(self._untaken)}
        if not self.loop.alive or not self._sender.is_alive():
            status, detail = "dead", self.refusal() or "a serving thread ended"
        elif stalled > self.stall_after_s:
            status, detail = "stalled", f"no engine step finished for {stalled:.0f}s while requests wait"
        elif self.stopping is not None:
            status, detail = "stopping", self.stopping
        else:
            status, detail = "ok", None
        return {"status": status, **({"detail": detail} if detail else {}), **held}

    def abort(self, request_id: str) -> None:
        """The client went away: send it nothing more; its rows are freed at the next step."""
        with self._lock:
            job = self.jobs.get(request_id)
        if job is not None:
            job.gone = job.aborting = True
            self.llm.abort(request_id)

    def families(self) -> list[Family]:
        """The metrics, read now (``serve/metrics.py``)."""
        return metric_families(self.llm.metrics, self.metrics)

    def drain(self, grace_s: float, reason: str = "the server is shutting down") -> bool:
        """Refuse new requests, let the pending ones finish for up to ``grace_s`` seconds, then end the rest with an
        error (``ServingStopped``: a streamed client gets it as its last event). Whether every request finished."""
        self.stopping = reason
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self.jobs:
                    return True
            time.sleep(0.05)
        self._fail_jobs(ServingStopped(f"{reason}; the request did not finish within the {grace_s:g}s grace period"))
        return False

    def close(self, timeout: float = 30.0) -> None:
        """Stop: every request still pending is ended with an error; the step thread stops before the engine
        closes (an engine closed under a running step would fail it in any way); the sender stops last."""
        self.stopping = self.stopping or "the server is shutting down"
        self._fail_jobs(ServingStopped(self.stopping))
        if self.loop.close(timeout):
            self.llm.close()
        else:
            self.log(f"ssd_trt: the step thread did not stop within {timeout:g}s; the engine is left open")
        self._outbox.put(None)
        self._sender.join(timeout)

    # -- the step thread -----------------------------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Time each request's new tokens, hand them (and the finished ones' results) to the sender thread:
        everything that talks to clients happens there, so none of it delays the next round."""
        now = time.perf_counter()
        for output in outputs:
            with self._lock:
                job = self.jobs.get(output.request_id)
                if job is not None and output.finished:
                    del self.jobs[output.request_id]
                if job is None and output.finished:       # already answered (an error): the engine forgets it
                    self._take(output.request_id)
            if job is None:
                continue
            if output.new_tokens:
                if job.last_tokens_at is None:
                    self.metrics.ttft.observe(now - job.received)
                else:
                    self.metrics.itl.observe(now - job.last_tokens_at)
                job.last_tokens_at = now
            if output.finished:
                self.metrics.e2e.observe(now - job.received)
                self.metrics.finished[FINISHED_REASON.get(output.finish_reason, "error")] += 1
                with self._lock:
                    seq = self._take(output.request_id)
                self._outbox.put((job, "final", (output.new_tokens, seq)))
            elif job.submission.stream and output.new_tokens:
                self._outbox.put((job, "chunk", (output.new_tokens, output.new_logprobs)))

    def fail_all(self, exc: BaseException) -> None:
        """The engine step failed (on the step thread): every request in it gets an error (the engines stay usable),
        and the engine forgets them: the results of those that finished in the failed step (their outputs were
        lost) are taken now, the others are aborted and taken when the abort is reported."""
        if not isinstance(exc, SsdTrtError):
            self.log(f"ssd_trt: generation failed: {traceback.format_exc()}")
        self._fail_jobs(exc)
        self._take_results()

    def _fail_jobs(self, exc: BaseException) -> None:
        """Every pending request gets ``exc`` as its answer and is aborted (any thread)."""
        with self._lock:
            jobs, self.jobs = self.jobs, {}
        for request_id, job in jobs.items():
            job.aborting = True
            self.llm.abort(request_id)
            self.metrics.finished["error"] += 1
            self._outbox.put((job, "error", exc))

    def _take(self, request_id: str) -> SequenceState | None:
        """A finished request's result, out of the engine (under the lock); None if it was taken already."""
        self._untaken.discard(request_id)
        try:
            return self.llm.take_result(request_id)
        except KeyError:
            return None

    def _take_results(self) -> None:
        """Take every finished result no pending request waits for (the step thread: no step runs meanwhile)."""
        with self._lock:
            for request_id in [r for r in self._untaken if r not in self.jobs]:
                try:
                    self.llm.take_result(request_id)
                except KeyError:          # not finished yet: its abort is reported by a later step
                    continue
                self._untaken.discard(request_id)

    def _loop_died(self, exc: BaseException) -> None:
        """The step thread is ending (on it): every pending request gets an error, and the engine forgets all it
        held (no step will run again to finish or abort it)."""
        self.log(f"ssd_trt: the serving loop died: {''.join(traceback.format_exception(exc))}")
        self._fail_jobs(ServingStopped(self.refusal() or "the serving loop died"))
        with self._lock:
            untaken = list(self._untaken)
        for request_id in untaken:
            self.llm.abort(request_id)
        try:            # one last step applies the aborts: with no request left running it runs no model
            self.llm.step()
        except BaseException:  # noqa: BLE001 -- the engine may be what failed; the results are taken regardless
            self.log(f"ssd_trt: the last step after the loop died failed: {traceback.format_exc()}")
        self._take_results()

    # -- the sender thread ---------------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        """Deliver what the step loop queued, in each request's order; abort the requests whose client cancelled
        (checked every ``CANCEL_POLL_S``: asking Triton is a round trip between processes, too slow to make for every
        request in every round); run the exporters every ``METRICS_EVERY_S``.

        What queued up while the last answers were being sent goes out as one chunk per request: under load a
        stream gets fewer, larger chunks instead of falling behind the engine."""
        polled = exported = time.perf_counter()
        while True:
            try:
                items = [self._outbox.get(timeout=CANCEL_POLL_S)]
            except queue.Empty:
                items = []
            while True:
                try:
                    items.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            by_job: dict[int, tuple[Job, list]] = {}
            for item in items:
                if item is not None:
                    by_job.setdefault(id(item[0]), (item[0], []))[1].append(item[1:])
            for job, entries in by_job.values():
                try:
                    self._send_entries(job, entries)
                except Exception as exc:  # noqa: BLE001 -- one request's failure must not stop the others' delivery
                    self.log(f"ssd_trt: an answer could not be made: {traceback.format_exc()}")
                    self._send(job, job.handle.error, exc)
                    job.gone = True
            if None in items:
                return
            now = time.perf_counter()
            if now - polled >= CANCEL_POLL_S:
                polled = now
                self._abort_cancelled()
            if now - exported >= METRICS_EVERY_S:
                exported = now
                self._export()

    def _send_entries(self, job: Job, entries: list[tuple[str, Any]]) -> None:
        """One chunk for a request's queued tokens, its final answer (or error) last; nothing once it is gone."""
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        for kind, payload in entries:
            if job.gone:
                return
            if kind == "chunk":
                tokens += payload[0]
                logprobs += payload[1]
            elif kind == "error":
                self._send(job, job.handle.error, payload)
                return
            else:
                new_tokens, seq = payload
                if seq.finish_reason == "abort":
                    self._send(job, job.handle.error, RequestCancelled("request cancelled by the client"))
                    return
                self._export()           # a client that got its answer reads metrics that count it
                self._send(job, job.handle.final, self._final(job, tokens + new_tokens, seq))
                return
        if tokens and not job.cancelled:
            wanted = job.submission.params.logprobs is not None
            self._send(job, job.handle.chunk, job.detokenizer.push(tokens), tokens, logprobs if wanted else None)

    def _final(self, job: Job, unsent: list[int], seq: SequenceState) -> Final:
        text = seq.text(self.decode)
        if job.submission.stream:        # the last tokens' text, up to the end of the final (possibly cut) text
            text, ids = job.detokenizer.finish(text), unsent
        else:
            ids = seq.tokens
        params = job.submission.params
        return Final(text, ids, seq.finish_reason, len(job.submission.prompt_ids), len(seq.tokens),
                     request_stats(seq),
                     None if params.logprobs is None else seq.logprobs[len(seq.logprobs) - len(ids):],
                     None if params.prompt_logprobs is None else seq.prompt_logprobs)

    def _send(self, job: Job, method: Callable, *args: Any) -> None:
        """A failure (the client went away) marks the request gone and never disturbs the others."""
        try:
            method(*args)
        except Exception as exc:  # noqa: BLE001
            job.gone = True
            self.log(f"ssd_trt: dropping a request whose answer could not be sent ({type(exc).__name__}: {exc})")

    def _abort_cancelled(self) -> None:
        """Abort the requests whose client is gone or cancelled. A cancelled one still gets its final answer (an
        error saying so): Triton holds a decoupled request open until its final response, unloading included."""
        with self._lock:
            live = list(self.jobs.items())
        for request_id, job in live:
            if job.aborting:
                continue
            if not job.gone:
                try:
                    job.cancelled = job.handle.cancelled()
                except Exception:  # noqa: BLE001 -- a handle that cannot tell has lost its client
                    job.gone = True
            if job.gone or job.cancelled:
                job.aborting = True
                self.llm.abort(request_id)

    def _export(self) -> None:
        for exporter in self.exporters:
            try:
                exporter()
            except Exception:  # noqa: BLE001 -- metrics never stop the answers
                self.log(f"ssd_trt: exporting metrics failed: {traceback.format_exc()}")
