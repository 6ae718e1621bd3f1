"""What the exported ``model.py`` delegates to: request parsing, a generation worker, streamed responses.

Triton's Python backend calls ``execute`` on one thread per model instance. ``execute`` only validates
each request and queues it; one worker thread runs the generations (the runtime is not re-entrant) and
answers through each request's response sender, so the same code serves the decoupled (streaming) model
and its non-decoupled twin. Greedy requests that arrive together with the same mode and sampling
parameters are decoded as one batch (up to the engine's max batch); sampled requests run alone so that a
seed reproduces the same text as a one-at-a-time run.

``pb_utils`` (``triton_python_backend_utils``) exists only inside the backend's stub process, so it is
passed in rather than imported here.
"""
from __future__ import annotations

import json
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ssd_trt.decoding.params import SamplingParams
from ssd_trt.detokenize import Detokenizer
from ssd_trt.errors import RequestError, SsdTrtError
from ssd_trt.runtime import DEFAULT_MODE, MODES, Generator, RuntimeOptions

OPTIONAL_INPUTS = ("temperature", "top_p", "top_k", "random_seed", "stream", "mode", "chat")
WARMUP_PROMPT = "Hello"


@dataclass
class Job:
    """One validated request, waiting for or in generation."""
    prompt_ids: list[int]
    params: SamplingParams
    mode: str
    stream: bool
    sender: Any                     # the request's InferenceResponseSender
    received: float = field(default_factory=time.perf_counter)
    gone: bool = False              # a send failed (client went away): send nothing more

    def batch_key(self) -> tuple | None:
        """Jobs with equal keys may share one ``generate`` call; sampled jobs never share (None)."""
        if not self.params.greedy:
            return None
        return self.mode, replace(self.params, seed=None)


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


def parse_request(request, pb_utils, generator: Generator, streaming_model: bool) -> Job:
    """Validate one request completely (so that a batch never fails because of one bad member)."""
    prompt = _text(_one_value(request, pb_utils, "text_input", required=True), "text_input")
    max_tokens = int(_one_value(request, pb_utils, "max_tokens", required=True))
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}")
    values = {name: _one_value(request, pb_utils, name) for name in OPTIONAL_INPUTS}
    mode = DEFAULT_MODE if values["mode"] is None else _text(values["mode"], "mode").strip().lower()
    if mode not in MODES:
        raise RequestError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)} (default {DEFAULT_MODE})")
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
        seed=None if values["random_seed"] is None else int(values["random_seed"]))
    ids = generator.encode(prompt, chat=bool(values["chat"]) if values["chat"] is not None else False)
    [ids], _ = generator.check_request([ids], params, mode)     # the runtime's one request check
    return Job(ids, params, mode, stream, request.get_response_sender())


def request_stats(stats: dict[str, Any], row_tokens: int) -> dict[str, float | int]:
    """The per-request numbers returned as output tensors (NaN where not applicable, e.g. mode ar)."""
    mean, rounds = stats.get("mean_accepted"), stats.get("rounds") or 0
    nan = float("nan")
    return {"generated_tokens": row_tokens,
            "accepted_tokens": int(round(mean * rounds)) if mean is not None else 0,
            "acceptance_rate": nan if stats.get("acceptance_rate") is None else float(stats["acceptance_rate"]),
            "cache_hit_rate": nan if stats.get("cache_hit_rate") is None else float(stats["cache_hit_rate"])}


class Scheduler:
    """A FIFO of jobs drained by one worker thread, which groups compatible greedy jobs into batches."""

    def __init__(self, run: Callable[[list[Job]], None], max_rows: int, autostart: bool = True) -> None:
        self._run = run
        self._max_rows = max(1, max_rows)
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="ssd-trt-generate", daemon=True)
        if autostart:
            self.start()

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            self._queue.append(job)
            self._cond.notify()

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued jobs, then stop the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def _take(self) -> list[Job] | None:
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if not self._queue:
                return None
            first = self._queue.popleft()
            batch, key = [first], first.batch_key()
            if key is not None:
                for job in list(self._queue):
                    if len(batch) >= self._max_rows:
                        break
                    if job.batch_key() == key:
                        self._queue.remove(job)
                        batch.append(job)
            return batch

    def _loop(self) -> None:
        while (batch := self._take()) is not None:
            self._run(batch)


