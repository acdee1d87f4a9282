"""A response's transport: the SSE body read from a request's pump, the wait for the
first output that a disconnecting client cuts short, and the JSON and SSE framing."""

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import AsyncExitStack, suppress
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from services.balancer.frontend.errors import APIError, ClientGone
from services.balancer.frontend.pump import Pump

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """The SSE body read from a request's pump; cleanup (the pump, the span, the place
    in flight) runs however the response ends, and closing the pump cancels the request.

    The client leaving is noticed two ways, whichever comes first, whatever ASGI
    version the server speaks: an http.disconnect on the receive channel (watched
    for the whole response), or a send that fails (ASGI 2.4 servers raise OSError).
    Starlette's own StreamingResponse watches the channel only below ASGI 2.4 and
    relies on send failing above, but a server may drop writes to a closed
    connection silently (uvicorn does): the stream would then run to its end."""

    def __init__(self, first: str, pump: Pump[str], cleanup: AsyncExitStack, headers: dict[str, str]) -> None:
        async def body() -> AsyncIterator[str]:
            item: str | None = first
            while item is not None:
                yield item
                item = await pump.next()

        headers = {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(body(), media_type="text/event-stream", headers=headers)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _until_disconnect(receive, self._send_all(send))
        finally:
            await self._cleanup.aclose()

    async def _send_all(self, send: Send) -> None:
        """The whole body; returns early if a send finds the connection closed."""
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                data = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # ASGI 2.4: the client is gone
            return


async def _until_disconnect(receive: Receive, work: Awaitable[None]) -> None:
    """Runs work until it ends or the client disconnects (then work is cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (watch, task):
            if not pending.done():
                pending.cancel()
                with suppress(asyncio.CancelledError):
                    await pending
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


async def unless_disconnected(http: Request, work: Awaitable[T]) -> T:
    """work's result; if the client disconnects first, work is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(http.receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _wait_for_disconnect(receive: Receive) -> None:
    # The body was read before the response began: all that can still come is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


def json_response(model: BaseModel, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), media_type="application/json", headers=headers)


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def sse_error(error: APIError) -> str:
    return f"data: {error.body()}\n\n"
