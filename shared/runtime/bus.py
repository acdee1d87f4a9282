"""The NATS side of every service: one connection with reconnect, protobuf
payloads, trace context in headers, request/reply dispatch and ordered token
streams with sequence numbers and an explicit end."""

import asyncio
import contextlib
import logging
import ssl
import time
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
from shared.runtime.bus_parts import PART_HEADER, PartsLost, Reassembler, header_value, parse_part, part_size, split
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


CONNECTION_HEADER = "Im-Connection"
"""A heartbeat's header: the sender's NATS connection as the server knows it
(`<server id>/<client id>`, Bus.connection_id), which a disconnect advisory names too."""


class StreamTimeout(TimeoutError):
    """A stream fell silent for longer than allowed."""


class StreamLost(Exception):
    """Chunks of a stream were lost on the way (not the sender's fault): a seq
    never came while later ones did, or the stream said nothing after the bus
    came back from an outage within the time it was given."""


GAP_TIMEOUT_S = 0.5
"""How long a stream may miss a seq while later ones have arrived before it counts
as lost. NATS keeps one publisher's messages in order to a subscriber, so a gap is
a loss (a server that died holding them, a reconnect that beat ours, a slow
consumer cut off); the wait only spares a reordering nobody has seen."""

_WAKE = object()
"""Put in a reader's queue to make chunks() look at its deadlines again."""


