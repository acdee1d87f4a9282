"""The gRPC side of every service: an asyncio server with grpc.health.v1,
tracing and the check of who calls (shared/runtime/rpc_auth.py), and client
channels with tracing, this service's token and large-message options.

Auth: a token per identity (worker.grpc_token, this service's own), which
servers know by its hash (worker.grpc_peers); every call but grpc.health.v1
without a known one gets UNAUTHENTICATED before a servicer runs, and a server
with an access table (kvcache) refuses an identity a method is not for with
PERMISSION_DENIED. A server bound beyond loopback without a peers list refuses
to start. Health stays open because Kubernetes' gRPC probes and compose health
checks cannot send metadata, and it reveals one bit (SERVING or not). The
process's token, peers and bind host are set once at start (configure(), from
settings, by the service skeleton), so the servers and channels made deep
inside a service (the Worker's server, KVCacheClient's channel) use them
without threading them through every constructor.

Mutual TLS, besides the token, where worker.tls_cert, tls_key and tls_ca are
set (Helm does, with a CA and a certificate per service of its own making):
servers take only TLS connections that present a client certificate signed by
the CA, clients present theirs and check the server's against the same CA (and
its name against the address they dial). A client without a certificate, or
with one of another CA, fails the handshake before any call, health included.
`infermesh up` keeps the tokens alone (every process on one host, loopback).
The certificate checks are gRPC's own (BoringSSL), not code of ours."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor

from shared.runtime.rpc_auth import AUTH_HEADER, Access, IdentityInterceptor, Peers, require_credentials

# Blocks are streamed in chunks, but leave room for a chunk plus framing.
MAX_MESSAGE_BYTES = 64 << 20
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class TlsPaths(Protocol):
    """Where the PEM files are (settings.WorkerSettings has these fields)."""

    tls_cert: str | None
    tls_key: str | None
    tls_ca: str | None


class RpcSettings(TlsPaths, Protocol):
    """What configure_from reads (settings.WorkerSettings)."""

    grpc_token: str | None
    grpc_peers: str | None
    bind_host: str


@dataclass(slots=True, frozen=True)
class TlsFiles:
    """This process's certificate chain and key, and the mesh's CA (PEM bytes)."""

    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def load(cls, paths: TlsPaths) -> "TlsFiles | None":
        """Read the three files; None when none is set; a ValueError naming the
        settings when only some are (a half-configured TLS must not fall back to plain)."""
        named = {"worker.tls_cert": paths.tls_cert, "worker.tls_key": paths.tls_key, "worker.tls_ca": paths.tls_ca}
        missing = [name for name, path in named.items() if not path]
        if len(missing) == len(named):
            return None
        if missing:
            raise ValueError(f"mutual TLS needs worker.tls_cert, tls_key and tls_ca together; {', '.join(missing)} "
                             "is not set")
        files = []
        for name, path in named.items():
            try:
                files.append(Path(path).read_bytes())  # type: ignore[arg-type]
            except OSError as exc:
                raise ValueError(f"{name}: cannot read {path!r}: {exc.strerror}") from None
        return cls(*files)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


@dataclass(slots=True)
class RpcDefaults:
    """What servers and channels of this process use unless told otherwise."""

    token: str | None = None
    """This service's own token, which its calls carry; None: they carry nothing."""
    peers: Peers | None = None
    """Who may call this process's servers; None: they check nothing (loopback only)."""
    bind_host: str = "127.0.0.1"
    """Interface servers listen on."""
    tls: TlsFiles | None = None
    """Mutual TLS for every server and channel; None: plaintext (loopback, `up`)."""


_defaults = RpcDefaults()


def configure(token: str | None, bind_host: str, tls: TlsFiles | None = None, peers: Peers | None = None) -> None:
    """Set this process's token, bind host, TLS files and peers (the service skeleton calls it from settings)."""
    _defaults.token = token or None
    _defaults.bind_host = bind_host
    _defaults.tls = tls
    _defaults.peers = peers


