"""What the exported ``model.py`` delegates to: request parsing, the engine step's loop, streamed responses.

Triton's Python backend calls ``execute`` on one thread per model instance. ``execute`` validates each request
and adds it to the instance's :class:`~ssd_trt.batching.engine.LLMEngine`; one loop thread runs the engine's
steps while any request is unfinished, so requests from every client share rounds (continuous batching: a
request joins at the next round and leaves when it finishes), greedy and sampled, in any mode. The loop hands
each step's new tokens to a sender thread, which streams them to their requests (the final response carries the
request's statistics), aborts the requests whose client cancelled, and exports the engine's totals as Triton
custom metrics (``pb_utils.MetricFamily``): acceptance rate, mean accepted length, cache hit rate, active batch
size, requests running and waiting, requests aborted.

``pb_utils`` (``triton_python_backend_utils``) exists only inside the backend's stub process, so it is
passed in rather than imported here.
"""
from __future__ import annotations

import json
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ssd_trt.batching.engine import LLMEngine, RequestOutput
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.settings import ResolvedMode, Settings, parse_mode
from ssd_trt.detokenize import Detokenizer
from ssd_trt.engines.affinity import pin
from ssd_trt.errors import RequestError, SsdTrtError
from ssd_trt.runtime import DEFAULT_MODE, MODES, Generator, RuntimeOptions

OPTIONAL_INPUTS = ("temperature", "top_p", "top_k", "random_seed", "stream", "mode", "chat", "ignore_eos", "draft_len",
                   "fan_out_budget", "backup")
WARMUP_PROMPT = "Hello"
CANCEL_POLL_S = 0.1     # how often the sender thread asks the server which requests their clients cancelled


@dataclass
class Job:
    """One validated request, in the engine."""
    prompt_ids: list[int]
    params: SamplingParams
    mode: ResolvedMode              # resolved once, when the request was checked
    stream: bool
    sender: Any                     # the request's InferenceResponseSender
    received: float = field(default_factory=time.perf_counter)
    gone: bool = False              # a send failed (client went away): send nothing more
    detokenizer: Detokenizer | None = None


def _one_value(request, pb_utils, name: str, required: bool = False):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        if required:
            raise RequestError(f"input '{name}' is required")
        return None
    array = tensor.as_numpy()
    if array.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one value (shape [1] or [1, 1]); got shape "
                           f"{list(array.shape)}")
    return array.reshape(-1)[0]


def _text(value, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"input '{name}' is not valid UTF-8 ({exc})") from None
    return str(value)


def _stop_words(request, pb_utils) -> tuple[str, ...]:
    """The optional ``stop_words`` input: any number of UTF-8 stop strings."""
    tensor = pb_utils.get_input_tensor_by_name(request, "stop_words")
    if tensor is None:
        return ()
    return tuple(_text(value, "stop_words") for value in tensor.as_numpy().reshape(-1))


def _tree_widths(request, pb_utils) -> tuple[int, ...] | None:
    """The optional ``tree_widths`` input: children per depth of an SD token tree (checked by ``SD``)."""
    tensor = pb_utils.get_input_tensor_by_name(request, "tree_widths")
    return None if tensor is None else tuple(int(w) for w in tensor.as_numpy().reshape(-1))


def request_settings(values: dict[str, Any], tree_widths: tuple[int, ...] | None) -> Settings:
    """The request's mode and the decoding options it set (``values``: the optional inputs, None where absent)."""
    mode = DEFAULT_MODE if values["mode"] is None else _text(values["mode"], "mode").strip().lower()
    return parse_mode(
        mode, lambda name: f"input '{name}'",
        draft_len=None if values["draft_len"] is None else int(values["draft_len"]),
        fan_out_budget=None if values["fan_out_budget"] is None else int(values["fan_out_budget"]),
        backup=None if values["backup"] is None else _text(values["backup"], "backup").strip().lower(),
        tree_widths=tree_widths)