class Bus:
    """One NATS connection. While nats-py reconnects (a NATS restart, a network
    blip) its publishes are buffered and sent once it is back, and its
    subscriptions are made again; but what the server held when it died, and what
    others published to us while we were away, is gone. `down_since` and
    `reconnected_at` say where the connection stands (monotonic clock), and the
    callbacks in `on_disconnected` / `on_reconnected` hear each change, so that
    a service can tell its own outage from its peers' silence."""

    def __init__(self, nc: NATS, request_timeout_s: float) -> None:
        self.nc = nc
        self.request_timeout_s = request_timeout_s
        self.closing = False
        self.down_since: float | None = None
        """When the connection was lost (monotonic), while it is; None while connected."""
        self.reconnected_at: float | None = None
        """When it last came back (monotonic); None if it never dropped."""
        self.on_disconnected: list[Callable[[], None]] = []
        self.on_reconnected: list[Callable[[], None]] = []

    @property
    def connected(self) -> bool:
        return self.down_since is None and self.nc.is_connected

    def _disconnected(self) -> None:
        if self.down_since is not None:
            return
        self.down_since = time.monotonic()
        for callback in self.on_disconnected:
            try:
                callback()
            except Exception:
                log.exception("a disconnect callback failed")

    def _reconnected(self) -> None:
        self.down_since = None
        self.reconnected_at = time.monotonic()
        for callback in self.on_reconnected:
            try:
                callback()
            except Exception:
                log.exception("a reconnect callback failed")

    def connection_id(self) -> str:
        """This connection as the server names it, `<server id>/<client id>` (a new one
        after each reconnect); "" when unknown."""
        info = getattr(self.nc, "_server_info", None) or {}
        server, client = info.get("server_id"), info.get("client_id")
        return f"{server}/{client}" if server and client is not None else ""

    async def wait_connected(self, timeout_s: float) -> bool:
        """Wait until the connection is up, at most timeout_s; whether it is."""
        deadline = time.monotonic() + timeout_s
        while not self.connected and not self.closing and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.connected

    @classmethod
    async def connect(cls, settings: NatsSettings, name: str) -> "Bus":
        bus = cls(TlsOnlyClient(), settings.request_timeout_s)
        password, tls = nats_password(settings), nats_tls(settings)  # bad files fail here, before any retry

        async def on_error(exc: Exception) -> None:
            log.warning("nats: %s", exc)

        async def on_disconnect() -> None:
            if not bus.closing:  # our own drain disconnects too: not worth a warning
                log.warning("nats: disconnected, reconnecting")
                bus._disconnected()

        async def on_reconnect() -> None:
            log.info("nats: reconnected")
            bus._reconnected()

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

    async def _send_parts(self, subject: str, data: bytes, headers: dict[str, str]) -> tuple[bytes, dict[str, str]]:
        """Publish all but the last part of data when it does not fit one message of
        the server's max_payload (bus_parts.py); the last part and its headers, for the
        caller to publish or request with. MessageTooLarge past MAX_MESSAGE_BYTES."""
        size = part_size(self.nc.max_payload)
        if len(data) <= size:
            return data, headers
        parts = split(data, size)
        for part, chunk in parts[:-1]:
            await self.nc.publish(subject, chunk, headers={**headers, PART_HEADER: header_value(part)})
        last, chunk = parts[-1]
        return chunk, {**headers, PART_HEADER: header_value(last)}

    async def publish(self, subject: str, message: Message, headers: dict[str, str] | None = None) -> None:
        """Send message (headers: more headers, beside the trace context); in parts
        when it does not fit one NATS message."""
        data, all_headers = await self._send_parts(subject, message.SerializeToString(),
                                                   {**inject_headers(), **(headers or {})})  # fmt: skip
        await self.nc.publish(subject, data, headers=all_headers)

    async def request(self, subject: str, message: Message, reply_type: type[R], timeout: float | None = None) -> R:
        """Send (in parts when it does not fit one NATS message: the last carries the
        reply inbox) and wait for the reply; nats.errors.NoRespondersError when nobody
        listens, nats.errors.TimeoutError when nobody answers in time."""
        data, headers = await self._send_parts(subject, message.SerializeToString(), inject_headers())
        msg = await self.nc.request(subject, data, timeout=timeout or self.request_timeout_s, headers=headers)
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
        with_headers: bool = False,
    ) -> Subscription:
        """Run handler(payload) for each message under the sender's trace context
        (handler(payload, subject) with_subject: where a wildcard subscription
        needs the subject, which names the sender; handler(payload, subject, headers)
        with_headers); a returned message is sent as
        the reply when the sender asked for one. A handler's exception is logged
        and never kills the subscription. A message sent in parts is handled once,
        when its last part is in (bus_parts.py); one whose parts are lost is logged
        and, when the sender waits for a reply, answered with an error Ack."""
        parts = Reassembler()

        async def on_msg(msg: Msg) -> None:
            try:
                data = _whole(parts, msg)
            except PartsLost as exc:
                log.warning("%s: a message in parts was dropped: %s", subject, exc)
                if msg.reply:
                    err = mesh_pb2.Ack(accepted=False, code=mesh_pb2.ERROR_CODE_OVERLOADED, message=str(exc))
                    await msg.respond(err.SerializeToString())
                return
            if data is None:
                return  # more parts to come
            token = otel_context.attach(extract_context(msg.headers))
            try:
                payload = message_type()
                payload.ParseFromString(data)
                if with_headers:
                    reply = await handler(payload, msg.subject, msg.headers or {})
                elif with_subject:
                    reply = await handler(payload, msg.subject)
                else:
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


