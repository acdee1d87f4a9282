"""The NATS side of every service: one connection with reconnect, protobuf
payloads, trace context in headers, request/reply dispatch and ordered token
streams with sequence numbers and an explicit end."""

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from google.protobuf.message import DecodeError, Message
import nats.errors
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


def nats_password(settings: NatsSettings) -> str | None:
    """nats.password, else the content of nats.password_file (a mounted Secret:
    under Helm each pod's holds its own instance's password and no other)."""
    if settings.password is not None or settings.password_file is None:
        return settings.password
    try:
        return Path(settings.password_file).read_text().strip()
    except OSError as exc:
        raise ValueError(f"nats.password_file: cannot read {settings.password_file}: {exc.strerror}") from None


def nats_tls(settings: NatsSettings) -> ssl.SSLContext | None:
    """The TLS context of the NATS connection: None without nats.tls_ca (plaintext,
    as under `up` on loopback); else the server must present a certificate of that
    CA for the host it was dialled by, and nats.tls_cert/tls_key, when given, are
    presented to a server that asks for a client certificate."""
    if settings.tls_ca is None:
        if settings.tls_cert is not None or settings.tls_key is not None:
            raise ValueError("nats.tls_cert/tls_key need nats.tls_ca (the CA the server's certificate is checked against)")
        return None
    # create_default_context: CERT_REQUIRED and host name checks, only tls_ca trusted (not the system's CAs).
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=settings.tls_ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if (settings.tls_cert is None) != (settings.tls_key is None):
        raise ValueError("nats.tls_cert and nats.tls_key go together: set both or neither")
    if settings.tls_cert is not None:
        context.load_cert_chain(settings.tls_cert, settings.tls_key)
    return context


class PlaintextServer(Exception):
    """The first server reached does not ask for TLS although nats.tls_ca is set. Not an
    OSError nor a nats error, so that nats-py's connect loop lets it through at once."""


class TlsOnlyClient(NATS):
    """nats-py's client, which goes TLS only when the server's INFO asks for it and
    otherwise sends its CONNECT, the password included, in the clear. Given a TLS
    context, this one refuses a server whose INFO does not ask for TLS as soon as that
    INFO is read, before anything is sent: an impostor on the bus's address (or a
    man in the middle who strips tls_required) never gets a password, on the first
    connect (PlaintextServer) nor on a reconnect (an error: the next try may find
    the real server). Needs no nats-server >= 2.10 handshake_first; with it on, the
    server's INFO is itself sent over TLS. (nats-py is pinned: _process_info is its
    hook for INFO, called before the TLS upgrade and the CONNECT.)"""

    connected_once = False
    """Set once connect() returned: later connects are reconnects, retried on a refusal."""

    async def _process_info(self, info: dict, initial_connection: bool = False) -> None:  # type: ignore[override]
        if initial_connection and self.options.get("tls") is not None and not info.get("tls_required"):
            if self.connected_once:
                raise nats.errors.Error("nats: the server does not ask for TLS: credentials not sent")
            raise PlaintextServer()
        await super()._process_info(info, initial_connection)


class StreamTimeout(TimeoutError):
    """A stream fell silent for longer than allowed."""


class Bus:
    def __init__(self, nc: NATS, request_timeout_s: float) -> None:
        self.nc = nc
        self.request_timeout_s = request_timeout_s
        self.closing = False

    @classmethod
    async def connect(cls, settings: NatsSettings, name: str) -> "Bus":
        bus = cls(TlsOnlyClient(), settings.request_timeout_s)
        password, tls = nats_password(settings), nats_tls(settings)  # bad files fail here, before any retry

        async def on_error(exc: Exception) -> None:
            log.warning("nats: %s", exc)

        async def on_disconnect() -> None:
            if not bus.closing:  # our own drain disconnects too: not worth a warning
                log.warning("nats: disconnected, reconnecting")

        async def on_reconnect() -> None:
            log.info("nats: reconnected")

        connecting = bus.nc.connect(
            servers=settings.url.split(","),
            name=name,
            connect_timeout=settings.connect_timeout_s,
            max_reconnect_attempts=-1,  # a service outlives a NATS restart
            reconnect_time_wait=0.5,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            user=settings.user,
            password=password,
            # With a CA every server in nats.url must present a certificate of it:
            # nats-py then opens TLS whatever the URL's scheme says.
            tls=tls,
            # Replies come back on the user's own inboxes, which its permissions
            # let it (and no other user) subscribe to: nobody reads another's Acks.
            inbox_prefix=inbox_prefix(settings.user),
        )
        try:
            await connecting
        except PlaintextServer:
            # An impostor, or a NATS left without its certificate: no bus of ours, and
            # it was sent nothing (TlsOnlyClient).
            with contextlib.suppress(Exception):
                await bus.nc.close()
            raise ConnectionError(f"nats.tls_ca is set but {settings.url} does not speak TLS") from None
        bus.nc.connected_once = True
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
        handler: Callable[..., Awaitable[Message | None]],
        queue: str = "",
        with_subject: bool = False,
    ) -> Subscription:
        """Run handler(payload) for each message under the sender's trace context
        (handler(payload, subject) with_subject: where a wildcard subscription
        needs the subject, which names the sender); a returned message is sent as
        the reply when the sender asked for one. A handler's exception is logged
        and never kills the subscription."""

        async def on_msg(msg: Msg) -> None:
            token = otel_context.attach(extract_context(msg.headers))
            try:
                payload = message_type()
                payload.ParseFromString(msg.data)
                reply = await (handler(payload, msg.subject) if with_subject else handler(payload))
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
    """The sending end of one request's token stream, on the subject of the
    publishing instance: numbers the chunks and signs them with that instance."""

    def __init__(self, bus: Bus, instance_id: str, request_id: str) -> None:
        self.bus = bus
        self.instance_id = instance_id
        self.subject = subjects.stream(instance_id, request_id)
        self.next_seq = 0

    async def send(self, chunk: mesh_pb2.TokenChunk) -> None:
        chunk.seq = self.next_seq
        chunk.instance_id = self.instance_id
        self.next_seq += 1
        await self.bus.publish(self.subject, chunk)