def parse_request(request, pb_utils, generator: Generator, streaming_model: bool) -> Job:
    """Validate one request completely (so that a batch never fails because of one bad member)."""
    prompt = _text(_one_value(request, pb_utils, "text_input", required=True), "text_input")
    max_tokens = int(_one_value(request, pb_utils, "max_tokens", required=True))
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}")
    values = {name: _one_value(request, pb_utils, name) for name in OPTIONAL_INPUTS}
    mode = request_settings(values, _tree_widths(request, pb_utils))
    stream = bool(values["stream"]) if values["stream"] is not None else False
    if stream and not streaming_model:
        raise RequestError("stream=true needs the decoupled (streaming) model; this is the non-streaming "
                           "twin. Send the request to the model without the '_nonstream' suffix over gRPC "
                           "streaming, or set stream=false")
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=0.0 if values["temperature"] is None else float(values["temperature"]),
        top_p=1.0 if values["top_p"] is None else float(values["top_p"]),
        top_k=0 if values["top_k"] is None else int(values["top_k"]),
        seed=None if values["random_seed"] is None else int(values["random_seed"]),
        stop_on_eos=not bool(values["ignore_eos"]), stop=_stop_words(request, pb_utils))
    ids = generator.encode(prompt, chat=bool(values["chat"]) if values["chat"] is not None else False)
    [ids], resolved = generator.check_request([ids], params, mode)     # the runtime's one request check
    return Job(ids, params, resolved, stream, request.get_response_sender())


def request_stats(stats: dict[str, Any], row_tokens: int) -> dict[str, float | int]:
    """The per-request numbers returned as output tensors (NaN where not applicable, e.g. mode ar)."""
    mean, rounds = stats.get("mean_accepted"), stats.get("rounds") or 0
    nan = float("nan")
    return {"generated_tokens": row_tokens,
            "accepted_tokens": int(round(mean * rounds)) if mean is not None else 0,
            "acceptance_rate": nan if stats.get("acceptance_rate") is None else float(stats["acceptance_rate"]),
            "cache_hit_rate": nan if stats.get("cache_hit_rate") is None else float(stats["cache_hit_rate"])}


class StepLoop:
    """One thread that runs the engine's steps while any request is unfinished, and sleeps otherwise."""

    def __init__(self, llm: LLMEngine, on_outputs: Callable[[list[RequestOutput]], None],
                 on_error: Callable[[BaseException], None], cores: tuple[int, ...] | None) -> None:
        self.llm, self.on_outputs, self.on_error, self.cores = llm, on_outputs, on_error, cores
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="ssd-trt-step", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def close(self, timeout: float = 30.0) -> None:
        """Finish the requests in the engine, then stop."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        pin(self.cores)                          # this thread is the target's device
        while True:
            self._wake.wait()
            self._wake.clear()
            while self.llm.has_unfinished():
                try:
                    outputs = self.llm.step()
                except Exception as exc:  # noqa: BLE001 -- every request must still get a final response
                    self.on_error(exc)
                    continue
                self.on_outputs(outputs)
            if self._stopping:
                return


METRICS = {   # name: (description, what of EngineMetrics it reports, gauge or counter)
    "ssd_trt_acceptance_rate": ("accepted / drafted tokens over every speculative round so far", "acceptance_rate",
                                "gauge"),
    "ssd_trt_mean_accepted_length": ("drafted tokens accepted per speculative round (the bonus token not counted)",
                                     "mean_accepted", "gauge"),
    "ssd_trt_cache_hit_rate": ("SSD speculation-cache hits per lookup", "cache_hit_rate", "gauge"),
    "ssd_trt_active_batch": ("requests decoded together in the last round", "active_batch", "gauge"),
    "ssd_trt_running_requests": ("requests being decoded (admitted, not finished)", "running", "gauge"),
    "ssd_trt_waiting_requests": ("requests waiting for a free slot", "waiting", "gauge"),
    "ssd_trt_aborted_requests_total": ("requests stopped before their end (their client cancelled or went away)",
                                       "aborted", "counter"),
}
METRICS_EVERY_S = 0.5   # each update is a message to the server per metric: at most this often


class TritonMetrics:
    """The engine's totals as Triton metrics (``pb_utils.MetricFamily``): gauges set, counters incremented by
    what the engine's total grew since the last update."""

    def __init__(self, pb_utils, model: str) -> None:
        family = getattr(pb_utils, "MetricFamily", None)
        self.metrics: dict = {}
        self.exported: dict[str, float] = {}
        if family is None:                    # a stub without custom metrics: nothing to export
            return
        self.families = {name: family(name=name, description=description,
                                      kind=family.COUNTER if kind == "counter" else family.GAUGE)
                         for name, (description, _, kind) in METRICS.items()}
        self.metrics = {name: f.Metric(labels={"model": model}) for name, f in self.families.items()}

    def update(self, metrics) -> None:
        """Export what changed since the last update."""
        for name, (_, attribute, kind) in METRICS.items():
            if name not in self.metrics:
                continue
            value = getattr(metrics, attribute)
            value = float("nan") if value is None else float(value)
            last = self.exported.get(name)
            if last is not None and (value == last or (value != value and last != last)):
                continue
            if kind == "counter":
                self.metrics[name].increment(value - (last or 0.0))
            else:
                self.metrics[name].set(value)
            self.exported[name] = value


