"""The gRPC side of every service: an asyncio server with grpc.health.v1,
tracing and the mesh's bearer token, and client channels with tracing, the
token and large-message options.

Auth: one shared secret (worker.grpc_token) per mesh. Every call but
grpc.health.v1 must carry `authorization: Bearer <token>`, compared in
constant time; anything else gets UNAUTHENTICATED before a servicer runs.
Health stays open because Kubernetes' gRPC probes and compose health checks
cannot send metadata, and it reveals one bit (SERVING or not). The process's
token and bind host are set once at start (configure(), from settings, by the
service skeleton), so the servers and channels made deep inside a service
(the Worker's server, KVCacheClient's channel) use them without threading
them through every constructor."""

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor

# Blocks are streamed in chunks, but leave room for a chunk plus framing.
MAX_MESSAGE_BYTES = 64 << 20
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Methods that need no token (probes cannot send one).
OPEN_METHOD_PREFIX = "/grpc.health.v1.Health/"
AUTH_HEADER = "authorization"


@dataclass(slots=True)
class RpcDefaults:
    """What servers and channels of this process use unless told otherwise."""

    token: str | None = None
    """The shared bearer token; None: servers check nothing, clients send nothing."""
    bind_host: str = "127.0.0.1"
    """Interface servers listen on."""


_defaults = RpcDefaults()


def configure(token: str | None, bind_host: str) -> None:
    """Set this process's token and bind host (the service skeleton calls it from settings)."""
    _defaults.token = token or None
    _defaults.bind_host = bind_host


def bearer_ok(metadata: Any, token: str) -> bool:
    """True when the call's metadata carries `authorization: Bearer <token>` (constant-time compare)."""
    expected = f"Bearer {token}".encode()
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            got = value.encode() if isinstance(value, str) else bytes(value)
            if hmac.compare_digest(got, expected):
                return True
    return False


def _refuse(kind: str) -> Callable[..., Any]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        yield  # pragma: no cover  (makes this an async generator)

    return streaming if kind.endswith("stream") else unary


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without the bearer token (but health) with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):  # noqa: ANN001
        handler = await continuation(details)
        if details.method.startswith(OPEN_METHOD_PREFIX) or bearer_ok(details.invocation_metadata, self.token):
            return handler
        if handler is None:
            return None  # an unknown method: UNIMPLEMENTED either way
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(_refuse("stream_stream"))
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_refuse("stream_unary"))
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_refuse("unary_stream"))
        return grpc.unary_unary_rpc_method_handler(_refuse("unary_unary"))


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


async def start_grpc_server(
    port: int, servicers: list[tuple[object, object]], service_names: list[str], host: str | None = None,
    token: str | None = None,
) -> GrpcServer:
    """servicers: (add_XServicer_to_server function, servicer) pairs. Port 0
    picks a free port. host and token default to the process's (configure()).
    Health starts NOT_SERVING: the caller flips it when the service is ready
    (after its engine loaded, say)."""
    host = host or _defaults.bind_host
    token = token or _defaults.token
    interceptors: list[grpc.aio.ServerInterceptor] = [aio_server_interceptor()]
    if token:
        interceptors.insert(0, TokenInterceptor(token))  # refuse before anything runs or is traced
    server = grpc.aio.server(interceptors=interceptors, options=_OPTIONS)
    for add, servicer in servicers:
        add(servicer, server)  # type: ignore[operator]
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
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


def open_channel(address: str, token: str | None = None) -> grpc.aio.Channel:
    """A channel whose calls carry the bearer token (the process's unless given)."""
    token = token or _defaults.token
    interceptors = list(aio_client_interceptors())
    if token:
        interceptors = [cls(token) for cls in (_TokenUnaryUnary, _TokenUnaryStream, _TokenStreamUnary,
                                               _TokenStreamStream)] + interceptors
    return grpc.aio.insecure_channel(address, options=_OPTIONS, interceptors=interceptors)


async def check_health(address: str, timeout_s: float = 2.0, service: str = "") -> bool:
    """True when the server at address says SERVING (health needs no token)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == SERVING
