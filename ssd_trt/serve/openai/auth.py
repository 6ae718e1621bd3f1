"""The optional API key (``--api-key``, or the environment variable ``SSD_TRT_API_KEY``; vLLM's ``--api-key`` and
``VLLM_API_KEY``): with one set, every ``/v1/...`` request must carry ``Authorization: Bearer <key>``, else it is
answered 401 with the OpenAI error object, as OpenAI answers a wrong key. ``/health`` and ``/metrics`` stay open (the
orchestrator's probes and Prometheus carry no key), and so do CORS preflights (OPTIONS).

A pure ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: an authorized request passes through untouched, so
streaming and the routes' noticing of a client that went away behave as without a key.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any, Callable

from ssd_trt.serve.openai.errors import ApiError

ENV_KEY = "SSD_TRT_API_KEY"
PROTECTED = "/v1"


def api_key(flag: str | None) -> str | None:
    """The key in force: the flag's, else the environment's; None (or empty): no key, every request is served."""
    return flag or os.environ.get(ENV_KEY) or None


def unauthorized(header: str | None) -> ApiError:
    message = ("this server needs an API key: send 'Authorization: Bearer <key>' (the OpenAI client's api_key)"
               if not header else "the API key given is not this server's")
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class ApiKeyAuth:
    """Refuse ``/v1/...`` requests without ``Authorization: Bearer <key>``; ``on_reject`` is told of each refusal."""

    def __init__(self, app: Any, key: str, on_reject: Callable[[ApiError], None] = lambda error: None) -> None:
        self.app, self.on_reject = app, on_reject
        self._digest = hashlib.sha256(f"Bearer {key}".encode()).digest()   # compared in constant time

    def authorized(self, header: str | None) -> bool:
        return header is not None and hmac.compare_digest(hashlib.sha256(header.encode()).digest(), self._digest)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not (
                scope["path"] == PROTECTED or scope["path"].startswith(PROTECTED + "/")):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        raw = headers.get(b"authorization")
        header = None if raw is None else raw.decode("latin-1")
        if self.authorized(header):
            return await self.app(scope, receive, send)
        error = unauthorized(header)
        self.on_reject(error)
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
