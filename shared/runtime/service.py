"""The one service skeleton (after the nats.micro and gRPC AsyncIO examples).

    python -m services.<stage>  →  run_service("<stage>", setup)

Binds and credentials come from settings: gRPC and /metrics listen on
worker.bind_host (loopback by default), NATS logs in as nats.user, gRPC
calls carry this service's own worker.grpc_token, and its gRPC server takes
the identities of worker.grpc_peers (shared/runtime/rpc.py); a service that
serves gRPC beyond loopback without them refuses to start, at once.

SIGTERM/SIGINT set an event; an AsyncExitStack enters NATS, metrics and
whatever `setup` adds (gRPC server, engine, subscriptions); on the event the
stack unwinds in reverse: setup's own callbacks first (flip health to
NOT_SERVING, stop intake, drain in-flight work under a timeout), NATS last.
"""

import asyncio
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

from opentelemetry.trace import Tracer

from shared.runtime import rpc
from shared.runtime.bus import Bus
from shared.runtime.metrics import Metrics
from shared.runtime.settings import Settings, load_settings
from shared.runtime.subjects import check_token
from shared.runtime.telemetry import setup_telemetry

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServiceContext:
    stage: str
    instance_id: str
    settings: Settings
    bus: Bus
    """The service's NATS connection (None only in a service run with nats=False: the
    planner, which reads HTTP metrics and never the bus)."""
    tracer: Tracer
    metrics: Metrics
    stop: asyncio.Event
    failure: str | None = None
    """Why the service stops on its own (``fail``); None while it runs, or stops on a signal."""

    def fail(self, reason: str) -> None:
        """What the service serves is gone (its engine died): stop as on SIGTERM (the
        stack unwinds: NOT_SERVING, drain, NATS last, so the balancer sees the instance
        leave), then exit non-zero, so that a supervisor restarts it."""
        if self.failure is None:
            log.error("%s fails: %s", self.instance_id, reason)
            self.failure = reason
        self.stop.set()


Setup = Callable[[ServiceContext, AsyncExitStack], Awaitable[None]]


def default_instance_id(stage: str) -> str:
    host = socket.gethostname().split(".")[0].replace(" ", "-")
    return f"{stage}-{host}-{os.getpid()}"


async def run_service(stage: str, setup: Setup, settings: Settings | None = None, nats: bool = True,
                      grpc_server: bool = True) -> int:
    """Serve until SIGTERM/SIGINT (exit code 0) or until the service fails (ctx.fail: 1).
    nats=False: no NATS login (a service with nothing to say or hear on the bus needs no
    user there). grpc_server=False: the service serves no gRPC (the balancer, the
    planner), so it needs no peers list wherever it binds."""
    settings = settings or load_settings()
    instance_id = check_token(settings.worker.instance_id or default_instance_id(stage))
    # Every gRPC server and channel of this process binds worker.bind_host and carries its token.
    try:
        rpc.configure_from(settings.worker)  # token, peers, bind host and (mutual) TLS files
        if grpc_server:
            rpc.require_server_credentials()  # fail closed now, not after an engine loaded for minutes
    except ValueError as exc:  # settings that cannot work: say which, exit 1, no traceback
        raise SystemExit(f"{stage}: {exc}") from None
    provider = setup_telemetry(stage, instance_id, settings.telemetry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with AsyncExitStack() as stack:
            bus = await Bus.connect(settings.nats, name=instance_id) if nats else None
            if bus is not None:
                stack.push_async_callback(bus.close)
            metrics = Metrics(stage)
            metrics_port = metrics.serve(settings.worker.metrics_port, host=settings.worker.bind_host)
            stack.callback(metrics.close)
            ctx = ServiceContext(stage, instance_id, settings, bus, provider.get_tracer(stage), metrics, stop)  # type: ignore[arg-type]
            await setup(ctx, stack)
            # What the imports and setup made (the model, the KV block pool, CUDA graphs, the
            # servers) lives as long as the process: frozen, the collector's full passes no
            # longer walk it. A pass over the ~175k objects of a decode process took 78 ms on
            # a 2-core machine, a stall of every request in the batch (vLLM freezes too).
            gc.collect()
            gc.freeze()
            if not metrics.has_readiness:
                # /ready on the metrics port: a service whose setup said nothing more
                # (kvcache) is ready once set up, until it stops; workers say their own.
                metrics.set_readiness(lambda: "stopping" if stop.is_set() else None)
            log.info("%s ready (metrics on %s:%d)", instance_id, settings.worker.bind_host, metrics_port)
            await stop.wait()
            log.info("%s stopping", instance_id)
    finally:
        provider.shutdown()
    return 0 if ctx.failure is None else 1


def main(stage: str, setup: Setup, nats: bool = True, grpc_server: bool = True) -> None:
    sys.exit(asyncio.run(run_service(stage, setup, nats=nats, grpc_server=grpc_server)))