class ModelServer:
    """The state of one model instance: the loaded :class:`Generator` and its scheduler."""

    def __init__(self, generator: Generator, pb_utils, streaming_model: bool, max_rows: int,
                 log: Callable[[str], None]) -> None:
        self.generator = generator
        self.pb = pb_utils
        self.streaming_model = streaming_model
        self.log = log
        self.scheduler = Scheduler(self._generate, max_rows)

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
        max_rows = int(params.get("max_batch_rows") or 0) or generator.limits.max_batch
        max_rows = min(max_rows, generator.limits.max_batch)
        streaming = pb_utils.using_decoupled_model_transaction_policy(model_config)
        log(f"ssd_trt: loaded {artifact_dir} in {time.perf_counter() - started:.1f}s "
            f"(streaming={streaming}, max batch rows {max_rows})")
        return cls(generator, pb_utils, streaming, max_rows, log)

    # -- Triton entry points -------------------------------------------------------------------
    def execute(self, requests) -> None:
        for request in requests:
            try:
                job = parse_request(request, self.pb, self.generator, self.streaming_model)
            except (SsdTrtError, ValueError, TypeError, OverflowError) as exc:
                self._fail(request.get_response_sender(), exc)
                continue
            self.scheduler.submit(job)
        return None

    def close(self) -> None:
        self.scheduler.close()

    # -- responses -----------------------------------------------------------------------------
    def _error(self, exc: BaseException, code: str | None = None):
        """An error response: INVALID_ARG for bad requests, INTERNAL otherwise (or ``code``)."""
        code = code or ("INVALID_ARG" if isinstance(exc, (RequestError, ValueError)) else "INTERNAL")
        message = str(exc) if isinstance(exc, SsdTrtError) else f"{type(exc).__name__}: {exc}"
        value = getattr(self.pb.TritonError, code, None)
        error = self.pb.TritonError(message, value) if value is not None else self.pb.TritonError(message)
        return self.pb.InferenceResponse(output_tensors=[], error=error)

    def _fail(self, sender, exc: BaseException) -> None:
        sender.send(self._error(exc), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _send(self, job: Job, response, final: bool = False) -> None:
        """Send to one job; a failure (e.g. a cancelled request) never disturbs the rest of the batch."""
        if job.gone:
            return
        try:
            job.sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
        except Exception as exc:  # noqa: BLE001
            job.gone = True
            self.log(f"ssd_trt: dropping a request whose response could not be sent ({exc})")

    def _response(self, text: str, token_ids: list[int], stats: dict | None = None):
        tensors = [self.pb.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
                   self.pb.Tensor("output_ids", np.array([token_ids], dtype=np.int32).reshape(1, -1))]
        if stats is not None:
            tensors += [self.pb.Tensor("generated_tokens", np.array([[stats["generated_tokens"]]], np.int32)),
                        self.pb.Tensor("accepted_tokens", np.array([[stats["accepted_tokens"]]], np.int32)),
                        self.pb.Tensor("acceptance_rate", np.array([[stats["acceptance_rate"]]], np.float32)),
                        self.pb.Tensor("cache_hit_rate", np.array([[stats["cache_hit_rate"]]], np.float32))]
        return self.pb.InferenceResponse(output_tensors=tensors)

    def _generate(self, jobs: list[Job]) -> None:
        """Run one batch (worker thread); every job gets its responses and exactly one final flag."""
        live = []
        for job in jobs:                                  # clients that gave up while queued
            cancelled = getattr(job.sender, "is_cancelled", None)
            if cancelled is not None and cancelled():
                self._send(job, self._error(RequestError("request cancelled by the client"), "CANCELLED"),
                           final=True)
            else:
                live.append(job)
        if not live:
            return
        jobs = live
        streams = [Detokenizer.of(self.generator.tokenizer) if job.stream else None for job in jobs]

        def on_tokens(row: int, token_ids: list[int]) -> None:
            detok = streams[row]
            if detok is not None:
                self._send(jobs[row], self._response(detok.push(token_ids), token_ids))

        try:
            results = self.generator.generate_ids([job.prompt_ids for job in jobs], jobs[0].params,
                                                   mode=jobs[0].mode, on_tokens=on_tokens)
        except Exception as exc:  # noqa: BLE001 - every request must get a final response
            if not isinstance(exc, SsdTrtError):
                self.log(f"ssd_trt: generation failed: {traceback.format_exc()}")
            for job in jobs:
                self._send(job, self._error(exc), final=True)
            return
        for job, detok, result in zip(jobs, streams, results):
            stats = request_stats(result.stats, len(result.token_ids))
            if detok is not None:
                self._send(job, self._response(detok.finish(result.text), [], stats), final=True)
            else:
                self._send(job, self._response(result.text, result.token_ids, stats), final=True)
