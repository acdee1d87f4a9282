"""The vision stage: encodes requests' images for prefill and decode (E/P/D).

The balancer sends a request's images (EncodeRequest, the wire's lossless PNGs and
their identities) to one vision instance and waits for the reply. For each image the
instance looks, in order, in its own embedding cache (device, then host memory: a
hit), in kvcache (a restarted instance, or one the balancer did not pick last time:
no encode), and otherwise decodes the PNG and queues it for the tower. Queued images
of concurrent requests go through the processor and the tower together, in batches
of up to vision.max_batch_images (off the event loop). The embeddings of newly
encoded images are stored in kvcache under the image's identity, with a ttl, before
the reply: prefill and decode fetch them from there by that identity
(shared/stage/embeddings.py). kvcache is the path every deployment has. Where
vision.share_bytes allows, each image's embeddings are also written into a ring in
shared memory and the reply says where (EncodeReply.peer_sources): prefill and decode on
this host, in this PID namespace, copy them straight out (shared/stage/embedding_share.py),
and fall back to kvcache when they cannot. With vision.nixl (and kv_transfer.nixl) the
ring is also registered with the instance's NIXL agent, which answers readers' metadata
asks on subjects.kv_nixl as prefill does for KV: prefill and decode in another
container, pod or node READ the entries through NIXL (shared/stage/embedding_nixl.py).

An instance that dies mid-request answers nothing: the balancer asks another one or,
with none left, lets prefill encode (services/balancer/router/vision.py). Heartbeats
carry the load (images queued and in the tower) and the identities the cache holds
(the balancer's affinity); /metrics has images encoded, batch sizes, encode seconds
and cache hits by tier; each request's work is an "encode" span of its trace.

The model's vision tower is loaded alone (shared/model/tower_loader.py): only its
tensors are read from the checkpoint, and the language model is never built."""

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from shared.engine.dtypes import torch_dtype
from shared.kv.wire.client import KVCacheClient
from shared.kv.wire.nixl import NixlAgent, NixlUnavailable, agent_name
from shared.model.vision.mrope import GridTHW
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.heartbeat import BeatIdentity, BeatState, Heartbeats
from shared.runtime.metrics import Metrics
from shared.runtime.rpc import GrpcServer, start_grpc_server
from shared.runtime.service import ServiceContext
from shared.stage.convert import image_from_proto
from shared.stage.embedding_share import EmbeddingArena
from shared.stage.embedding_nixl import offer_arena
from shared.stage.embeddings import from_blob, to_blob
from services.vision.cache import EmbeddingCache

if TYPE_CHECKING:
    from shared.model.vision.processor import ImageProcessor

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
REFUSED_CODE = "invalid_image"
"""The code of EncodeReply.code_param (`<code>:images.<k>`) for an image no instance could read."""


