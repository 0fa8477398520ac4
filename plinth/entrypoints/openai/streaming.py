"""Server-sent events and client-disconnect handling.

A request whose client goes away must stop using the engine at once. Both kinds of
response watch the ASGI ``receive`` channel for ``http.disconnect`` while they work, and
cancel the work when it arrives; cancelling a ``generate`` iteration aborts the engine
request (its KV blocks are freed on the engine's next loop iteration).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from plinth.entrypoints.openai.errors import error_json

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the request body must already be consumed)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        if not task.done():
            await _cancel(task)
        await _cancel(watcher)


class SSEResponse(Response):
    """A ``text/event-stream`` response: each yielded string becomes one ``data:`` event,
    followed by ``data: [DONE]``.

    The events iterator is always closed (which aborts the engine request) when the client
    disconnects, when sending fails, or when the server cancels the response at shutdown.
    An exception raised by the iterator after the stream has started is sent as a final
    error event in the OpenAI error shape.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], named_events: bool = False,
                 on_close: Callable[[], Awaitable[None]] | None = None):
        # Like StreamingResponse: no body attribute, so no Content-Length header.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        #: the Responses API's form: ``event: <the payload's type>`` before each ``data:`` line, no ``[DONE]``
        self._named = named_events
        #: awaited once the response ends however it ends (after ``events`` is closed): closes what ``events``
        #: reads from even if ``events`` never started or was stopped before its own cleanup was reached
        self._on_close = on_close

    def _frame(self, payload: str, kind: str | None = None) -> bytes:
        if not self._named:
            return f"data: {payload}\n\n".encode()
        if kind is None:
            kind = json.loads(payload).get("type", "message")
        return f"event: {kind}\ndata: {payload}\n\n".encode()

    async def _produce(self, send: Send) -> None:
        while True:
            try:
                payload = await anext(self._events)
                frame = self._frame(payload)   # (text that cannot be encoded fails here, as an error event)
            except StopAsyncIteration:
                break
            except Exception as exc:  # noqa: BLE001 - reported to the client in the OpenAI error shape
                payload = error_json(exc)
                await send({"type": "http.response.body", "body": self._frame(payload, "error"), "more_body": True})
                break
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"" if self._named else b"data: [DONE]\n\n",
                    "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        producer = asyncio.create_task(self._produce(send))
        watcher = asyncio.create_task(wait_for_disconnect(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if producer.done() and not producer.cancelled() and producer.exception() is not None:
                exc = producer.exception()
                if not isinstance(exc, OSError):
                    raise exc
                logger.debug("stream ended early: %s", exc)
        finally:
            if not producer.done():
                await _cancel(producer)
            await _cancel(watcher)
            try:
                aclose = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                if self._on_close is not None:
                    await self._on_close()
