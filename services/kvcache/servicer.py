"""The KVCache gRPC servicer (grpc.aio) over a BlockStore.

LMDB calls block, so each one runs in a worker thread (asyncio.to_thread):
the event loop keeps streaming other calls while one reads or writes disk.
Each RPC ends by publishing one KvEvent (blocks stored and removed) on NATS
and bringing the Prometheus figures up to date with the store's.

Shared memory (shared/kv/wire/shm.py): a Get that names the client's segment
lands its blocks there. The sizes come from the index, so each block's place is
known before its data is read, and the blocks are read, verified and copied in
by a pool of threads at once (LMDB reads, XXH3 and numpy's copy release the
GIL); the stream carries one small `landed` item per block, in order. No byte
of KV crosses the event loop. A Get's stream ends only once every copy it
started has finished, so a client that saw the end may reuse its segment. A
segment the service cannot use (another host or container, a bad nonce) is
answered `shm_refused` and the blocks follow as bytes on the same stream.

NIXL (nixl_get.py): a Get that names a client's NIXL landing buffer instead (a
client in another container, pod or node) has its blocks read the same way into
the service's staging memory and WRITTEN into that buffer; `nixl_refused` and
bytes where that cannot be done. Puts keep to the stream or shared memory: a
NIXL Put would have the service READ client memory, which it never does.
"""

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from services.kvcache.nixl_get import NixlServer
from services.kvcache.store import BlockStore, LandedOutcome, PutOutcome
from shared.kv.block_hash import HASH_BYTES, BlockHash
from shared.kv.events import kv_event_messages
from shared.kv.wire.block_stream import AssembledBlock, BlockAssembler, check_chunk_bytes, iter_chunks
from shared.kv.wire.nixl_plane import NixlRefused, TargetRef
from shared.kv.wire.shm import MappedSegment, SegmentCache, SegmentRef, ShmUnavailable, place
from shared.kv.wire.stats import KVCacheStats
from shared.proto import kvcache_pb2, kvcache_pb2_grpc
from shared.runtime import subjects
from shared.runtime.bus import Bus
from shared.runtime.metrics import Metrics

log = logging.getLogger(__name__)

SERVICE_NAME = kvcache_pb2.DESCRIPTOR.services_by_name["KVCache"].full_name

READ_THREADS = min(8, os.cpu_count() or 1)
"""Threads that read, verify and land blocks of shared-memory Gets and store PutShm
blocks, shared by all calls (each block is ~1-2 ms of LMDB + hash + copy)."""


@dataclass(slots=True)
class PutTally:
    """What one Put call did."""

    stored: list[BlockHash] = field(default_factory=list)
    evicted: list[BlockHash] = field(default_factory=list)
    num_existing: int = 0
    num_bytes: int = 0

    def add(self, block_hash: BlockHash, num_bytes: int, outcome: PutOutcome) -> None:
        self.num_bytes += num_bytes
        self.evicted += outcome.evicted
        if outcome.is_new:
            self.stored.append(block_hash)
        else:
            self.num_existing += 1


@dataclass(slots=True)
class GetTally:
    """What one Get call served."""

    served: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)
    num_bytes: int = 0
    num_shm_bytes: int = 0
    num_nixl_bytes: int = 0


class KvEventPublisher:
    """This instance's block events on NATS, numbered so a receiver sees gaps.
    Receivers apply `stored`, then `removed`. A lost event costs a routing
    guess, never a wrong answer (Lookup and Get check the store), so a publish
    failure is logged and the RPC still succeeds."""

    def __init__(self, bus: Bus, instance_id: str) -> None:
        self.bus = bus
        self.instance_id = instance_id
        self.next_seq = 0

    async def publish(self, stored: Sequence[BlockHash], removed: Sequence[BlockHash]) -> None:
        for event in kv_event_messages(self.instance_id, self.next_seq, stored, removed):
            self.next_seq += 1
            try:
                await self.bus.publish(subjects.KV_EVENTS, event)
            except Exception:
                log.warning("could not publish KvEvent seq %d", event.seq, exc_info=True)


