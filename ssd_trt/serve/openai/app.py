"""The HTTP layer: FastAPI routes over the shared serving loop (``serve/core.py``); nothing else lives here.

    GET  /health                 200 once the model is loaded and warmed up and while its serving loop works; 503
                                 while loading, once the loop died or stalled, and while shutting down
    GET  /v1/models              the one model this server serves
    POST /v1/completions         a prompt (``protocol.py`` lists the fields)
    POST /v1/chat/completions    messages, through the tokenizer's chat template
    GET  /metrics                Prometheus text (``serve/metrics.py``)

The server listens at once and loads the build on a thread (``ServerState.load``), so an orchestrator can tell
"loading" (503 on /health) from "dead" (no answer). Each request is checked completely before it is queued (a 400 with
the OpenAI error object otherwise) and then handed to the serving loop as one request per choice (several prompts, or
``n`` > 1), their answers gathered by a :class:`~.stream.Answers`; a streamed one is answered as server-sent events,
a plain one when every choice finished. A client that goes away has its request aborted: while streaming the response
notices at once (``AbortingStream``); while waiting for a plain answer the route asks every ``DISCONNECT_POLL_S``.
Tokenizing and the chat template run on a worker thread: a long prompt never holds up the event loop (other streams'
chunks, the probes).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import traceback
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ssd_trt.serve.core import Final, ServingCore, ServingStopped
from ssd_trt.serve.metrics import render
from ssd_trt.serve.openai.auth import ApiKeyAuth
from ssd_trt.serve.openai.errors import ApiError, bad_request, count_rejection, from_exception, rejection_reason
from ssd_trt.serve.openai.protocol import Chunks, Parsed, error_event, new_id, parse, response
from ssd_trt.serve.openai.stream import AbortingStream, Answers

DISCONNECT_POLL_S = 0.25


@dataclass
class ServerState:
    """What the routes need: the model's name and, once loaded, the serving loop."""
    model: str
    load: Callable[[], ServingCore]               # runs on the loader thread
    log: Callable[[str], None] = print
    on_failure: Callable[[str], None] = lambda message: None    # the load failed: stop the server
    core: ServingCore | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    max_context: int | None = None
    aliases: tuple[str, ...] = ()                 # further names requests may use (--served-model-name)
    api_key: str | None = None                    # None: no key needed (auth.py)

    def start_loading(self) -> threading.Thread:
        def run() -> None:
            try:
                core = self.load()
            except Exception as exc:  # noqa: BLE001 -- any failure to load ends the server, with its reason
                message = str(exc) if not isinstance(exc, (KeyError, AttributeError)) else repr(exc)
                self.log(f"ssd_trt: loading failed: {type(exc).__name__}: {message}")
                self.on_failure(message)
                return
            self.max_context = core.generator.limits.max_context
            self.core = core
        thread = threading.Thread(target=run, name="ssd-trt-load", daemon=True)
        thread.start()
        return thread

    def ready_core(self) -> ServingCore:
        if self.core is None:
            raise ApiError(503, "the model is still loading; retry when GET /health answers 200",
                           "service_unavailable_error", code="loading", headers={"Retry-After": "5"})
        refusal = self.core.refusal()
        if refusal is not None:
            raise unavailable(refusal)
        return self.core


