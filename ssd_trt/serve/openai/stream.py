"""Between the serving loop's sender thread and the HTTP server's event loop, for one request.

:class:`QueueHandle` is the request's ``serve.core.Handle``: the sender thread's chunks, final result or error become
items of an ``asyncio.Queue`` on the event loop (``call_soon_threadsafe``: the only thread-safe way in). The HTTP
side awaits them.

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

from ssd_trt.serve.core import Final


class QueueHandle:
    """A request's answers, as ("chunk", text) | ("final", Final) | ("error", exception) items of ``queue``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.closed = False          # the HTTP side stopped listening (its client went away)

    def _put(self, item: tuple[str, Any]) -> None:
        if self.closed:
            raise ConnectionError("the client went away")
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)    # raises once the loop is closed

    def chunk(self, text: str, token_ids: list[int]) -> None:   # noqa: ARG002 -- OpenAI streams text only
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