class RefusedImage(Exception):
    """An image of the request that cannot be read (a damaged PNG, another size than the
    message says, an identity that is not 32 bytes): the same on every instance, so the
    reply says so (code_param) and the balancer answers 400 instead of asking another."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class _Queued:
    """An image waiting for the tower, and who waits for its embeddings."""

    key: bytes
    pixels: np.ndarray
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Encoder:
    """The processor and the tower over batches of queued images (one batch at a time:
    a second would only contend for the same cores or device)."""

    def __init__(self, model: torch.nn.Module, processor: "ImageProcessor", max_batch: int, wait_s: float,
                 metrics: Metrics) -> None:  # fmt: skip
        self.model = model
        self.processor = processor
        self.max_batch = max_batch
        self.wait_s = wait_s
        self.queue: asyncio.Queue[_Queued] = asyncio.Queue()
        self.running = 0
        self.gathering = 0
        """Images taken for the next batch while it waits for more (queued still, as load)."""
        self.m_batch = metrics.histogram("batch_images", "Images per tower batch", buckets=BATCH_BUCKETS)
        self.m_seconds = metrics.histogram("encode_seconds", "Processor and tower time per batch")
        self.m_encoded = metrics.counter("images_encoded_total", "Images run through the vision tower")
        # What the heartbeat's load says (images queued, gathered and in the tower): the HPA's queue.
        self.m_queued = metrics.gauge("queued_images", "Images waiting for the tower or in it")
        self.m_queued.set_function(lambda: self.waiting + self.running)

    @property
    def waiting(self) -> int:
        return self.queue.qsize() + self.gathering

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + self.wait_s
            while len(batch) < self.max_batch:
                self.gathering = len(batch)
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), max(deadline - loop.time(), 0.0)))
                except TimeoutError:
                    break
            self.gathering = 0
            batch = [q for q in batch if not q.done.done()]  # its requests gave up
            if not batch:
                continue
            self.running = len(batch)
            started = time.perf_counter()
            try:
                results = await asyncio.to_thread(self._encode, [q.pixels for q in batch])
            except Exception as exc:  # every waiter hears it; the loop goes on
                log.exception("encoding a batch of %d images failed", len(batch))
                for q in batch:
                    if not q.done.done():
                        q.done.set_exception(exc)
                continue
            finally:
                self.running = 0
            self.m_seconds.observe(time.perf_counter() - started)
            self.m_batch.observe(len(batch))
            self.m_encoded.inc(len(batch))
            for q, result in zip(batch, results):
                if not q.done.done():
                    q.done.set_result(result)

    def _encode(self, pixels: list[np.ndarray]) -> list[tuple[torch.Tensor, GridTHW]]:
        inputs = self.processor(pixels)
        with torch.inference_mode():
            embeds = self.model.encode_images(inputs)
        return list(zip(embeds, inputs.grids))


class VisionService:
    def __init__(self, ctx: ServiceContext, encoder: Encoder, kvcache: KVCacheClient,
                 arena: EmbeddingArena | None = None) -> None:  # fmt: skip
        """arena: where embeddings are offered to prefill on this host (None: kvcache only)."""
        self.ctx = ctx
        self.encoder = encoder
        self.kvcache = kvcache
        self.arena = arena
        v = ctx.settings.vision
        self.cache = EmbeddingCache(v.cache_device_bytes, v.cache_host_bytes)
        self._in_flight: dict[bytes, asyncio.Future] = {}
        self.draining = False
        self.heartbeats = Heartbeats(ctx.bus, BeatIdentity.of(ctx), self._beat_state)
        self._tasks: list[asyncio.Task] = []
        m = ctx.metrics
        self.m_requests = m.counter("requests_total", "Encode requests by outcome", ("outcome",))
        self.m_lookups = m.counter("cache_lookups_total", "Images looked up, by where they were found "
                                   "(memory: this instance's cache; kvcache; miss: encoded)", ("result",))
        self.m_cache_images = m.gauge("cache_images", "Images whose embeddings this instance holds")
        self.m_cache_bytes = m.gauge("cache_bytes", "Bytes of embeddings held, by tier", ("tier",))
        self.m_store_failures = m.counter("kvcache_store_failures_total", "Embeddings kvcache did not take")

    async def on_encode(self, req: mesh_pb2.EncodeRequest) -> mesh_pb2.EncodeReply:
        reply = mesh_pb2.EncodeReply(instance_id=self.ctx.instance_id)
        if self.draining:
            reply.error = "draining"
            return reply
        with self.ctx.tracer.start_as_current_span("encode") as span:
            span.set_attribute("request.id", req.request_id)
            span.set_attribute("images.count", len(req.images))
            try:
                await self._encode(req, reply)
                try:
                    await self._share(req, reply)
                except Exception as exc:  # kvcache holds them already: prefill reads them there
                    log.warning("offering the embeddings of %s in shared memory failed: %s", req.request_id, exc)
                    del reply.peer_sources[:]
                reply.ok = True
                self.m_requests.labels("ok").inc()
            except RefusedImage as exc:  # the request's fault: no other instance would read it either
                log.info("refused the images of %s: %s", req.request_id, exc)
                span.set_attribute("images.refused", exc.param)
                reply.error = str(exc)
                reply.code_param = f"{REFUSED_CODE}:{exc.param}"
                self.m_requests.labels("refused").inc()
            except Exception as exc:  # the balancer moves on (another instance, or prefill encodes)
                log.warning("encoding the images of %s failed: %s", req.request_id, exc)
                span.record_exception(exc)
                reply.error = str(exc)
                self.m_requests.labels("error").inc()
            span.set_attribute("images.cache_hits", reply.num_cache_hits)
            span.set_attribute("images.kvcache_hits", reply.num_kvcache_hits)
            span.set_attribute("images.encoded", reply.num_encoded)
        self._report_cache()
        return reply

    async def _encode(self, req: mesh_pb2.EncodeRequest, reply: mesh_pb2.EncodeReply) -> None:
        keys = [bytes(msg.hash) for msg in req.images]
        reuse = self.ctx.settings.vision.reuse_embeddings
        missing = [k for k in dict.fromkeys(keys) if not reuse or self.cache.get(k) is None]
        reply.num_cache_hits = len(keys) - len([k for k in keys if k in missing])
        self.m_lookups.labels("memory").inc(reply.num_cache_hits)
        if missing and reuse:  # held by kvcache already (a restart, another instance's work): no encode
            try:
                found = await self.kvcache.get_blobs(missing, timeout_s=self.ctx.settings.vision.fetch_timeout_s)
            except Exception as exc:  # kvcache down: encode; the store below will say so too
                log.warning("looking up embeddings in kvcache failed: %s", exc)
                found = {}
            for key, (layout, data) in found.items():
                embeds, grid = await asyncio.to_thread(from_blob, layout, data)
                self.cache.put(key, embeds, grid)
            reply.num_kvcache_hits = len(found)
            self.m_lookups.labels("kvcache").inc(len(found))
            missing = [k for k in missing if k not in found]
        if not missing:
            return
        by_key = {bytes(msg.hash): msg for msg in req.images}
        # Every image read before any is queued: one that cannot be read refuses the request
        # with nothing of it left in the tower's queue.
        unread = [k for k in missing if k not in self._in_flight]
        decoded = await asyncio.to_thread(_read_images, {k: (by_key[k], f"images.{keys.index(k)}") for k in unread})
        waits, mine = [], []
        for key in missing:
            pending = self._in_flight.get(key)  # the same image of a concurrent request: encoded once
            if pending is None:
                pixels = decoded.get(key)
                if pixels is None:  # another request had it in flight, and it finished meanwhile
                    pixels = await asyncio.to_thread(image_from_proto, by_key[key], f"images.{keys.index(key)}")
                queued = _Queued(key, pixels)
                self._in_flight[key] = pending = queued.done
                self.encoder.queue.put_nowait(queued)
                mine.append(key)
            waits.append((key, pending))
        self.m_lookups.labels("miss").inc(len(mine))
        try:
            results = {key: await pending for key, pending in waits}
        finally:
            for key in mine:
                self._in_flight.pop(key, None)
        for key in mine:
            self.cache.put(key, *results[key])
        reply.num_encoded = len(mine)
        # Before the reply: prefill fetches them as soon as the balancer hears it.
        blobs = await asyncio.to_thread(lambda: [(k, *to_blob(*results[k])) for k in missing])
        try:
            await self.kvcache.put_blobs(blobs, self.ctx.settings.vision.embedding_ttl_s)
        except Exception:
            self.m_store_failures.inc()
            raise

    async def _share(self, req: mesh_pb2.EncodeRequest, reply: mesh_pb2.EncodeReply) -> None:
        """Each image's embeddings in the arena, and where, in the reply (empty where they
        are not: no arena, too large, dropped from the cache meanwhile)."""
        if self.arena is None:
            return
        arena, sources = self.arena, []
        for msg in req.images:
            key = bytes(msg.hash)
            source = arena.get(key)
            entry = self.cache.get(key) if source is None else None
            if entry is not None:
                layout, data = await asyncio.to_thread(to_blob, entry.embeds, entry.grid)
                source = arena.put(key, layout, data)
            sources.append(source.to_bytes() if source is not None else b"")
        reply.peer_sources.extend(sources)

    def _report_cache(self) -> None:
        self.m_cache_images.set(len(self.cache))
        self.m_cache_bytes.labels("device").set(self.cache.used_device)
        self.m_cache_bytes.labels("host").set(self.cache.used_host)

    # -- registration, as the engine stages (shared/stage/worker.py) ----------------

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self.encoder.run(), name="encoder"), self.heartbeats.start()]

    async def stop(self) -> None:
        """Drain: say so, let requests in the tower finish (bounded), then stop."""
        self.draining = True
        await self.heartbeats.send()
        deadline = time.monotonic() + self.ctx.settings.worker.drain_timeout_s
        while (self.encoder.waiting or self.encoder.running or self._in_flight) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in self._tasks:
            task.cancel()

    def not_ready(self) -> str | None:
        if self.draining:
            return "draining"
        if not self.ctx.bus.nc.is_connected:
            return "not connected to NATS"
        return None if self.heartbeats.registered else "not registered on the bus yet"

    def _beat_state(self) -> BeatState:
        """The load (images queued and in the tower) and the identities the cache holds."""
        load = mesh_pb2.Load(num_running=self.encoder.running, num_waiting=self.encoder.waiting)
        hashes = self.cache.recent(self.ctx.settings.vision.heartbeat_hashes)
        return BeatState(load, self.draining, hashes)


def _read_images(images: dict[bytes, tuple[mesh_pb2.ImageData, str]]) -> dict[bytes, np.ndarray]:
    """Each image's pixels by identity; RefusedImage naming the first that cannot be read."""
    out = {}
    for key, (msg, param) in images.items():
        try:
            out[key] = image_from_proto(msg, param)
        except ValueError as exc:
            raise RefusedImage(param, str(exc)) from None
    return out


