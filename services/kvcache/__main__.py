"""python -m services.kvcache: the Block KVCache service.

Settings (env var INFERMESH_<SECTION>__<FIELD>, see shared/runtime/settings.py):
kvcache.path (LMDB folder), kvcache.capacity_bytes, kvcache.ttl_s,
kvcache.chunk_bytes, kvcache.nixl_staging_bytes, kvcache.address, worker.grpc_port,
worker.drain_timeout_s, worker.bind_host, worker.grpc_peers, kv_transfer.nixl (Gets written into
clients' buffers through NIXL), kv_transfer.nixl_backends,
kv_transfer.nixl_transfer_timeout_s, nats.url, nats.user, nats.password, telemetry.*.

Port rule: workers dial kvcache.address, so by default the service binds the
port of that address, on worker.bind_host (loopback unless told otherwise:
containers and pods set 0.0.0.0); every call but health needs the token of
an identity in worker.grpc_peers, and that identity must be one the method is
for (services/kvcache/access.py: only prefill and decode store blocks). worker.grpc_port, when non-zero,
wins: for a deployment where the address workers dial is a proxy or a
Kubernetes Service whose port differs from the container's. The service never
picks a random port: nobody could find it.
"""

import asyncio
import contextlib
import logging
from contextlib import AsyncExitStack

from services.kvcache.access import ACCESS
from services.kvcache.nixl_get import NixlServer
from services.kvcache.servicer import SERVICE_NAME, KVCacheMetrics, KVCacheServicer, KvEventPublisher
from services.kvcache.store import BlockStore
from shared.kv.wire.nixl import agent_name
from shared.proto import kvcache_pb2_grpc
from shared.runtime.rpc import start_grpc_server
from shared.runtime.service import ServiceContext, main
from shared.runtime.settings import Settings

log = logging.getLogger(__name__)


def bind_port(settings: Settings) -> int:
    """The port rule above."""
    if settings.worker.grpc_port:
        return settings.worker.grpc_port
    address = settings.kvcache.address
    _, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) == 0:
        raise ValueError(f"kvcache.address {address!r} has no port to bind: give host:port, "
                         "or set worker.grpc_port")
    return int(port)


def sweep_interval_s(ttl_s: float) -> float:
    """Expired blocks are never served (checked on access); the sweep only frees
    their space and flushes LMDB to disk, so once a minute is plenty, and a
    tiny ttl (tests) sweeps at least every second."""
    return min(60.0, max(1.0, ttl_s / 10))


async def sweep_forever(servicer: KVCacheServicer, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await servicer.sweep()
        except Exception:
            log.exception("expiry sweep failed; retrying in %.0fs", interval_s)


SEGMENT_PRUNE_INTERVAL_S = 2.0
"""How often the mappings of clients' shared-memory segments that their clients
closed (or died with) are dropped, which frees that memory."""


async def prune_forever(servicer: KVCacheServicer) -> None:
    while True:
        await asyncio.sleep(SEGMENT_PRUNE_INTERVAL_S)
        try:
            await asyncio.to_thread(servicer.prune_segments)
        except Exception:
            log.exception("pruning shared-memory segments failed")


async def cancel_task(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def setup(ctx: ServiceContext, stack: AsyncExitStack) -> None:
    kv = ctx.settings.kvcache
    port = bind_port(ctx.settings)
    store = await asyncio.to_thread(BlockStore, kv.path, kv.capacity_bytes, kv.ttl_s,
                                    blob_capacity_bytes=kv.blob_capacity_bytes)
    stack.callback(store.close)  # unwinds last: after the server stopped and the sweep ended
    transfer = ctx.settings.kv_transfer
    backends = transfer.backends
    # The agent starts in a thread (UCX takes a moment); it stays None when it cannot start.
    nixl = await asyncio.to_thread(NixlServer, agent_name(ctx.instance_id) if transfer.nixl else None,
                                   backends, kv.nixl_staging_bytes, transfer.nixl_transfer_timeout_s,
                                   ctx.settings.worker.binds_loopback)  # fmt: skip
    servicer = KVCacheServicer(store, KvEventPublisher(ctx.bus, ctx.instance_id), KVCacheMetrics(ctx.metrics),
                               kv.chunk_bytes, nixl)
    stack.callback(servicer.close)  # unwinds after the server stopped, before the store closes
    server = await start_grpc_server(port, [(kvcache_pb2_grpc.add_KVCacheServicer_to_server, servicer)],
                                     [SERVICE_NAME], access=ACCESS)
    # Flips NOT_SERVING, then lets in-flight calls finish for up to drain_timeout_s.
    stack.push_async_callback(server.stop, ctx.settings.worker.drain_timeout_s)
    sweeper = asyncio.create_task(sweep_forever(servicer, sweep_interval_s(kv.ttl_s)))
    stack.push_async_callback(cancel_task, sweeper)
    pruner = asyncio.create_task(prune_forever(servicer))
    stack.push_async_callback(cancel_task, pruner)
    await servicer.refresh_metrics()
    stats = await asyncio.to_thread(store.stats)
    await server.set_serving(True)
    log.info("kvcache serving on %s:%d (workers dial %s): %d blocks, %d of %d bytes in %s",
             ctx.settings.worker.bind_host, server.port, kv.address, stats.num_blocks, stats.num_bytes, stats.capacity_bytes, kv.path)


if __name__ == "__main__":
    main("kvcache", setup)