def _whole(parts: Reassembler, msg: Msg) -> bytes | None:
    """msg's bytes, or with a part the whole message once its last part is in (None before)."""
    part = parse_part(msg.headers)
    if part is None:
        return msg.data
    whole = parts.add(part, msg.data)
    if parts.num_expired:
        log.warning("%s: %d messages in parts dropped, a part never came", msg.subject, parts.num_expired)
        parts.num_expired = 0
    return whole


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
    (the instance left the mesh).

    Loss: a seq missing for GAP_TIMEOUT_S while later ones arrived, or nothing
    at all by the deadline `expect_by` set (the bus came back from an outage:
    whatever was in flight then may be gone), ends the iteration with StreamLost."""

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
        self._queue: asyncio.Queue[mesh_pb2.TokenChunk | BaseException | object] = asyncio.Queue()
        self._subs: dict[str, Subscription] = {}
        self.started = False
        """The source's first chunk came."""
        self._expect_by: float | None = None
        """A chunk must come by then (monotonic), else the stream is lost; None: no such deadline."""

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

        parts = Reassembler()  # the first chunk may be long: it carries the prompt's logprobs

        async def on_msg(msg: Msg) -> None:
            chunk = mesh_pb2.TokenChunk()
            try:
                data = _whole(parts, msg)
                if data is None:
                    return
                chunk.ParseFromString(data)
            except (DecodeError, PartsLost):
                self._reject("malformed", chunk)
                return
            if chunk.instance_id != instance_id:
                self._reject("instance_mismatch", chunk)
            elif chunk.request_id != self.request_id:
                self._reject("request_mismatch", chunk)
            elif instance_id != self.source and not chunk.error:
                self._reject("not_the_source", chunk)
            else:
                self._expect_by = None
                self._queue.put_nowait(chunk)
                if self.on_accepted is not None:
                    self.on_accepted(chunk)

        subject = subjects.stream(instance_id, self.request_id)
        self._subs[instance_id] = await self.bus.nc.subscribe(subject, cb=on_msg, pending_msgs_limit=65536)

    def fail(self, exc: BaseException) -> None:
        """End the iteration with exc (from the event loop's thread)."""
        self._queue.put_nowait(exc)

    def expect_by(self, deadline: float) -> None:
        """Some chunk must arrive by deadline (monotonic) or the stream counts as lost
        (StreamLost): the bus just came back and what was in flight may be gone. An
        earlier deadline already set stands."""
        self._expect_by = deadline if self._expect_by is None else min(self._expect_by, deadline)
        self._queue.put_nowait(_WAKE)

    @property
    def expecting(self) -> bool:
        """A deadline set by expect_by is pending (no chunk since)."""
        return self._expect_by is not None

    def _reject(self, reason: str, chunk: mesh_pb2.TokenChunk) -> None:
        if self.on_rejected is not None:
            self.on_rejected(reason, chunk)

    async def chunks(self, first_timeout_s: float, idle_timeout_s: float) -> AsyncIterator[mesh_pb2.TokenChunk]:
        next_seq = 0
        pending: dict[int, mesh_pb2.TokenChunk] = {}
        timeout = first_timeout_s
        silent_since = time.monotonic()
        gap_since: float | None = None  # since when a later seq waits for a missing one
        while True:
            now = time.monotonic()
            wait = silent_since + timeout - now
            if gap_since is not None:
                wait = min(wait, gap_since + GAP_TIMEOUT_S - now)
            if self._expect_by is not None:
                wait = min(wait, self._expect_by - now)
            try:
                item = await asyncio.wait_for(self._queue.get(), max(wait, 0.0))
            except TimeoutError:
                now = time.monotonic()
                where = f"{self.source}'s stream of {self.request_id}"
                if gap_since is not None and now >= gap_since + GAP_TIMEOUT_S:
                    raise StreamLost(f"chunk {next_seq} of {where} never came, later ones did") from None
                if self._expect_by is not None and now >= self._expect_by:
                    raise StreamLost(f"nothing on {where} since NATS came back (chunk {next_seq} next)") from None
                if now >= silent_since + timeout:
                    raise StreamTimeout(f"no chunk {next_seq} on {where} within {timeout:.1f}s") from None
                continue
            if item is _WAKE:
                continue
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, mesh_pb2.TokenChunk)
            if item.instance_id != self.source:  # an error from an instance before the source (listen checked)
                yield item
                return
            timeout = idle_timeout_s
            silent_since = time.monotonic()
            self.started = True
            if item.seq < next_seq or item.seq in pending:
                self._reject("duplicate_seq", item)
                continue
            pending[item.seq] = item
            if next_seq in pending:
                gap_since = None  # the gap, if any, is filled
            while next_seq in pending:
                ready = pending.pop(next_seq)
                next_seq += 1
                yield ready
                if ready.final:
                    return
            if pending and gap_since is None:
                gap_since = time.monotonic()