def unavailable(reason: str) -> ApiError:
    """The loop takes no request now (shutting down, or its step thread died): 503, as a full queue."""
    return ApiError(503, reason, "service_unavailable_error", code="unavailable")


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start_loading()
        yield
        if state.core is not None:
            state.core.close()

    app = FastAPI(title="ssd-trt OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    if state.api_key:
        app.add_middleware(ApiKeyAuth, key=state.api_key, on_reject=lambda error: count_rejection(state.core, error))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:     # noqa: ARG001
        count_rejection(state.core, exc)
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                         "invalid_request_error" if exc.status_code < 500 else "server_error")
        return error_response(error)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:     # noqa: ARG001
        state.log(f"ssd_trt: unexpected error: {traceback.format_exc()}")
        return error_response(from_exception(exc))

    @app.get("/health")
    async def health() -> Response:
        if state.core is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        health = state.core.health()
        return JSONResponse(health, status_code=200 if health["status"] == "ok" else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": state.model, "object": "model", "created": state.created, "owned_by": "ssd-trt"}
        if state.max_context is not None:
            card["max_model_len"] = state.max_context
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.core is None:
            return PlainTextResponse("", status_code=503)
        return PlainTextResponse(render(state.core.families(), {"model_name": state.model}),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def generate(request: Request, chat: bool) -> Response:
        arrived = time.perf_counter()                  # time to first token counts from here
        core = state.ready_core()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(f"the request body is not valid JSON ({exc})", None) from None
        try:
            parsed = await asyncio.to_thread(parse, body, core, (state.model, *state.aliases), chat)    # tokenizes
            answers = Answers(asyncio.get_running_loop(), len(parsed.submissions))
            request_ids = submit_all(core, parsed, answers, arrived)
        except Exception as exc:  # noqa: BLE001 -- every refusal is an OpenAI error object
            error = unavailable(str(exc)) if isinstance(exc, ServingStopped) else from_exception(exc)
            if error.status >= 500 and rejection_reason(error) is None and not isinstance(exc, ServingStopped):
                # the server's own failure: the log keeps the whole story (a full queue or a stopping loop is a
                # refusal, counted in the metrics, not a traceback per request)
                state.log(f"ssd_trt: a request could not be taken: {traceback.format_exc()}")
            raise error from None
        answer_id = new_id(chat)

        def abort() -> None:
            answers.closed = True
            for request_id in request_ids:
                core.abort(request_id)
        if parsed.stream:
            return AbortingStream(events(answers, Chunks(parsed, answer_id, state.model, core.decode), abort), abort)
        return await whole(request, core, answers, parsed, answer_id, abort)

    async def whole(request: Request, core: ServingCore, answers: Answers, parsed: Parsed, answer_id: str,
                    abort: Callable[[], None]) -> Response:
        """A plain request's answer, once every choice finished; aborted if its client goes away meanwhile, if one
        of its choices fails, or if the server gives up on it (its task is cancelled at shutdown)."""
        clock = asyncio.get_running_loop().time
        asked = clock()
        finals: dict[int, Final] = {}
        try:
            while True:
                try:
                    kind, index, payload = await asyncio.wait_for(answers.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    kind, index, payload = "waiting", None, None
                if kind == "final":
                    finals[index] = payload
                    if len(finals) == answers.choices:
                        return JSONResponse(response(parsed, answer_id, state.model,
                                                     [finals[i] for i in range(answers.choices)], core.decode))
                if kind == "error":
                    abort()                                     # (the other choices: nobody will read them)
                    return error_response(from_exception(payload))
                if clock() - asked >= DISCONNECT_POLL_S:
                    asked = clock()
                    if await request.is_disconnected():
                        abort()
                        return Response(status_code=499)       # (nobody reads it: the client is gone)
        except asyncio.CancelledError:
            abort()
            raise

    return app


def submit_all(core: ServingCore, parsed: Parsed, answers: Answers, arrived: float) -> list[str]:
    """Every choice to the serving loop; if one is refused (e.g. the queue filled up), those already queued are
    aborted and the refusal is the request's."""
    request_ids: list[str] = []
    try:
        for index, submission in enumerate(parsed.submissions):
            request_ids.append(core.submit(submission, answers.handle(index), arrived))
    except BaseException:
        answers.closed = True
        for request_id in request_ids:
            core.abort(request_id)
        raise
    return request_ids


async def events(answers: Answers, chunks: Chunks, abort: Callable[[], None]) -> AsyncIterator[str]:
    """A streamed request's events, from its first chunk to ``data: [DONE]``; choices interleave as their chunks
    come. An error in one choice ends the stream (the others are aborted)."""
    finals: dict[int, Final] = {}
    while len(finals) < answers.choices:
        kind, index, payload = await answers.queue.get()
        if kind == "chunk":
            text = chunks.text(index, *payload)
            if text:
                yield text
        elif kind == "final":
            finals[index] = payload
            yield chunks.final(index, payload)
        else:
            abort()
            yield error_event(from_exception(payload))
            return
    yield chunks.end([finals[i] for i in range(answers.choices)])
