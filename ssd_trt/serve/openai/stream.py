"""Between the serving loop's sender thread and the HTTP server's event loop, for one request.

:class:`Answers` gathers a request's answers, from each of its choices (several prompts, or ``n`` > 1, are several
requests to the serving loop): :class:`ChoiceHandle` is one choice's ``serve.core.Handle``, whose chunks, final result
or error become ``(kind, choice index, payload)`` items of one ``asyncio.Queue`` on the event loop
(``call_soon_threadsafe``: the only thread-safe way in). The HTTP side awaits them. The queue is bounded
(``MAX_PENDING_CHUNKS`` per choice): a client that stops reading its stream has it ended (see :class:`SlowReader` for
why not backpressure).

:class:`AbortingStream` sends server-sent events and listens for the client going away at the same time, whatever
ASGI version the server speaks (Starlette's own streaming response notices a disconnect only when a send fails under
ASGI 2.4, which may be rounds later, or never while a request waits in the queue): on a disconnect it calls
``on_disconnect`` (the request is aborted and its rows freed at the next step) and closes the event generator.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ssd_trt.decoding.logprobs import TokenLogprob
from ssd_trt.errors import RequestError
from ssd_trt.serve.core import Final

# chunks queued for a stream its client has not read yet; past this it is ended. The sender thread already merges
# what queued up while it was busy into one chunk per request, so a reader that keeps up holds a handful; 256 chunks
# behind is a reader that stopped (its socket's buffers are full too).
MAX_PENDING_CHUNKS = 256


class SlowReader(RequestError):
    """The client stopped reading its stream. The stream is ended (this error as its last event) rather than held
    back: the engine cannot pause one row of a running batch, so backpressure would keep the request's row and KV
    cache busy for a reader that may never come back, or stall the sender thread, and with it every other stream."""


class Answers:
    """A request's answers as ``(kind, index, payload)`` items of ``queue``: ("chunk", i, (text, logprobs or None)),
    ("final", i, Final) or ("error", i, exception) for choice ``i``; at most ``max_pending`` chunks a choice wait
    unread, then a SlowReader error ends the request (the sender then aborts its choices)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, choices: int = 1,
                 max_pending: int = MAX_PENDING_CHUNKS) -> None:
        self.loop, self.choices = loop, choices
        self.max_pending = max_pending * choices
        self.queue: asyncio.Queue[tuple[str, int, Any]] = asyncio.Queue()
        self.closed = False          # the HTTP side stopped listening (its client went away, or it was ended)

    def handle(self, index: int) -> "ChoiceHandle":
        return ChoiceHandle(self, index)

    def put(self, item: tuple[str, int, Any]) -> None:
        if self.closed:
            raise ConnectionError("the client went away")
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)    # raises once the loop is closed


class ChoiceHandle:
    """One choice's ``serve.core.Handle``: what the sender thread hands over goes to the request's :class:`Answers`."""

    def __init__(self, answers: Answers, index: int) -> None:
        self.answers, self.index = answers, index

    def chunk(self, text: str, token_ids: list[int],      # noqa: ARG002 -- OpenAI streams text (and logprobs)
              logprobs: list[TokenLogprob] | None = None) -> None:
        answers = self.answers
        if answers.queue.qsize() >= answers.max_pending:   # (read off the loop's thread: at worst one chunk late)
            answers.put(("error", self.index, SlowReader(f"the client read its stream too slowly "
                                                         f"({answers.max_pending} chunks unread); the request was "
                                                         f"ended")))
            answers.closed = True
            raise ConnectionError("the client stopped reading its stream")
        answers.put(("chunk", self.index, (text, logprobs)))

    def final(self, result: Final) -> None:
        self.answers.put(("final", self.index, result))

    def error(self, exc: BaseException) -> None:
        self.answers.put(("error", self.index, exc))

    def cancelled(self) -> bool:
        return self.answers.closed


class AbortingStream(StreamingResponse):
    """Server-sent events; ``on_disconnect`` runs if the client goes away before the last one was sent."""

    media_type = "text/event-stream"

    def __init__(self, content, on_disconnect: Callable[[], None], headers: dict[str, str] | None = None) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", **(headers or {})})
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    nonlocal finished
                    try:
                        await self.stream_response(send)
                        finished = True
                    except OSError:                 # the connection broke mid-send: the client is gone
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            if not finished:
                self.on_disconnect()
            await self.body_iterator.aclose()