def configure_from(worker: RpcSettings) -> None:
    """configure() from the settings' worker section: token, bind host, TLS files, peers."""
    configure(worker.grpc_token, worker.bind_host, TlsFiles.load(worker), Peers.parse(worker.grpc_peers))


class GrpcServer:
    """A started server: its port, and its health to flip (overall status "" and
    each named service move together)."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer: health.aio.HealthServicer,
                 service_names: list[str]) -> None:
        self.server = server
        self.port = port
        self.health = health_servicer
        self.service_names = ["", *service_names]

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in self.service_names:
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)


def require_server_credentials() -> None:
    """The fail-closed check of start_grpc_server with the process's bind host and
    peers, for a service to make at start (a ValueError naming the settings)."""
    require_credentials(_defaults.bind_host, _defaults.peers)


async def start_grpc_server(
    port: int, servicers: list[tuple[object, object]], service_names: list[str], host: str | None = None,
    peers: Peers | None = None, tls: TlsFiles | None = None, access: Access | None = None,
) -> GrpcServer:
    """servicers: (add_XServicer_to_server function, servicer) pairs. Port 0
    picks a free port. host, peers and tls default to the process's (configure()).
    access: which identities may call which method (none: any known identity).
    A ValueError, before anything binds, for a host beyond loopback without peers.
    Health starts NOT_SERVING: the caller flips it when the service is ready
    (after its engine loaded, say)."""
    host = host or _defaults.bind_host
    peers = peers or _defaults.peers
    tls = tls or _defaults.tls
    require_credentials(host, peers)
    interceptors: list[grpc.aio.ServerInterceptor] = [aio_server_interceptor()]
    if peers is not None:
        interceptors.insert(0, IdentityInterceptor(peers, access))  # refuse before anything runs or is traced
    server = grpc.aio.server(interceptors=interceptors, options=_OPTIONS)
    for add, servicer in servicers:
        add(servicer, server)  # type: ignore[operator]
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server on {host}:{port}")
    await server.start()
    out = GrpcServer(server, bound, health_servicer, service_names)
    await out.set_serving(False)
    return out


class _AddToken:
    """Adds the bearer token to a call's metadata (an insecure channel takes no call credentials)."""

    def __init__(self, token: str) -> None:
        self.pair = (AUTH_HEADER, f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self.pair)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


# grpc.aio files an interceptor under its first matching call shape only: one class per shape.
class _TokenUnaryUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001
        return await continuation(self._details(details), request)


class _TokenUnaryStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001
        return await continuation(self._details(details), request)


class _TokenStreamUnary(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):  # noqa: ANN001
        return await continuation(self._details(details), request_iterator)


class _TokenStreamStream(_AddToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):  # noqa: ANN001
        return await continuation(self._details(details), request_iterator)


def _channel(address: str, tls: TlsFiles | None, **kwargs: Any) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, **kwargs)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), **kwargs)


def open_channel(address: str, token: str | None = None, tls: TlsFiles | None = None) -> grpc.aio.Channel:
    """A channel whose calls carry a bearer token, over mutual TLS when set up
    (the process's own token and TLS files unless given)."""
    token = token or _defaults.token
    interceptors = list(aio_client_interceptors())
    if token:
        interceptors = [cls(token) for cls in (_TokenUnaryUnary, _TokenUnaryStream, _TokenStreamUnary,
                                               _TokenStreamStream)] + interceptors
    return _channel(address, tls or _defaults.tls, options=_OPTIONS, interceptors=interceptors)


async def check_health(address: str, timeout_s: float = 2.0, service: str = "", tls: TlsFiles | None = None) -> bool:
    """True when the server at address says SERVING (health needs no token; under
    mutual TLS it needs the handshake, with the process's certificate unless given)."""
    async with _channel(address, tls or _defaults.tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == SERVING