class KVCacheMetrics:
    """The Prometheus side. Block counts and hit/miss/evict/expire/corrupt
    counts come from the store (one source of truth for Stats and /metrics):
    each update adds what the store counted since the last one."""

    def __init__(self, metrics: Metrics) -> None:
        self.blocks = metrics.gauge("blocks", "Blocks held.")
        self.bytes = metrics.gauge("bytes", "Data bytes of the blocks held.")
        self.capacity = metrics.gauge("capacity_bytes", "Data bytes held at most before eviction.")
        self.hits = metrics.counter("hits", "Blocks served by Get.")
        self.misses = metrics.counter("misses", "Get reads that found no servable block (a Get ends at its first).")
        self.evicted = metrics.counter("evicted", "Blocks evicted to stay under capacity.")
        self.expired = metrics.counter("expired", "Blocks deleted after ttl_s without use.")
        self.corrupt = metrics.counter("corrupt", "Blocks that failed their checksum (deleted, never served).")
        self.put_bytes = metrics.counter("put_bytes", "Data bytes received by Put.")
        self.get_bytes = metrics.counter("get_bytes", "Data bytes sent by Get.")
        self.shm_bytes = metrics.counter("shm_bytes", "Data bytes of Get and Put that moved through clients' "
                                         "shared-memory segments (also counted in get_bytes, put_bytes).")
        self.shm_segments = metrics.gauge("shm_segments", "Clients' shared-memory segments mapped now.")
        self.shm_refused = metrics.counter("shm_refused", "Calls naming a shared-memory segment this service "
                                           "could not use (another host or container): served as bytes.")
        self.nixl_bytes = metrics.counter("nixl_bytes", "Data bytes of Get written into clients' NIXL landing "
                                          "buffers (also counted in get_bytes).")
        self.nixl_refused = metrics.counter("nixl_refused", "Gets naming a NIXL landing buffer this service could "
                                            "not use, or whose write failed: served (the rest) as bytes.")
        self.nixl_peers = metrics.gauge("nixl_peers", "Clients' NIXL agents whose metadata this service holds.")
        self.blobs = metrics.gauge("blobs", "Keyed blobs held (the vision stage's image embeddings).")
        self.blob_bytes = metrics.gauge("blob_bytes", "Data bytes of the keyed blobs held.")
        self.blob_hits = metrics.counter("blob_hits", "Blobs served by GetBlobs.")
        self.blob_misses = metrics.counter("blob_misses", "Blobs asked for by GetBlobs and not served.")
        self._last = KVCacheStats(0, 0, 0, 0, 0, 0, 0, 0)

    def update(self, stats: KVCacheStats) -> None:
        self.blocks.set(stats.num_blocks)
        self.bytes.set(stats.num_bytes)
        self.capacity.set(stats.capacity_bytes)
        last, self._last = self._last, stats
        self.hits.inc(stats.num_hits - last.num_hits)
        self.misses.inc(stats.num_misses - last.num_misses)
        self.evicted.inc(stats.num_evicted - last.num_evicted)
        self.expired.inc(stats.num_expired - last.num_expired)
        self.corrupt.inc(stats.num_corrupt - last.num_corrupt)
        self.blobs.set(stats.num_blobs)
        self.blob_bytes.set(stats.blob_bytes)
        self.blob_hits.inc(stats.num_blob_hits - last.num_blob_hits)
        self.blob_misses.inc(stats.num_blob_misses - last.num_blob_misses)