async def _offer_through_nixl(ctx: ServiceContext, stack: AsyncExitStack, arena: EmbeddingArena) -> None:
    """Register the arena with an agent of this process and answer readers' metadata
    asks (once per reader); without NIXL, readers that cannot map it use kvcache."""
    try:  # UCX takes a moment to start: off the loop
        agent = await asyncio.to_thread(NixlAgent, agent_name(ctx.instance_id), ctx.settings.kv_transfer.backends,
                                        loopback_only=ctx.settings.worker.binds_loopback)  # fmt: skip
    except NixlUnavailable as exc:
        log.warning("no NIXL path for embeddings (%s): other containers and hosts read them from kvcache", exc)
        return
    stack.callback(agent.close)  # unwinds before the arena's close, registered earlier
    registration = offer_arena(arena, agent, ctx.instance_id)

    async def on_metadata(_: mesh_pb2.NixlMetadataRequest) -> mesh_pb2.NixlMetadata:
        return mesh_pb2.NixlMetadata(agent=agent.name, metadata=agent.metadata(only=registration))  # the arena alone

    sub = await ctx.bus.subscribe(subjects.kv_nixl(ctx.instance_id), mesh_pb2.NixlMetadataRequest, on_metadata)
    stack.push_async_callback(sub.unsubscribe)
    log.info("NIXL agent %s: the embedding arena (%d bytes) registered", agent.name, arena.nbytes)