class ModelServer:
    """The state of one model instance: the loaded :class:`Generator`, its engine step and the step loop."""

    def __init__(self, generator: Generator, pb_utils, streaming_model: bool, max_running: int,
                 log: Callable[[str], None], model_name: str = "ssd_trt") -> None:
        self.generator = generator
        self.pb = pb_utils
        self.streaming_model = streaming_model
        self.log = log
        self.llm = LLMEngine(generator, max_running=max_running, calibrate=True)
        self.triton_metrics = TritonMetrics(pb_utils, model_name)
        self.jobs: dict[str, Job] = {}
        self._ids = 0
        self._lock = threading.Lock()
        self._outbox: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="ssd-trt-send", daemon=True)
        self._sender.start()
        self.loop = StepLoop(self.llm, self._deliver, self.fail_all, generator.options.step_cores)

    @classmethod
    def from_config(cls, model_config: dict, pb_utils) -> "ModelServer":
        params = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
        logger = getattr(pb_utils, "Logger", None)
        log = logger.log_info if logger is not None else print
        options = {k: tuple(v) if isinstance(v, list) else v
                   for k, v in json.loads(params.get("runtime_options") or "{}").items()}
        artifact_dir = Path(params["artifact_dir"])
        started = time.perf_counter()
        generator = Generator(artifact_dir, RuntimeOptions(**options),
                              verify_checksums=params.get("verify_checksums", "true").lower() == "true")
        if params.get("warmup", "true").lower() == "true":
            ids = generator.encode(WARMUP_PROMPT)
            for mode in MODES:
                generator.generate_ids([ids], SamplingParams(max_new_tokens=2), mode=mode)
        max_running = int(params.get("max_batch_rows") or 0) or generator.limits.max_batch
        max_running = min(max_running, generator.limits.max_batch)
        streaming = pb_utils.using_decoupled_model_transaction_policy(model_config)
        server = cls(generator, pb_utils, streaming, max_running, log, model_config.get("name", "ssd_trt"))
        log(f"ssd_trt: loaded {artifact_dir} in {time.perf_counter() - started:.1f}s "
            f"(streaming={streaming}, continuous batching up to {max_running} requests)")
        return server

    # -- Triton entry points -------------------------------------------------------------------
    def execute(self, requests) -> None:
        for request in requests:
            try:
                job = parse_request(request, self.pb, self.generator, self.streaming_model)
                if job.stream:
                    hold = max((len(text) for text in job.params.stop), default=1) - 1
                    job.detokenizer = Detokenizer.of(self.generator.tokenizer, hold)
                with self._lock:
                    self._ids += 1
                    request_id = str(self._ids)
                    self.jobs[request_id] = job
                try:
                    self.llm.add_request(job.prompt_ids, job.params, job.mode, request_id=request_id)
                except BaseException:
                    with self._lock:
                        self.jobs.pop(request_id, None)
                    raise
            except (SsdTrtError, ValueError, TypeError, OverflowError) as exc:
                self._fail(request.get_response_sender(), exc)
                continue
        self.loop.wake()
        return None

    def close(self) -> None:
        self.loop.close()
        self.llm.close()
        self._outbox.put(None)
        self._sender.join(30.0)

    # -- the loop's callbacks (the step thread) -------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand each request's new tokens (and the finished ones' results) to the sender thread: everything that
        talks to the server -- detokenizing, building and sending responses, asking whether a client cancelled --
        happens there, so none of it delays the next round."""
        for output in outputs:
            with self._lock:
                job = self.jobs.get(output.request_id)
                if job is not None and output.finished:
                    del self.jobs[output.request_id]
            if job is None:
                continue
            if output.finished:
                self._outbox.put((job, "final", (output.new_tokens, self.llm.take_result(output.request_id))))
            elif job.stream and output.new_tokens:
                self._outbox.put((job, "chunk", output.new_tokens))

    # -- responses (the sender thread) --------------------------------------------------------------
    def _error(self, exc: BaseException, code: str | None = None):
        """An error response: INVALID_ARG for bad requests, INTERNAL otherwise (or ``code``)."""
        code = code or ("INVALID_ARG" if isinstance(exc, (RequestError, ValueError)) else "INTERNAL")
        message = str(exc) if isinstance(exc, SsdTrtError) else f"{type(exc).__name__}: {exc}"
        value = getattr(self.pb.TritonError, code, None)
        error = self.pb.TritonError(message, value) if value is not None else self.pb.TritonError(message)
        return self.pb.InferenceResponse(output_tensors=[], error=error)

    def _fail(self, sender, exc: BaseException) -> None:
        sender.send(self._error(exc), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _send_loop(self) -> None:
        """Deliver what the step loop queued, in each request's order; abort the requests whose client cancelled
        (or went away), checked every ``CANCEL_POLL_S`` (asking the server is a round trip between processes, too
        slow to make for every request in every round); export the engine's metrics every ``METRICS_EVERY_S``.

        What queued up while the last responses were being sent goes out as one response per request (its
        chunks joined): under load a stream gets fewer, larger chunks instead of falling behind the engine."""
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
            stop = None in items
            by_job: dict[int, tuple[Job, list]] = {}
            for item in items:
                if item is not None:
                    by_job.setdefault(id(item[0]), (item[0], []))[1].append(item[1:])
            for job, entries in by_job.values():
                try:
                    self._send_entries(job, entries)
                except Exception as exc:  # noqa: BLE001 -- one request's failure must not stop the others' delivery
                    self.log(f"ssd_trt: a response could not be made: {traceback.format_exc()}")
                    self._send_now(job, self._error(exc), final=True)
                    job.gone = True
            if stop:
                return
            now = time.perf_counter()
            if now - polled >= CANCEL_POLL_S:
                polled = now
                self._abort_cancelled()
            if now - exported >= METRICS_EVERY_S:
                exported = now
                self.triton_metrics.update(self.llm.metrics)

    def _send_entries(self, job: Job, entries: list[tuple[str, Any]]) -> None:
        """One response for a request's queued entries: its chunks' tokens joined, the final response (or
        error) last; nothing for a request whose client is gone."""
        tokens: list[int] = []
        for kind, payload in entries:
            if job.gone:
                return
            if kind == "chunk":
                tokens += payload
            elif kind == "error":
                self._send_now(job, self._error(payload), final=True)
                return
            else:
                new_tokens, seq = payload
                self.triton_metrics.update(self.llm.metrics)    # a client that got its answer reads metrics that count it
                self._send_now(job, self._final_response(job, tokens + new_tokens, seq), final=True)
                return
        if tokens:
            self._send_now(job, self._response(job.detokenizer.push(tokens), tokens))

    def _final_response(self, job: Job, new_tokens: list[int], seq):
        if seq.finish_reason == "abort":
            return self._error(RequestError("request cancelled by the client"), "CANCELLED")
        text = seq.text(lambda t: self.generator.tokenizer.decode(t, skip_special_tokens=True))
        stats = request_stats(seq.stats.summary(), len(seq.tokens))
        if job.stream:       # the last tokens' text, up to the end of the final (possibly cut) text
            return self._response(job.detokenizer.finish(text), new_tokens, stats)
        return self._response(text, seq.tokens, stats)

    def _send_now(self, job: Job, response, final: bool = False) -> None:
        """A failure (e.g. a cancelled request) marks the request gone and never disturbs the others."""
        try:
            job.sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
        except Exception as exc:  # noqa: BLE001
            job.gone = True
            self.log(f"ssd_trt: dropping a request whose response could not be sent ({exc})")

    def _abort_cancelled(self) -> None:
        with self._lock:
            live = list(self.jobs.items())
        for request_id, job in live:
            cancelled = getattr(job.sender, "is_cancelled", None)
            if job.gone or (cancelled is not None and cancelled()):
                job.gone = True
                self.llm.abort(request_id)

    def _response(self, text: str, token_ids: list[int], stats: dict | None = None):
        tensors = [self.pb.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
                   self.pb.Tensor("output_ids", np.array([token_ids], dtype=np.int32).reshape(1, -1))]
        if stats is not None:
            tensors += [self.pb.Tensor("generated_tokens", np.array([[stats["generated_tokens"]]], np.int32)),
                        self.pb.Tensor("accepted_tokens", np.array([[stats["accepted_tokens"]]], np.int32)),
                        self.pb.Tensor("acceptance_rate", np.array([[stats["acceptance_rate"]]], np.float32)),
                        self.pb.Tensor("cache_hit_rate", np.array([[stats["cache_hit_rate"]]], np.float32))]
        return self.pb.InferenceResponse(output_tensors=tensors)

    def fail_all(self, exc: BaseException) -> None:
        """The engine step failed: every request in it gets an error response (the engines stay usable)."""
        if not isinstance(exc, SsdTrtError):
            self.log(f"ssd_trt: generation failed: {traceback.format_exc()}")
        with self._lock:
            jobs, self.jobs = self.jobs, {}
        for request_id, job in jobs.items():
            self.llm.abort(request_id)
            self._outbox.put((job, "error", exc))
