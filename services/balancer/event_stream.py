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

from services.balancer.errors import APIError, ClientGone
from services.balancer.pump import Pump

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """The SSE body read from a request's pump; cleanup (the pump, the span, the place
    in flight) runs however the response ends. When the client goes away Starlette
    stops the body, and closing the pump cancels the request."""

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
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup.aclose()


async def unless_disconnected(http: Request, work: Awaitable[T]) -> T:
    """work's result; if the client disconnects first, work is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(http))
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


async def _disconnect(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def json_response(model: BaseModel, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), media_type="application/json", headers=headers)


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def sse_error(error: APIError) -> str:
    return f"data: {error.body()}\n\n"
