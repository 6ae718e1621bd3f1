"""What the exported ``model.py`` delegates to: Triton's tensors in, the shared serving loop, Triton's responses out.

Triton's Python backend calls ``execute`` on one thread per model instance. ``execute`` validates each request (the
TensorRT-LLM tensor names, then the runtime's one request check) and submits it to the instance's
:class:`~ssd_trt.serve.core.ServingCore`: the serving loop the OpenAI frontend runs too (continuous batching on one
step thread, detokenizing, stop strings, cancellation and metrics on a sender thread). This module adds only what is
Triton's: reading the input tensors, :class:`TritonHandle` (a request's response sender: chunks, the final response
with the request's statistics, errors with Triton's codes, whether the client cancelled), and the export of the
metrics as Triton custom metrics (``metrics.py``).

``pb_utils`` (``triton_python_backend_utils``) exists only inside the backend's stub process, so it is
passed in rather than imported here.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ssd_trt.batching.scheduler import CapacityError
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.settings import Settings, parse_mode
from ssd_trt.errors import RequestError, SsdTrtError
from ssd_trt.runtime import DEFAULT_MODE
from ssd_trt.serve.core import Final, RequestCancelled, ServingCore, Submission
from ssd_trt.serve.fields import TRITON_INPUTS
from ssd_trt.serve.loading import load_core
from ssd_trt.serve.structured import from_triton
from ssd_trt.serve.triton.metrics import TritonMetrics

UNLOAD_DRAIN_S = 30.0   # at unload, requests in flight get this long to finish before they end with an error
# the optional one-value inputs (serve/fields.py); stop_words and tree_widths are lists, read on their own
OPTIONAL_INPUTS = tuple(f.triton for f in TRITON_INPUTS if not f.required and f.dims == "[ 1 ]")


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


def parse_request(request, pb_utils, core: ServingCore, streaming_model: bool) -> Submission:
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
        stop_on_eos=not bool(values["ignore_eos"]), stop=_stop_words(request, pb_utils),
        grammar=None if values["structured_outputs"] is None else
        from_triton(_text(values["structured_outputs"], "structured_outputs")))
    ids = core.generator.encode(prompt, chat=bool(values["chat"]) if values["chat"] is not None else False)
    return core.check(ids, params, mode, stream)


def _error(pb_utils, exc: BaseException):
    """An error response: UNAVAILABLE for a full queue (retry later), INVALID_ARG for bad requests, CANCELLED for a
    cancelled one, INTERNAL otherwise."""
    code = "CANCELLED" if isinstance(exc, RequestCancelled) else "UNAVAILABLE" if isinstance(exc, CapacityError) else \
        "INVALID_ARG" if isinstance(exc, (RequestError, ValueError)) else "INTERNAL"
    message = str(exc) if isinstance(exc, SsdTrtError) else f"{type(exc).__name__}: {exc}"
    value = getattr(pb_utils.TritonError, code, None)
    error = pb_utils.TritonError(message, value) if value is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def _nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)


class TritonHandle:
    """One request's answers as Triton responses through its response sender (``serve.core.Handle``)."""

    def __init__(self, sender, pb_utils) -> None:
        self.sender, self.pb = sender, pb_utils

    def chunk(self, text: str, token_ids: list[int], logprobs=None) -> None:   # noqa: ARG002 -- no such output
        self.sender.send(self._response(text, token_ids))

    def final(self, result: Final) -> None:
        stats = result.stats
        tensors = [("generated_tokens", np.int32, stats["generated_tokens"]),
                   ("accepted_tokens", np.int32, stats["accepted_tokens"]),
                   ("acceptance_rate", np.float32, _nan(stats["acceptance_rate"])),
                   ("cache_hit_rate", np.float32, _nan(stats["cache_hit_rate"]))]
        response = self._response(result.text, result.token_ids,
                                  [self.pb.Tensor(name, np.array([[value]], dtype)) for name, dtype, value in tensors])
        self.sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def error(self, exc: BaseException) -> None:
        self.sender.send(_error(self.pb, exc), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def cancelled(self) -> bool:
        is_cancelled = getattr(self.sender, "is_cancelled", None)
        return is_cancelled is not None and is_cancelled()

    def _response(self, text: str, token_ids: list[int], extra: list | None = None):
        tensors = [self.pb.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
                   self.pb.Tensor("output_ids", np.array([token_ids], dtype=np.int32).reshape(1, -1)), *(extra or [])]
        return self.pb.InferenceResponse(output_tensors=tensors)


class ModelServer:
    """One model instance: the loaded build's serving loop (``core``)."""

    def __init__(self, core: ServingCore, pb_utils, streaming_model: bool, log: Callable[[str], None],
                 model_name: str = "ssd_trt") -> None:
        self.pb = pb_utils
        self.streaming_model = streaming_model
        self.log = log
        self.core = core
        self.triton_metrics = TritonMetrics(pb_utils, model_name, log)
        self._export_metrics()      # the families created here, on the stub's main thread; updated by the sender's
        self.core.exporters.append(self._export_metrics)

    def _export_metrics(self) -> None:
        self.triton_metrics.update(self.core.llm.metrics, self.core.families())

    @classmethod
    def from_config(cls, model_config: dict, pb_utils) -> "ModelServer":
        params = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
        logger = getattr(pb_utils, "Logger", None)
        log = logger.log_info if logger is not None else print
        artifact_dir = Path(params["artifact_dir"])
        core, seconds = load_core(artifact_dir, json.loads(params.get("runtime_options") or "{}"),
                                  int(params.get("max_batch_rows") or 0), log,
                                  verify=params.get("verify_checksums", "true").lower() == "true",
                                  warmup=params.get("warmup", "true").lower() == "true")
        streaming = pb_utils.using_decoupled_model_transaction_policy(model_config)
        server = cls(core, pb_utils, streaming, log, model_config.get("name", "ssd_trt"))
        log(f"ssd_trt: loaded {artifact_dir} in {seconds:.1f}s "
            f"(streaming={streaming}, continuous batching up to {core.max_running} requests)")
        return server

    # -- Triton entry points -------------------------------------------------------------------
    def execute(self, requests) -> None:
        for request in requests:
            arrived = time.perf_counter()           # time to first token counts from before tokenizing
            sender = request.get_response_sender()
            try:
                submission = parse_request(request, self.pb, self.core, self.streaming_model)
                # a loop that died or is stopping refuses here (ServingStopped: INTERNAL with its reason); Triton's
                # own health endpoints cannot see the loop
                self.core.submit(submission, TritonHandle(sender, self.pb), arrived)
            except (SsdTrtError, ValueError, TypeError, OverflowError) as exc:
                self.core.count_refusal(exc)       # (what Triton itself refuses never reaches here: not counted)
                sender.send(_error(self.pb, exc), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def close(self) -> None:
        """Unload: the requests in flight finish (or end with an error after ``UNLOAD_DRAIN_S``), then the loop stops."""
        self.core.drain(UNLOAD_DRAIN_S, "the model is being unloaded")
        self.core.close()
