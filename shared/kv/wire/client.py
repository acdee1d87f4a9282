"""The client of the Block KVCache service, for prefill and decode workers.

    async with KVCacheClient(settings.kvcache.address) as kv:
        n = await kv.lookup(hashes)                  # leading blocks held
        blocks = await kv.get_blocks(hashes[:n])     # [(hash, layout, data)], stops at the first missing
        async for batch in kv.iter_landed(hashes[:n]):   # the same, without copies: see LandedBatch
            ...
        await kv.put_blocks([(h, layout, data), ...])

Three data planes, one API (targets.py keeps the landing places and the counters).
On the service's host the client owns a shared-memory segment (shared/kv/wire/shm.py,
shm_bytes of it, made at the first Get or Put and reused): a Get names it and the
service lands the verified blocks in it (a batch is then a view of the segment,
which the caller copies into its KV cache at once), a Put copies the blocks into
it and names them (PutShm). Where the service cannot open the segment (another
host or container) it says so, and with nixl_bytes set that Get is asked again,
and every later one, naming the client's NIXL landing buffer instead (shared/kv/wire/nixl_plane.py: the service WRITEs the
blocks into it through NIXL, UCX underneath); gRPC carries only headers and
status. Otherwise, and for every Put away from the service's host, the blocks
move in chunks of chunk_bytes on the gRPC stream (cut and assembled by
block_stream.py, as in the service). A plane the service refused is not tried
again until reconnect(); `shm` and `nixl` count the calls, the refusals and the
retired places, `get_bytes` the bytes each plane carried.

One call uses a landing place at a time (a lock, held while the caller has a
batch: so a caller must not Put or Get on the same client while it holds one);
a Get of more than the place holds is several Gets, one batch each. A call on
it that does not end cleanly (an error, a timeout, a consumer that stopped
early, a NIXL refusal) retires it: the service may still be writing into it (or
reading out of it), so it is never used again, and the next call makes a fresh one.

gRPC failures surface as grpc.aio.AioRpcError (UNAVAILABLE when the service is
down, DEADLINE_EXCEEDED past timeout_s): a cache is an optimisation, so callers
usually log them and recompute.

A channel whose server went away waits out gRPC's reconnect backoff (up to two
minutes) before it tries again, and fails every call meanwhile; `reconnect()`
replaces it with a fresh channel that dials at once. A worker calls it when
`probe()` (a health check on a channel of its own, so never stuck in backoff)
finds the service back: see shared/kv/connectors/kvcache.py.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from shared.kv.block_hash import HASH_BYTES, BlockHash
from shared.proto import kvcache_pb2, kvcache_pb2_grpc
from shared.kv.wire.block_stream import (
    DEFAULT_CHUNK_BYTES,
    AssembledBlock,
    BlockAssembler,
    check_chunk_bytes,
    iter_chunks,
)
from shared.kv.wire.nixl_plane import LandingBuffer
from shared.kv.wire.shm import DATA_OFFSET, DEFAULT_SHM_BYTES, Segment, place
from shared.kv.wire.stats import KVCacheStats
from shared.kv.wire.targets import AgentFactory, NixlCounters, OnSegment, Plane, ShmCounters, Targets
from shared.runtime.rpc import check_health, open_channel

log = logging.getLogger(__name__)

Block = tuple[BlockHash, str, bytes]
"""(hash, layout, data): layout names the tensor's dtype and shape, checked by the loader."""
BYTE_BATCH_BYTES = 64 << 20
"""Blocks received over the stream are handed on in batches of about this many bytes."""
__all__ = ["KVCacheClient", "LandedBatch", "LandedBlock", "NixlCounters", "OnSegment", "Plane", "ShmCounters"]


class KVCacheProtocolError(RuntimeError):
    """The service sent a Get stream that does not add up (a bug, not a miss)."""


@dataclass(slots=True, frozen=True)
class PutSummary:
    num_stored: int
    num_existing: int
    """Already held: refreshed, not rewritten."""
    num_bytes: int


@dataclass(slots=True, frozen=True)
class LandedBlock:
    block_hash: BlockHash
    layout: str
    offset: int
    """Where its data starts in the batch's data."""
    num_bytes: int


@dataclass(slots=True, frozen=True)
class LandedBatch:
    """Blocks of one Get, in order. data is a view of the client's segment or NIXL
    landing buffer (valid until the iterator moves on) or of the bytes received on
    the stream."""

    blocks: list[LandedBlock]
    data: memoryview
    plane: Plane

    @property
    def via_shm(self) -> bool:
        return self.plane is Plane.SHM

    def block_data(self, i: int) -> memoryview:
        block = self.blocks[i]
        return self.data[block.offset : block.offset + block.num_bytes]