class KVCacheServicer(kvcache_pb2_grpc.KVCacheServicer):
    def __init__(self, store: BlockStore, events: KvEventPublisher, metrics: KVCacheMetrics,
                 chunk_bytes: int, nixl: NixlServer | None = None) -> None:
        """nixl: serves Gets through NIXL (None: refuses them, the bytes go on the stream)."""
        check_chunk_bytes(chunk_bytes, "kvcache chunk_bytes")
        self.store = store
        self.nixl = nixl or NixlServer(None)
        self.events = events
        self.metrics = metrics
        self.chunk_bytes = chunk_bytes
        self.segments = SegmentCache()
        self._threads = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvcache-shm")

    def close(self) -> None:
        """After the server stopped: the shared-memory threads end with their last copies."""
        self._threads.shutdown(wait=True, cancel_futures=True)
        self.nixl.close()

    def prune_segments(self) -> int:
        """Unmap the segments of clients that closed them or died (the service runs it
        periodically); returns how many."""
        pruned = self.segments.prune()
        self.metrics.shm_segments.set(len(self.segments))
        return pruned

    async def _segment(self, shm: kvcache_pb2.ShmSegment) -> MappedSegment:
        """The request's segment, mapped (ShmUnavailable: why not; counted)."""
        try:
            segment = await asyncio.to_thread(self.segments.get, SegmentRef(shm.path, shm.size, shm.nonce))
            self.metrics.shm_segments.set(len(self.segments))
            return segment
        except ShmUnavailable as exc:
            self.metrics.shm_refused.inc()
            log.info("shared memory refused: %s", exc)
            raise

    async def Put(self, request_iterator: AsyncIterator[kvcache_pb2.PutRequest],
                  context: grpc.aio.ServicerContext) -> kvcache_pb2.PutReply:
        assembler = BlockAssembler(capacity_bytes=self.store.capacity_bytes)
        tally = PutTally()
        writing: asyncio.Task[None] | None = None

        async def write(block: AssembledBlock) -> None:
            outcome = await asyncio.to_thread(self.store.put, block.block_hash, block.layout, block.data)
            tally.add(block.block_hash, len(block.data), outcome)

        try:
            async for request in request_iterator:
                try:
                    block = _feed_put(assembler, request)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                if block is None:
                    continue
                # Receive the next block while this one is written (LMDB and
                # the checksum release the GIL): one write in flight, so at
                # most two blocks in memory.
                if writing is not None:
                    await writing
                writing = asyncio.create_task(write(block))
            try:
                assembler.finish()
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if writing is not None:
                await writing
        finally:
            if writing is not None and not writing.done():
                await asyncio.wait({writing})  # an aborted stream still finishes the write it started
            # Blocks stored before a malformed message stay stored (each block
            # stands alone), so they are announced whatever happens next.
            self.metrics.put_bytes.inc(tally.num_bytes)
            self._put_span(tally)
            await self._after_rpc(tally.stored, tally.evicted)
        return kvcache_pb2.PutReply(num_stored=len(tally.stored), num_existing=tally.num_existing,
                                    num_bytes=tally.num_bytes)

    async def PutShm(self, request: kvcache_pb2.PutShmRequest,
                     context: grpc.aio.ServicerContext) -> kvcache_pb2.PutReply:
        for i, block in enumerate(request.blocks):
            header = block.header
            if len(header.block_hash) != HASH_BYTES or not 0 < header.num_bytes <= self.store.capacity_bytes:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"blocks[{i}]: a {HASH_BYTES}-byte hash and 1 to {self.store.capacity_bytes} "
                                    f"bytes of data; got {len(header.block_hash)} and {header.num_bytes}")
        try:
            segment = await self._segment(request.shm)
        except ShmUnavailable as exc:
            return kvcache_pb2.PutReply(shm_refused=str(exc))
        try:
            views = [segment.window(b.offset, b.header.num_bytes) for b in request.blocks]
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        tally = PutTally()
        # Each block's copy and checksum run at once on the pool (LMDB then takes the
        # writes one at a time). Every put finishes before the reply: the client may
        # reuse its segment once it has the answer.
        puts = [self._threads.submit(self.store.put, BlockHash(b.header.block_hash), b.header.layout, view)
                for b, view in zip(request.blocks, views)]
        try:
            await asyncio.to_thread(concurrent.futures.wait, puts)  # all of them, even when one fails
            failed = [put.exception() for put in puts if put.exception() is not None]
            for block, put in zip(request.blocks, puts):
                if put.exception() is None:  # stored blocks are announced whatever failed beside them
                    tally.add(BlockHash(block.header.block_hash), block.header.num_bytes, put.result())
            if failed:
                raise failed[0]
        finally:
            if not all(p.done() for p in puts):  # cancelled: still wait out the copies from the segment
                await asyncio.to_thread(concurrent.futures.wait, puts)
            self.metrics.put_bytes.inc(tally.num_bytes)
            self.metrics.shm_bytes.inc(tally.num_bytes)
            self._put_span(tally)
            await self._after_rpc(tally.stored, tally.evicted)
        return kvcache_pb2.PutReply(num_stored=len(tally.stored), num_existing=tally.num_existing,
                                    num_bytes=tally.num_bytes)

    @staticmethod
    def _put_span(tally: PutTally) -> None:
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute("kvcache.blocks", len(tally.stored) + tally.num_existing)
            span.set_attribute("kvcache.blocks_new", len(tally.stored))
            span.set_attribute("kvcache.bytes", tally.num_bytes)
            span.set_attribute("kvcache.evicted", len(tally.evicted))

    async def Get(self, request: kvcache_pb2.GetRequest,
                  context: grpc.aio.ServicerContext) -> AsyncIterator[kvcache_pb2.GetReply]:
        await self._check_hashes(request.block_hashes, context)
        tally = GetTally()
        try:
            if request.HasField("nixl") and not request.HasField("shm"):
                async for reply in self._get_nixl(request, context, tally):
                    yield reply
                return
            if request.HasField("shm"):
                try:
                    segment = await self._segment(request.shm)
                    sizes = await asyncio.to_thread(self.store.sizes, [BlockHash(h) for h in request.block_hashes])
                    offsets = place(sizes, segment.ref.size)
                    if sizes and not offsets:
                        raise ShmUnavailable(f"a block of {sizes[0]} bytes does not fit the segment of "
                                             f"{segment.ref.size}")
                except ShmUnavailable as exc:
                    yield kvcache_pb2.GetReply(shm_refused=str(exc))
                else:
                    async for reply in self._get_shm(request.block_hashes, sizes, offsets, segment, context, tally):
                        yield reply
                    return
            async for reply in self._get_bytes(request.block_hashes, context, tally):
                yield reply
        finally:
            self.metrics.get_bytes.inc(tally.num_bytes)
            self.metrics.shm_bytes.inc(tally.num_shm_bytes)
            self.metrics.nixl_bytes.inc(tally.num_nixl_bytes)
            span = trace.get_current_span()
            if span.is_recording():  # a cancelled Get's cleanup runs after its span ended
                span.set_attribute("kvcache.blocks", len(request.block_hashes))
                span.set_attribute("kvcache.hits", len(tally.served))
                span.set_attribute("kvcache.bytes", tally.num_bytes)
                span.set_attribute("kvcache.shm", tally.num_shm_bytes > 0)
                span.set_attribute("kvcache.nixl_bytes", tally.num_nixl_bytes)
            # One write transaction for the whole Get, not one per block.
            await asyncio.to_thread(self.store.touch, tally.served)
            await self._after_rpc([], tally.removed)

    async def _get_nixl(self, request: kvcache_pb2.GetRequest, context: grpc.aio.ServicerContext,
                        tally: "GetTally") -> AsyncIterator[kvcache_pb2.GetReply]:
        """The blocks written into the client's NIXL landing buffer (nixl_get.py), or
        `nixl_refused` and the bytes."""
        hashes = request.block_hashes
        t = request.nixl
        ref = TargetRef(t.agent, t.metadata, t.address, t.size, t.token)
        try:
            await asyncio.to_thread(self.nixl.check, ref)  # adding a peer's metadata may take a while
        except NixlRefused as exc:
            self.metrics.nixl_refused.inc()
            log.info("NIXL target refused: %s", exc)
            yield kvcache_pb2.GetReply(nixl_refused=str(exc))
            async for reply in self._get_bytes(hashes, context, tally):
                yield reply
            return
        self.metrics.nixl_peers.set(len(self.nixl.peers))
        sizes = await asyncio.to_thread(self.store.sizes, [BlockHash(h) for h in hashes])

        def bytes_from(rest: Sequence[bytes]) -> AsyncIterator[kvcache_pb2.GetReply]:
            self.metrics.nixl_refused.inc()
            return self._get_bytes(rest, context, tally)

        async for reply in self.nixl.get(hashes, sizes, ref, self.store, self._threads, context, tally, bytes_from):
            yield reply

    async def _get_bytes(self, hashes: Sequence[bytes], context: grpc.aio.ServicerContext,
                         tally: "GetTally") -> AsyncIterator[kvcache_pb2.GetReply]:
        """The blocks as header and data chunks on the stream."""
        for block_hash in hashes:
            if context.cancelled():
                break  # the client went away: read no more
            # One block in memory at a time: the read transaction is closed
            # before we yield, so a slow client never pins LMDB pages.
            outcome = await asyncio.to_thread(self.store.read, BlockHash(block_hash))
            block = outcome.block
            if block is None:
                if outcome.removed:
                    tally.removed.append(BlockHash(block_hash))
                yield kvcache_pb2.GetReply(missing=block_hash)
                break
            header = kvcache_pb2.BlockHeader(block_hash=block_hash, num_bytes=len(block.data), layout=block.layout)
            yield kvcache_pb2.GetReply(header=header)
            for chunk in iter_chunks(block.data, self.chunk_bytes):
                yield kvcache_pb2.GetReply(data=chunk)
            tally.served.append(BlockHash(block_hash))
            tally.num_bytes += len(block.data)

    async def _get_shm(self, hashes: Sequence[bytes], sizes: list[int], offsets: list[int], segment: MappedSegment,
                       context: grpc.aio.ServicerContext, tally: "GetTally") -> AsyncIterator[kvcache_pb2.GetReply]:
        """The blocks landed in the segment, read and verified by the pool at once,
        announced in order; ends at the first that is not served, or with
        segment_full at the first that did not fit."""
        reads = [self._threads.submit(self.store.read_into, BlockHash(hashes[i]), segment.window(offset, sizes[i]))
                 for i, offset in enumerate(offsets)]
        try:
            for i, read in enumerate(reads):
                if context.cancelled():
                    return
                outcome: LandedOutcome = await asyncio.wrap_future(read)
                if outcome.layout is None:  # evicted, expired or corrupt since sizes() saw it
                    if outcome.removed:
                        tally.removed.append(BlockHash(hashes[i]))
                    yield kvcache_pb2.GetReply(missing=hashes[i])
                    return
                header = kvcache_pb2.BlockHeader(block_hash=hashes[i], num_bytes=sizes[i], layout=outcome.layout)
                yield kvcache_pb2.GetReply(landed=kvcache_pb2.ShmBlock(header=header, offset=offsets[i]))
                tally.served.append(BlockHash(hashes[i]))
                tally.num_bytes += sizes[i]
                tally.num_shm_bytes += sizes[i]
            if len(offsets) < len(sizes):
                yield kvcache_pb2.GetReply(segment_full=hashes[len(offsets)])
            elif len(sizes) < len(hashes):
                self.store.count_miss()
                yield kvcache_pb2.GetReply(missing=hashes[len(sizes)])
        finally:
            # No copy into the segment may outlive the stream: the client reuses the
            # segment once the stream has ended. Copies not started are dropped, the
            # running ones waited for (the threads' own futures: an asyncio wrapper
            # would say done at its cancel while its thread still copies).
            for read in reads:
                read.cancel()
            running = [r for r in reads if not r.done()]
            if running:
                await asyncio.to_thread(concurrent.futures.wait, running)

    async def PutBlobs(self, request_iterator: AsyncIterator[kvcache_pb2.PutRequest],
                       context: grpc.aio.ServicerContext) -> kvcache_pb2.PutReply:
        """Keyed blobs with a ttl (blob_store.py), chunked as Put's blocks. No KV event:
        a blob is no block any worker's prefix cache could hold."""
        assembler = BlockAssembler(capacity_bytes=self.store.blobs.capacity_bytes)
        ttl_s = 0.0
        num_stored = num_existing = num_bytes = 0
        async for request in request_iterator:
            if request.WhichOneof("item") == "header":
                ttl_s = request.header.ttl_s
            try:
                blob = _feed_put(assembler, request)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if blob is None:
                continue
            is_new = await asyncio.to_thread(self.store.blobs.put, blob.block_hash, blob.layout, blob.data, ttl_s)
            num_stored += is_new
            num_existing += not is_new
            num_bytes += len(blob.data)
        try:
            assembler.finish()
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.metrics.put_bytes.inc(num_bytes)
        await self.refresh_metrics()
        return kvcache_pb2.PutReply(num_stored=num_stored, num_existing=num_existing, num_bytes=num_bytes)

    async def GetBlobs(self, request: kvcache_pb2.GetRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[kvcache_pb2.GetReply]:
        """Each blob asked for as a header and its chunks, or `missing` (the stream goes on)."""
        await self._check_hashes(request.block_hashes, context)
        num_bytes = 0
        try:
            for key in request.block_hashes:
                if context.cancelled():
                    break
                found = await asyncio.to_thread(self.store.blobs.get, key)
                if found is None:
                    yield kvcache_pb2.GetReply(missing=key)
                    continue
                layout, data = found
                yield kvcache_pb2.GetReply(header=kvcache_pb2.BlockHeader(block_hash=key, num_bytes=len(data),
                                                                          layout=layout))
                for chunk in iter_chunks(data, self.chunk_bytes):
                    yield kvcache_pb2.GetReply(data=chunk)
                num_bytes += len(data)
        finally:
            self.metrics.get_bytes.inc(num_bytes)
            await self.refresh_metrics()

    async def Lookup(self, request: kvcache_pb2.LookupRequest,
                     context: grpc.aio.ServicerContext) -> kvcache_pb2.LookupReply:
        await self._check_hashes(request.block_hashes, context)
        num_leading = await asyncio.to_thread(self.store.lookup, [BlockHash(h) for h in request.block_hashes])
        span = trace.get_current_span()
        span.set_attribute("kvcache.blocks", len(request.block_hashes))
        span.set_attribute("kvcache.hits", num_leading)
        return kvcache_pb2.LookupReply(num_leading=num_leading)

    async def Stats(self, request: kvcache_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> kvcache_pb2.StatsReply:
        stats = await asyncio.to_thread(self.store.stats)
        self.metrics.update(stats)
        return stats.to_proto()

    async def sweep(self) -> int:
        """One expiry pass (the service runs it periodically): purge, flush to
        disk, announce. Returns the number of blocks purged."""
        removed = await asyncio.to_thread(self.store.purge_expired)
        await asyncio.to_thread(self.store.blobs.purge_expired)
        await asyncio.to_thread(self.store.sync)
        await self._after_rpc([], removed)
        if removed:
            log.info("expired %d blocks", len(removed))
        return len(removed)

    async def refresh_metrics(self) -> None:
        self.metrics.update(await asyncio.to_thread(self.store.stats))

    async def _after_rpc(self, stored: list[BlockHash], removed: list[BlockHash]) -> None:
        # A block stored and evicted within the same RPC was never there for anyone.
        both = set(stored) & set(removed)
        if both:
            stored = [h for h in stored if h not in both]
            removed = [h for h in removed if h not in both]
        if stored or removed:
            await self.events.publish(stored, removed)
        # Hits and misses move on every Get; reading stats is one cheap read transaction.
        await self.refresh_metrics()

    @staticmethod
    async def _check_hashes(hashes: Sequence[bytes], context: grpc.aio.ServicerContext) -> None:
        for i, block_hash in enumerate(hashes):
            if len(block_hash) != HASH_BYTES:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"block_hashes[{i}] is {len(block_hash)} bytes; a block hash is {HASH_BYTES}")


def _feed_put(assembler: BlockAssembler, request: kvcache_pb2.PutRequest) -> AssembledBlock | None:
    """One PutRequest into the assembler; the block it completes, if any."""
    kind = request.WhichOneof("item")
    if kind == "header":
        assembler.header(request.header)
        return None
    if kind == "data":
        return assembler.data(request.data)
    raise ValueError("a PutRequest carries a header or data; this one is empty")
