"""Errors as the OpenAI API gives them: an HTTP status and ``{"error": {"message", "type", "param", "code"}}``.

Every bad request is a 400 carrying ssd_trt's own :class:`~ssd_trt.errors.RequestError` message (what was wrong and
how to fix it), with ``param`` naming the field where it can be told; an unknown model a 404, as OpenAI answers; a
full queue a 503 with ``Retry-After`` (the client retries; the OpenAI client does so by itself); anything unexpected
a 500 whose message names the exception, never a traceback (that goes to the server's log). A request refused
before it was queued (400, 401, 404, 503 queue_full) is counted in ``ssd_trt:request_rejected_total`` by reason.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ssd_trt.batching.scheduler import CapacityError
from ssd_trt.errors import RequestError, SsdTrtError
from ssd_trt.serve.fields import NAMES

if TYPE_CHECKING:
    from ssd_trt.serve.core import ServingCore

RETRY_AFTER_S = 1


class ApiError(Exception):
    """An answer other than 200: its status and the OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param if param is not None else param_of(message))


def param_of(message: str) -> str | None:
    """The request field a validation message is about, where it names one."""
    if message.startswith("unknown mode"):
        return "mode"
    if message.startswith("prompt (") and "max_tokens" in message:
        return "max_tokens"
    for name in NAMES:        # (serve/fields.py)
        if re.match(rf"'?{name}\b", message) or f"'{name}'" in message:
            return name
    return "prompt" if message.startswith("prompt") else None


def from_exception(exc: BaseException) -> ApiError:
    """The answer for an exception raised while taking a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, CapacityError):
        return ApiError(503, f"the server is at capacity: {exc}", "service_unavailable_error", None, "queue_full",
                        {"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, (RequestError, ValueError, TypeError, OverflowError)):
        # the runtime names its own parameter max_new_tokens; here it is the request's max_tokens
        return bad_request(str(exc).replace("max_new_tokens", "max_tokens"), getattr(exc, "field", None))
    if isinstance(exc, SsdTrtError):
        return ApiError(500, str(exc), "server_error", code="generation_failed")
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", code="internal_error")


def rejection_reason(error: ApiError) -> str | None:
    """What a refused request is counted under (``serve/metrics.py``'s REJECTED_REASONS); None: not a refusal (a
    failure of the server's own, or the model still loading)."""
    if error.code in ("queue_full", "model_not_found"):
        return error.code
    return {400: "bad_request", 401: "unauthorized"}.get(error.status)


def count_rejection(core: ServingCore | None, error: ApiError) -> None:
    """Count a refused request in the serving loop's metrics (``core``: None while the model loads, when /metrics
    answers 503 and nothing is counted)."""
    reason = rejection_reason(error)
    if reason is not None and core is not None:
        core.count_rejected(reason)