@dataclass(slots=True)
class _Landed:
    """What one Get on a landing place brought."""

    blocks: list[LandedBlock]
    more: bool
    """The service stopped at segment_full: Get again from the next block."""
    refused: bool
    """The service refused the place (or its write failed): the call's stream goes on
    with the blocks not landed, as bytes."""


class KVCacheClient:
    def __init__(self, address: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout_s: float | None = 60.0,
                 shm_bytes: int = DEFAULT_SHM_BYTES, on_segment: OnSegment | None = None, nixl_bytes: int = 0,
                 nixl_agent: AgentFactory | None = None) -> None:  # fmt: skip
        """timeout_s: deadline of each call (None waits forever, which a worker
        should not: a stuck cache must not stall a request). shm_bytes: the
        shared-memory segment's size (0: no shared memory). nixl_bytes: the NIXL
        landing buffer's size (0: no NIXL); nixl_agent: the process's agent (the
        engine's, shared), else the client makes one of its own. on_segment: called
        with each new segment's or buffer's memory (the connector pins it)."""
        check_chunk_bytes(chunk_bytes)
        self.address = address
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.shm_bytes = shm_bytes
        self._targets = Targets(shm_bytes, nixl_bytes, on_segment, nixl_agent)
        self.shm: ShmCounters = self._targets.shm
        self.nixl: NixlCounters = self._targets.nixl
        self.get_bytes: dict[Plane, int] = dict.fromkeys(Plane, 0)
        """Block bytes Gets delivered, by the plane that carried them."""
        self._shm_lock: asyncio.Lock | None = None  # made on the client's loop, at first use; guards both places
        self._channel = open_channel(address)
        self._stub = kvcache_pb2_grpc.KVCacheStub(self._channel)

    # -- put -------------------------------------------------------------------

    async def put_blocks(self, blocks: Sequence[Block]) -> PutSummary:
        """Store blocks: through the segment, a segment's worth per call, where the
        service can use it; else (and for a block larger than the segment) in one
        streamed call."""
        if not blocks:
            return PutSummary(0, 0, 0)
        for block_hash, _, data in blocks:
            if len(block_hash) != HASH_BYTES or not data:
                raise ValueError(f"a block needs a {HASH_BYTES}-byte hash and data; "
                                 f"got {len(block_hash)} and {len(data)} bytes")
        total = PutSummary(0, 0, 0)
        start = 0
        while start < len(blocks) and self._targets.shm_usable():
            async with self._lock():
                done = await self._put_window(blocks[start:])
            if done is None:
                break
            num_blocks, summary = done
            total = _add(total, summary)
            start += num_blocks
        if start < len(blocks):
            self.shm.num_byte_calls += 1
            reply = await self._stub.Put(self._put_requests(blocks[start:]), timeout=self.timeout_s)
            total = _add(total, PutSummary(reply.num_stored, reply.num_existing, reply.num_bytes))
        return total

    async def _put_window(self, blocks: Sequence[Block]) -> tuple[int, PutSummary] | None:
        """The leading blocks that fit the segment, through it: (how many, the reply);
        None when the segment cannot be used (nothing was stored)."""
        segment = self._targets.the_segment()
        if segment is None or not await self._confirmed(segment):
            return None
        offsets = place([len(data) for _, _, data in blocks], segment.size)
        if not offsets:
            return None  # a block larger than the segment: the stream takes the rest
        window = blocks[: len(offsets)]
        # The copy into the segment off the event loop (numpy releases the GIL).
        await asyncio.to_thread(_copy_in, segment.buffer, window, offsets)
        request = kvcache_pb2.PutShmRequest(shm=_segment_pb(segment), blocks=[
            kvcache_pb2.ShmBlock(header=kvcache_pb2.BlockHeader(block_hash=h, num_bytes=len(data), layout=layout),
                                 offset=offset)
            for (h, layout, data), offset in zip(window, offsets)
        ])
        try:
            reply = await self._stub.PutShm(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a service from before PutShm
                self._targets.refuse(Plane.SHM, "the service has no PutShm")
                return None
            self._targets.retire(Plane.SHM)  # it may still be reading the segment
            raise
        except BaseException:
            self._targets.retire(Plane.SHM)
            raise
        if reply.shm_refused:
            self._targets.refuse(Plane.SHM, reply.shm_refused)
            return None
        self.shm.num_shm_calls += 1
        return len(window), PutSummary(reply.num_stored, reply.num_existing, reply.num_bytes)

    async def _confirmed(self, segment: Segment) -> bool:
        """Whether the service can use the segment, asked once per segment with an
        empty PutShm before the first Put copies anything in: where it cannot (another
        container) the segment's pages are then never touched."""
        if self._targets.segment_confirmed:
            return True
        try:
            reply = await self._stub.PutShm(kvcache_pb2.PutShmRequest(shm=_segment_pb(segment)),
                                            timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a service from before PutShm
                self._targets.refuse(Plane.SHM, "the service has no PutShm")
                return False
            raise
        if reply.shm_refused:
            self._targets.refuse(Plane.SHM, reply.shm_refused)
            return False
        self._targets.segment_confirmed = True
        return True

    # -- get -------------------------------------------------------------------

    async def iter_landed(self, hashes: Sequence[BlockHash]) -> AsyncIterator[LandedBatch]:
        """The leading blocks the service holds, in order, in batches (a landing place's
        worth, or BYTE_BATCH_BYTES received on the stream); ends at the first block it
        does not hold. A batch's data is valid until the iterator moves on. Stopping
        early cancels the call."""
        start = 0
        while start < len(hashes):
            plane = self._targets.get_plane()
            if plane is Plane.STREAM:
                async for batch in self._byte_batches(self._stub.Get(
                        kvcache_pb2.GetRequest(block_hashes=hashes[start:]), timeout=self.timeout_s)):
                    yield batch
                return
            async with self._lock():
                place: Segment | LandingBuffer | None
                if plane is Plane.SHM:
                    place = self._targets.the_segment()
                else:  # the agent may start now: off the loop
                    place = await asyncio.to_thread(self._targets.the_buffer)
                if place is None:
                    continue  # none could be made here: the next plane
                request = kvcache_pb2.GetRequest(block_hashes=hashes[start:], **{plane.value: _target_pb(place)})
                call = self._stub.Get(request, timeout=self.timeout_s)
                got = await self._landed(call, plane, place, hashes[start:])
                if plane is Plane.SHM and not got.refused:
                    self._targets.segment_confirmed = True
                if got.blocks:
                    num_bytes = sum(b.num_bytes for b in got.blocks)
                    self.get_bytes[plane] += num_bytes
                    if plane is Plane.SHM:
                        self.shm.num_shm_calls += 1
                        data = place.buffer[DATA_OFFSET:]
                    else:
                        self.nixl.num_nixl_calls += 1
                        self.nixl.num_nixl_bytes += num_bytes
                        data = place.buffer
                    # Yielded under the lock: nothing else writes the place while the caller reads it.
                    yield LandedBatch(got.blocks, data, plane)
                if got.refused:
                    if plane is Plane.SHM and self._targets.nixl_usable():
                        # Refused before the service touched the segment (another container):
                        # the bytes it now streams are dropped, and the same blocks asked
                        # again through NIXL, so the first Get elsewhere is not a stream too.
                        call.cancel()
                        continue
                    async for batch in self._byte_batches(call):  # the rest of this call's stream is bytes
                        yield batch
                    return
            if not got.more:
                return
            start += len(got.blocks)

    async def _landed(self, call: grpc.aio.UnaryStreamCall, plane: Plane, place: Segment | LandingBuffer,
                      hashes: Sequence[BlockHash]) -> _Landed:
        """Read a Get on a landing place up to its end, or up to the service's refusal
        (the stream goes on with bytes then).

        The stream is read to its very end (its OK status): the service ends it only
        once every copy or write into the place has finished, including those of blocks
        after a missing one, so the place is free for the next call. A shared-memory
        refusal comes first, before the service touched the segment; a NIXL one may come
        after blocks landed (a write failed), and retires the buffer."""
        landed: list[LandedBlock] = []
        more = ended = clean = refused = False
        base = DATA_OFFSET if plane is Plane.SHM else 0
        refusal = "shm_refused" if plane is Plane.SHM else "nixl_refused"
        try:
            async for reply in call:
                kind = reply.WhichOneof("item")
                if kind == refusal and not ended and (plane is Plane.NIXL or not landed):
                    self._targets.refuse(plane, getattr(reply, refusal))
                    refused = True
                    clean = plane is Plane.SHM  # the service never touched the segment
                    return _Landed(landed, False, True)
                if ended:
                    raise KVCacheProtocolError(f"a {kind} item after the end of a {plane.value} Get")
                if kind == "landed":
                    header, offset = reply.landed.header, reply.landed.offset
                    if (len(landed) >= len(hashes) or header.block_hash != hashes[len(landed)]
                            or offset < base or offset + header.num_bytes > place.size):
                        raise KVCacheProtocolError(f"landed block {len(landed)} does not add up "
                                                   f"(hash, or bytes [{offset}, +{header.num_bytes}))")
                    landed.append(LandedBlock(BlockHash(header.block_hash), header.layout,
                                              offset - base, header.num_bytes))
                elif kind in ("segment_full", "missing"):
                    more, ended = kind == "segment_full", True
                else:
                    raise KVCacheProtocolError(f"a {kind} item in a {plane.value} Get")
            clean = True
            return _Landed(landed, more, False)
        finally:
            if not clean:
                if not refused:  # after a refusal the stream goes on with bytes
                    call.cancel()
                self._targets.retire(plane)  # the service may still be writing into it

    async def _byte_batches(self, call: grpc.aio.UnaryStreamCall) -> AsyncIterator[LandedBatch]:
        """The blocks of a Get streamed as header and data chunks, in batches."""
        self.shm.num_byte_calls += 1
        assembler = BlockAssembler()
        blocks: list[LandedBlock] = []
        parts: list[bytes] = []
        num_bytes = 0
        try:
            async for reply in call:
                if reply.WhichOneof("item") == "missing":
                    break
                block = _feed(assembler, reply)
                if block is None:
                    continue
                blocks.append(LandedBlock(block.block_hash, block.layout, num_bytes, len(block.data)))
                parts.append(block.data)
                num_bytes += len(block.data)
                self.get_bytes[Plane.STREAM] += len(block.data)
                if num_bytes >= BYTE_BATCH_BYTES:
                    yield LandedBatch(blocks, memoryview(bytearray().join(parts)), Plane.STREAM)
                    blocks, parts, num_bytes = [], [], 0
            else:
                _feed(assembler, None)
            if blocks:  # one copy into writable memory (a consumer may view it as a tensor)
                yield LandedBatch(blocks, memoryview(bytearray().join(parts)), Plane.STREAM)
        finally:
            call.cancel()  # no-op when the call already finished

    async def iter_blocks(self, hashes: Sequence[BlockHash]) -> AsyncIterator[Block]:
        """The blocks in order, each as bytes of its own; ends at the first block the
        service does not hold. Stopping early cancels the call."""
        async for batch in self.iter_landed(hashes):
            for i, block in enumerate(batch.blocks):
                yield block.block_hash, block.layout, bytes(batch.block_data(i))

    async def get_blocks(self, hashes: Sequence[BlockHash]) -> list[Block]:
        """The leading blocks the service holds (all of them, or up to the first missing)."""
        return [block async for block in self.iter_blocks(hashes)]

    # -- keyed blobs (the vision stage's image embeddings) ---------------------------

    async def put_blobs(self, blobs: Sequence[Block], ttl_s: float) -> PutSummary:
        """Store blobs under their 32-byte keys, each expiring ttl_s after its last use
        (the service caps it at its kvcache.ttl_s); always on the byte stream: blobs are
        few and written once, off any request's critical token path."""
        if not blobs:
            return PutSummary(0, 0, 0)
        for key, _, data in blobs:
            if len(key) != HASH_BYTES or not data:
                raise ValueError(f"a blob needs a {HASH_BYTES}-byte key and data; got {len(key)} and {len(data)} bytes")

        def requests() -> Iterator[kvcache_pb2.PutRequest]:
            for key, layout, data in blobs:
                header = kvcache_pb2.BlockHeader(block_hash=key, num_bytes=len(data), layout=layout, ttl_s=ttl_s)
                yield kvcache_pb2.PutRequest(header=header)
                for chunk in iter_chunks(data, self.chunk_bytes):
                    yield kvcache_pb2.PutRequest(data=chunk)

        reply = await self._stub.PutBlobs(requests(), timeout=self.timeout_s)
        return PutSummary(reply.num_stored, reply.num_existing, reply.num_bytes)

    async def get_blobs(self, keys: Sequence[bytes], timeout_s: float | None = None) -> dict[bytes, tuple[str, bytes]]:
        """The blobs the service holds among keys: {key: (layout, data)} (a missing one is absent)."""
        if not keys:
            return {}
        call = self._stub.GetBlobs(kvcache_pb2.GetRequest(block_hashes=keys), timeout=timeout_s or self.timeout_s)
        assembler = BlockAssembler()
        found: dict[bytes, tuple[str, bytes]] = {}
        try:
            async for reply in call:
                if reply.WhichOneof("item") == "missing":
                    continue
                blob = _feed(assembler, reply)
                if blob is not None:
                    found[bytes(blob.block_hash)] = (blob.layout, bytes(blob.data))
            _feed(assembler, None)
        finally:
            call.cancel()
        return found

    # -- the rest ----------------------------------------------------------------

    async def lookup(self, hashes: Sequence[BlockHash], timeout_s: float | None = None) -> int:
        """How many leading blocks of the chain the service holds (timeout_s: this
        call's deadline, the client's by default)."""
        if not hashes:
            return 0
        request = kvcache_pb2.LookupRequest(block_hashes=hashes)
        reply = await self._stub.Lookup(request, timeout=timeout_s or self.timeout_s)
        return reply.num_leading

    async def stats(self) -> KVCacheStats:
        r = await self._stub.Stats(kvcache_pb2.StatsRequest(), timeout=self.timeout_s)
        return KVCacheStats.from_proto(r)

    async def probe(self, timeout_s: float = 0.5) -> bool:
        """Whether the service answers its health check now, asked on a fresh channel."""
        return await check_health(self.address, timeout_s=timeout_s)

    async def reconnect(self) -> None:
        """Dial again at once on a fresh channel; calls still on the old one may finish
        (1 s). The service may have moved: shared memory and NIXL are tried again."""
        old = self._channel
        self._channel = open_channel(self.address)
        self._stub = kvcache_pb2_grpc.KVCacheStub(self._channel)
        self._targets.reset_refusals()
        await old.close(grace=1.0)

    async def close(self) -> None:
        await self._channel.close()
        self._targets.close()

    async def __aenter__(self) -> "KVCacheClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the landing places (targets.py) -------------------------------------------

    def _lock(self) -> asyncio.Lock:
        if self._shm_lock is None:
            self._shm_lock = asyncio.Lock()
        return self._shm_lock

    @property
    def _segment(self) -> Segment | None:
        return self._targets.segment

    def _the_segment(self) -> Segment | None:
        return self._targets.the_segment()

    def _put_requests(self, blocks: Sequence[Block]) -> Iterator[kvcache_pb2.PutRequest]:
        """A plain iterator: grpc.aio consumes it lazily, one chunk in memory at a time."""
        for block_hash, layout, data in blocks:
            header = kvcache_pb2.BlockHeader(block_hash=block_hash, num_bytes=len(data), layout=layout)
            yield kvcache_pb2.PutRequest(header=header)
            for chunk in iter_chunks(data, self.chunk_bytes):
                yield kvcache_pb2.PutRequest(data=chunk)


def _segment_pb(segment: Segment) -> kvcache_pb2.ShmSegment:
    return kvcache_pb2.ShmSegment(path=segment.ref.path, size=segment.ref.size, nonce=segment.ref.nonce)


def _target_pb(place: Segment | LandingBuffer) -> kvcache_pb2.ShmSegment | kvcache_pb2.NixlTarget:
    if isinstance(place, Segment):
        return _segment_pb(place)
    ref = place.ref
    return kvcache_pb2.NixlTarget(agent=ref.agent, metadata=ref.metadata, address=ref.address, size=ref.size,
                                  token=ref.token)


def _copy_in(buffer: memoryview, blocks: Sequence[Block], offsets: list[int]) -> None:
    whole = np.frombuffer(buffer, dtype=np.uint8)
    for (_, _, data), offset in zip(blocks, offsets):
        np.copyto(whole[offset : offset + len(data)], np.frombuffer(data, dtype=np.uint8))


def _add(a: PutSummary, b: PutSummary) -> PutSummary:
    return PutSummary(a.num_stored + b.num_stored, a.num_existing + b.num_existing, a.num_bytes + b.num_bytes)


def _feed(assembler: BlockAssembler, reply: kvcache_pb2.GetReply | None) -> AssembledBlock | None:
    """One item of a Get stream into the assembler (None: the stream's end); the
    block it completes, if any. A stream that does not add up is the service's bug."""
    try:
        if reply is None:
            assembler.finish()
        elif reply.WhichOneof("item") == "header":
            assembler.header(reply.header)
        elif reply.WhichOneof("item") == "data":
            return assembler.data(reply.data)
    except ValueError as exc:
        raise KVCacheProtocolError(str(exc)) from None
    return None
