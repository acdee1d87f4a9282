"""The gRPC side of every service: an asyncio server with grpc.health.v1 and
tracing, and client channels with tracing and large-message options."""

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
    port: int, servicers: list[tuple[object, object]], service_names: list[str], host: str = "0.0.0.0"
) -> GrpcServer:
    """servicers: (add_XServicer_to_server function, servicer) pairs. Port 0
    picks a free port. Health starts NOT_SERVING: the caller flips it when the
    service is ready (after its engine loaded, say)."""
    server = grpc.aio.server(interceptors=[aio_server_interceptor()], options=_OPTIONS)
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


def open_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=_OPTIONS, interceptors=aio_client_interceptors())


async def check_health(address: str, timeout_s: float = 2.0, service: str = "") -> bool:
    """True when the server at address says SERVING."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == SERVING
