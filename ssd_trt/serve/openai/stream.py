"""Between the serving loop's sender thread and the HTTP server's event loop, for one request.

:class:`QueueHandle` is the request's ``serve.core.Handle``: the sender thread's chunks, final result or error become
items of an ``asyncio.Queue`` on the event loop (``call_soon_threadsafe``: the only thread-safe way in). The HTTP
side awaits them. The queue is bounded (``MAX_PENDING_CHUNKS``): a client that stops reading its stream has it ended
(see :class:`SlowReader` for why not backpressure).

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


class QueueHandle:
    """A request's answers, as ("chunk", text) | ("final", Final) | ("error", exception) items of ``queue``: at most
    ``max_pending`` chunks, then a SlowReader error ends it (the sender then aborts the request)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_pending: int = MAX_PENDING_CHUNKS) -> None:
        self.loop = loop
        self.max_pending = max_pending
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.closed = False          # the HTTP side stopped listening (its client went away)

    def _put(self, item: tuple[str, Any]) -> None:
        if self.closed:
            raise ConnectionError("the client went away")
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)    # raises once the loop is closed

    def chunk(self, text: str, token_ids: list[int]) -> None:   # noqa: ARG002 -- OpenAI streams text only
        if self.queue.qsize() >= self.max_pending:   # (read off the loop's thread: at worst one chunk late)
            self._put(("error", SlowReader(f"the client read its stream too slowly ({self.max_pending} chunks "
                                           f"unread); the request was ended")))
            self.closed = True
            raise ConnectionError("the client stopped reading its stream")
        self._put(("chunk", text))

    def final(self, result: Final) -> None:
        self._put(("final", result))

    def error(self, exc: BaseException) -> None:
        self._put(("error", exc))

    def cancelled(self) -> bool:
        return self.closed


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
