"""The SSE body notices a client that left however the ASGI server reports it: an
http.disconnect on the receive channel while sends still "succeed" (uvicorn drops
writes to a closed connection silently, and Starlette stops watching the channel
at ASGI 2.4), or a send that raises OSError (ASGI 2.4). Either way the request's
producer is cancelled and the cleanup runs; a stream served to its end is not."""

import asyncio
import contextvars
from collections.abc import AsyncGenerator
from contextlib import AsyncExitStack

import pytest
from starlette.types import Message

from services.balancer.frontend.event_stream import EventStream
from services.balancer.frontend.pump import Pump


class Producer:
    """An endless (or num_items long) source of events, remembering how it ended."""

    def __init__(self, num_items: int | None = None) -> None:
        self.num_items = num_items
        self.num_made = 0
        self.ended: str | None = None

    async def run(self) -> AsyncGenerator[str, None]:
        try:
            while self.num_items is None or self.num_made < self.num_items:
                self.num_made += 1
                yield f"data: {self.num_made}\n\n"
                await asyncio.sleep(0.001)
            self.ended = "finished"
        except asyncio.CancelledError:
            self.ended = "cancelled"
            raise


async def serve(producer: Producer, spec_version: str, receive, send) -> list[str]:  # noqa: ANN001
    """Runs the EventStream as a server would; returns what the cleanup saw."""
    cleaned: list[str] = []
    async with AsyncExitStack() as stack:
        pump: Pump[str] = Pump(producer.run(), contextvars.copy_context())
        stack.push_async_callback(pump.close)
        stack.callback(cleaned.append, "cleaned")
        first = await pump.next()
        assert first is not None
        response = EventStream(first, pump, stack.pop_all(), {})
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}}
        await asyncio.wait_for(response(scope, receive, send), 5)  # an endless producer: a missed disconnect times out
    return cleaned


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_disconnect_on_the_receive_channel_cancels_the_stream_while_sends_succeed(spec_version: str) -> None:
    producer = Producer()
    sent: list[Message] = []
    left = asyncio.Event()

    async def send(message: Message) -> None:  # a closed connection's writes dropped silently
        sent.append(message)
        if len(sent) == 5:
            left.set()

    async def receive() -> Message:
        await left.wait()
        return {"type": "http.disconnect"}

    cleaned = asyncio.run(serve(producer, spec_version, receive, send))
    assert producer.ended == "cancelled" and cleaned == ["cleaned"]
    assert producer.num_made < 100  # stopped at the disconnect, not long after


def test_a_send_that_raises_oserror_ends_the_stream() -> None:
    producer = Producer()
    sent: list[Message] = []

    async def send(message: Message) -> None:
        if len(sent) == 3:
            raise OSError("connection closed")  # ASGI 2.4's word for a client that left
        sent.append(message)

    async def receive() -> Message:
        await asyncio.Event().wait()  # a server that never reports the disconnect on the channel
        raise AssertionError

    cleaned = asyncio.run(serve(producer, "2.4", receive, send))
    assert producer.ended == "cancelled" and cleaned == ["cleaned"]
    assert producer.num_made < 100


def test_a_client_that_stays_gets_the_whole_stream() -> None:
    producer = Producer(num_items=20)
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        await asyncio.Event().wait()
        raise AssertionError

    cleaned = asyncio.run(serve(producer, "2.3", receive, send))
    assert producer.ended == "finished" and cleaned == ["cleaned"]
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert bodies == [f"data: {i}\n\n".encode() for i in range(1, 21)] + [b""]
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_an_error_in_the_body_propagates_after_cleanup() -> None:
    async def failing() -> AsyncGenerator[str, None]:
        yield "data: 1\n\n"
        raise RuntimeError("the producer failed")

    async def send(message: Message) -> None:
        pass

    async def receive() -> Message:
        await asyncio.Event().wait()
        raise AssertionError

    async def run() -> list[str]:
        cleaned: list[str] = []
        async with AsyncExitStack() as stack:
            pump: Pump[str] = Pump(failing(), contextvars.copy_context())
            stack.callback(cleaned.append, "cleaned")
            first = await pump.next()
            response = EventStream(first or "", pump, stack.pop_all(), {})
            with pytest.raises(RuntimeError, match="the producer failed"):
                await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        return cleaned

    assert asyncio.run(run()) == ["cleaned"]
