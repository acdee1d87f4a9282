"""The NATS side of every service: one connection with reconnect, protobuf
payloads, trace context in headers, request/reply dispatch and ordered token
streams with sequence numbers and an explicit end."""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from google.protobuf.message import Message
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import context as otel_context

from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.settings import NatsSettings
from shared.runtime.telemetry import extract_context, inject_headers

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)


def inbox_prefix(user: str | None) -> str:
    """Where a NATS user's request replies arrive: _INBOX.<user> (see tools/launch/nats_auth.py)."""
    return "_INBOX" if user is None else f"_INBOX.{subjects.check_token(user)}"


class StreamTimeout(TimeoutError):
    """A stream fell silent for longer than allowed."""


class Bus:
    def __init__(self, nc: NATS, request_timeout_s: float) -> None:
        self.nc = nc
        self.request_timeout_s = request_timeout_s
        self.closing = False

    @classmethod
    async def connect(cls, settings: NatsSettings, name: str) -> "Bus":
        bus = cls(NATS(), settings.request_timeout_s)

        async def on_error(exc: Exception) -> None:
            log.warning("nats: %s", exc)

        async def on_disconnect() -> None:
            if not bus.closing:  # our own drain disconnects too: not worth a warning
                log.warning("nats: disconnected, reconnecting")

        async def on_reconnect() -> None:
            log.info("nats: reconnected")

        await bus.nc.connect(
            servers=settings.url.split(","),
            name=name,
            connect_timeout=settings.connect_timeout_s,
            max_reconnect_attempts=-1,  # a service outlives a NATS restart
            reconnect_time_wait=0.5,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            user=settings.user,
            password=settings.password,
            # Replies come back on the user's own inboxes, which its permissions
            # let it (and no other user) subscribe to: nobody reads another's Acks.
            inbox_prefix=inbox_prefix(settings.user),
        )
        return bus

    async def close(self) -> None:
        self.closing = True
        if not self.nc.is_closed:
            await self.nc.drain()

    async def publish(self, subject: str, message: Message) -> None:
        await self.nc.publish(subject, message.SerializeToString(), headers=inject_headers())

    async def request(self, subject: str, message: Message, reply_type: type[R], timeout: float | None = None) -> R:
        """Send and wait for the reply; nats.errors.NoRespondersError when nobody
        listens, nats.errors.TimeoutError when nobody answers in time."""
        msg = await self.nc.request(
            subject,
            message.SerializeToString(),
            timeout=timeout or self.request_timeout_s,
            headers=inject_headers(),
        )
        reply = reply_type()
        reply.ParseFromString(msg.data)
        return reply

    async def subscribe(
        self,
        subject: str,
        message_type: type[M],
        handler: Callable[[M], Awaitable[Message | None]],
        queue: str = "",
    ) -> Subscription:
        """Run handler for each message under the sender's trace context; a
        returned message is sent as the reply when the sender asked for one.
        A handler's exception is logged and never kills the subscription."""

        async def on_msg(msg: Msg) -> None:
            token = otel_context.attach(extract_context(msg.headers))
            try:
                payload = message_type()
                payload.ParseFromString(msg.data)
                reply = await handler(payload)
                if reply is not None and msg.reply:
                    await msg.respond(reply.SerializeToString())
            except Exception:
                log.exception("handler of %s failed", subject)
                if msg.reply:
                    err = mesh_pb2.Ack(accepted=False, code=mesh_pb2.ERROR_CODE_INTERNAL, message="handler failed")
                    await msg.respond(err.SerializeToString())
            finally:
                otel_context.detach(token)

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg, pending_msgs_limit=65536)


class StreamPublisher:
    """The sending end of one request's token stream: numbers the chunks."""

    def __init__(self, bus: Bus, request_id: str) -> None:
        self.bus = bus
        self.subject = subjects.stream(request_id)
        self.next_seq = 0

    async def send(self, chunk: mesh_pb2.TokenChunk) -> None:
        chunk.seq = self.next_seq
        self.next_seq += 1
        await self.bus.publish(self.subject, chunk)


class StreamReader:
    """The receiving end: subscribe before dispatching the request, then iterate
    the chunks in seq order (a reordered chunk waits for its predecessors; a
    duplicate is dropped) until the final one."""

    def __init__(self, bus: Bus, request_id: str) -> None:
        self.bus = bus
        self.subject = subjects.stream(request_id)
        self._queue: asyncio.Queue[mesh_pb2.TokenChunk] = asyncio.Queue()
        self._sub: Subscription | None = None

    async def __aenter__(self) -> "StreamReader":
        async def on_msg(msg: Msg) -> None:
            chunk = mesh_pb2.TokenChunk()
            chunk.ParseFromString(msg.data)
            self._queue.put_nowait(chunk)

        self._sub = await self.bus.nc.subscribe(self.subject, cb=on_msg, pending_msgs_limit=65536)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def chunks(self, first_timeout_s: float, idle_timeout_s: float) -> AsyncIterator[mesh_pb2.TokenChunk]:
        next_seq = 0
        pending: dict[int, mesh_pb2.TokenChunk] = {}
        timeout = first_timeout_s
        while True:
            try:
                chunk = await asyncio.wait_for(self._queue.get(), timeout)
            except TimeoutError:
                raise StreamTimeout(f"no chunk {next_seq} on {self.subject} within {timeout:.1f}s") from None
            timeout = idle_timeout_s
            if chunk.seq < next_seq or chunk.seq in pending:
                continue  # duplicate
            pending[chunk.seq] = chunk
            while next_seq in pending:
                ready = pending.pop(next_seq)
                next_seq += 1
                yield ready
                if ready.final:
                    return