async def setup(ctx: ServiceContext, stack: AsyncExitStack) -> None:
    from shared.model.tower_loader import NoVisionTower, load_vision_tower
    from shared.model.vision.processor import ImageProcessor

    engine = ctx.settings.engine
    try:  # the tower alone: the language model's weights are never read here
        model = await asyncio.to_thread(load_vision_tower, engine.model, torch_dtype(engine.dtype), engine.device)
    except NoVisionTower as exc:
        raise SystemExit(f"{exc}: a vision instance has nothing to encode") from None
    processor = await asyncio.to_thread(ImageProcessor, engine.model)
    v = ctx.settings.vision
    encoder = Encoder(model, processor, v.max_batch_images, v.batch_wait_s, ctx.metrics)
    kv = ctx.settings.kvcache
    kvcache = KVCacheClient(kv.address, chunk_bytes=kv.chunk_bytes, timeout_s=v.encode_timeout_s, shm_bytes=0)
    stack.push_async_callback(kvcache.close)
    arena = None
    if v.share_bytes > 0:
        try:
            arena = EmbeddingArena(v.share_bytes, engine.kv_share_dir)
            stack.callback(arena.close)
        except OSError as exc:  # no room in /dev/shm: prefill reads kvcache, as without one
            log.warning("no shared embedding arena (%s): embeddings reach prefill through kvcache only", exc)
    if arena is not None and v.nixl and ctx.settings.kv_transfer.nixl:
        await _offer_through_nixl(ctx, stack, arena)
    service = VisionService(ctx, encoder, kvcache, arena)
    grpc: GrpcServer = await start_grpc_server(ctx.settings.worker.grpc_port, [], [ctx.stage])
    stack.push_async_callback(grpc.stop, 1.0)
    service.start()
    stack.push_async_callback(service.stop)  # unwinds after intake stops (below), before gRPC
    sub = await ctx.bus.subscribe(subjects.vision_encode(ctx.instance_id), mesh_pb2.EncodeRequest, service.on_encode)
    stack.push_async_callback(sub.unsubscribe)
    await grpc.set_serving(True)
    ctx.metrics.set_readiness(service.not_ready)
    log.info("%s: vision tower loaded (%s on %s), gRPC health on :%d", ctx.instance_id, engine.dtype, engine.device,
             grpc.port)