OnRejected = Callable[[str, mesh_pb2.TokenChunk], None]
"""(reason, chunk): a chunk a StreamReader dropped."""


class StreamReader:
    """The receiving end of one request's stream, from the instances it was
    handed to. `listen(instance)` subscribes to that instance's subject for the
    request, before the request is dispatched there; one instance is the token
    source (decode), the others (prefill) may only end the request with an error.

    A chunk counts only when it names the instance of the subject it came on and
    this request, and carries tokens only from the token source: anything else is
    dropped and reported to on_rejected (a forgery, or a bug), as is a duplicate
    seq. The source's chunks come out in seq order (a reordered chunk waits for its
    predecessors) until the final one; `fail(exc)` ends the iteration with exc
    (the instance left the mesh)."""

    def __init__(
        self,
        bus: Bus,
        request_id: str,
        on_rejected: OnRejected | None = None,
        on_accepted: Callable[[mesh_pb2.TokenChunk], None] | None = None,
    ) -> None:
        """on_accepted(chunk): a chunk passed the checks, as it arrives (before it is read)."""
        self.bus = bus
        self.request_id = request_id
        self.on_rejected = on_rejected
        self.on_accepted = on_accepted
        self.source: str | None = None
        self._queue: asyncio.Queue[mesh_pb2.TokenChunk | BaseException] = asyncio.Queue()
        self._subs: dict[str, Subscription] = {}

    async def __aenter__(self) -> "StreamReader":
        return self

    async def __aexit__(self, *exc: object) -> None:
        subs, self._subs = list(self._subs.values()), {}
        for sub in subs:
            with contextlib.suppress(Exception):  # the connection may be gone: nothing left to unsubscribe
                await sub.unsubscribe()

    async def listen(self, instance_id: str, source: bool = True) -> None:
        """Accept this instance's chunks from now on: its tokens if source, else only an error."""
        if source:
            self.source = instance_id
        if instance_id in self._subs:
            return

        async def on_msg(msg: Msg) -> None:
            chunk = mesh_pb2.TokenChunk()
            try:
                chunk.ParseFromString(msg.data)
            except DecodeError:
                self._reject("malformed", chunk)
                return
            if chunk.instance_id != instance_id:
                self._reject("instance_mismatch", chunk)
            elif chunk.request_id != self.request_id:
                self._reject("request_mismatch", chunk)
            elif instance_id != self.source and not chunk.error:
                self._reject("not_the_source", chunk)
            else:
                self._queue.put_nowait(chunk)
                if self.on_accepted is not None:
                    self.on_accepted(chunk)

        subject = subjects.stream(instance_id, self.request_id)
        self._subs[instance_id] = await self.bus.nc.subscribe(subject, cb=on_msg, pending_msgs_limit=65536)

    def fail(self, exc: BaseException) -> None:
        """End the iteration with exc (from the event loop's thread)."""
        self._queue.put_nowait(exc)

    def _reject(self, reason: str, chunk: mesh_pb2.TokenChunk) -> None:
        if self.on_rejected is not None:
            self.on_rejected(reason, chunk)

    async def chunks(self, first_timeout_s: float, idle_timeout_s: float) -> AsyncIterator[mesh_pb2.TokenChunk]:
        next_seq = 0
        pending: dict[int, mesh_pb2.TokenChunk] = {}
        timeout = first_timeout_s
        while True:
            try:
                item = await asyncio.wait_for(self._queue.get(), timeout)
            except TimeoutError:
                where = f"{self.source}'s stream of {self.request_id}"
                raise StreamTimeout(f"no chunk {next_seq} on {where} within {timeout:.1f}s") from None
            if isinstance(item, BaseException):
                raise item
            if item.instance_id != self.source:  # an error from an instance before the source (listen checked)
                yield item
                return
            timeout = idle_timeout_s
            if item.seq < next_seq or item.seq in pending:
                self._reject("duplicate_seq", item)
                continue
            pending[item.seq] = item
            while next_seq in pending:
                ready = pending.pop(next_seq)
                next_seq += 1
                yield ready
                if ready.final:
                    return
