"""The client of the Block KVCache service, for prefill and decode workers.

    async with KVCacheClient(settings.kvcache.address) as kv:
        n = await kv.lookup(hashes)                  # leading blocks held
        blocks = await kv.get_blocks(hashes[:n])     # [(hash, layout, data)], stops at the first missing
        await kv.put_blocks([(h, layout, data), ...])

Blocks travel in chunks of chunk_bytes (cut and assembled by block_stream.py,
as in the service), so a block of any size fits gRPC's message limit. gRPC
failures surface as grpc.aio.AioRpcError (UNAVAILABLE when the service is down,
DEADLINE_EXCEEDED past timeout_s): a cache is an optimisation, so callers
usually log them and recompute.

A channel whose server went away waits out gRPC's reconnect backoff (up to two
minutes) before it tries again, and fails every call meanwhile; `reconnect()`
replaces it with a fresh channel that dials at once. A worker calls it when
`probe()` (a health check on a channel of its own, so never stuck in backoff)
finds the service back: see shared/stage/kvcache_connector.py.
"""

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

from shared.kv.block_hash import HASH_BYTES, BlockHash
from shared.proto import kvcache_pb2, kvcache_pb2_grpc
from shared.runtime.block_stream import (
    DEFAULT_CHUNK_BYTES,
    AssembledBlock,
    BlockAssembler,
    check_chunk_bytes,
    iter_chunks,
)
from shared.runtime.rpc import check_health, open_channel

Block = tuple[BlockHash, str, bytes]
"""(hash, layout, data): layout names the tensor's dtype and shape, checked by the loader."""


class KVCacheProtocolError(RuntimeError):
    """The service sent a Get stream that does not add up (a bug, not a miss)."""


@dataclass(slots=True, frozen=True)
class PutSummary:
    num_stored: int
    num_existing: int
    """Already held: refreshed, not rewritten."""
    num_bytes: int


@dataclass(slots=True, frozen=True)
class KVCacheStats:
    num_blocks: int
    num_bytes: int
    capacity_bytes: int
    num_evicted: int
    num_expired: int
    num_corrupt: int
    num_hits: int
    num_misses: int


class KVCacheClient:
    def __init__(self, address: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout_s: float | None = 60.0) -> None:
        """timeout_s: deadline of each call (None waits forever, which a worker
        should not: a stuck cache must not stall a request)."""
        check_chunk_bytes(chunk_bytes)
        self.address = address
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self._channel = open_channel(address)
        self._stub = kvcache_pb2_grpc.KVCacheStub(self._channel)

    async def put_blocks(self, blocks: Sequence[Block]) -> PutSummary:
        """Store blocks in one streamed call."""
        if not blocks:
            return PutSummary(0, 0, 0)
        for block_hash, _, data in blocks:
            if len(block_hash) != HASH_BYTES or not data:
                raise ValueError(f"a block needs a {HASH_BYTES}-byte hash and data; "
                                 f"got {len(block_hash)} and {len(data)} bytes")
        reply = await self._stub.Put(self._put_requests(blocks), timeout=self.timeout_s)
        return PutSummary(reply.num_stored, reply.num_existing, reply.num_bytes)

    async def iter_blocks(self, hashes: Sequence[BlockHash]) -> AsyncIterator[Block]:
        """The blocks in order, each as soon as it arrived whole; ends at the
        first block the service does not hold. Stopping early cancels the call."""
        if not hashes:
            return
        call = self._stub.Get(kvcache_pb2.GetRequest(block_hashes=hashes), timeout=self.timeout_s)
        assembler = BlockAssembler()
        try:
            async for reply in call:
                if reply.WhichOneof("item") == "missing":
                    return
                if (block := _feed(assembler, reply)) is not None:
                    yield block.block_hash, block.layout, block.data
            _feed(assembler, None)
        finally:
            call.cancel()  # no-op when the call already finished

    async def get_blocks(self, hashes: Sequence[BlockHash]) -> list[Block]:
        """The leading blocks the service holds (all of them, or up to the first missing)."""
        return [block async for block in self.iter_blocks(hashes)]

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
        return KVCacheStats(r.num_blocks, r.num_bytes, r.capacity_bytes, r.num_evicted, r.num_expired,
                            r.num_corrupt, r.num_hits, r.num_misses)

    async def probe(self, timeout_s: float = 0.5) -> bool:
        """Whether the service answers its health check now, asked on a fresh channel."""
        return await check_health(self.address, timeout_s=timeout_s)

    async def reconnect(self) -> None:
        """Dial again at once on a fresh channel; calls still on the old one may finish (1 s)."""
        old = self._channel
        self._channel = open_channel(self.address)
        self._stub = kvcache_pb2_grpc.KVCacheStub(self._channel)
        await old.close(grace=1.0)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "KVCacheClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _put_requests(self, blocks: Sequence[Block]) -> Iterator[kvcache_pb2.PutRequest]:
        """A plain iterator: grpc.aio consumes it lazily, one chunk in memory at a time."""
        for block_hash, layout, data in blocks:
            header = kvcache_pb2.BlockHeader(block_hash=block_hash, num_bytes=len(data), layout=layout)
            yield kvcache_pb2.PutRequest(header=header)
            for chunk in iter_chunks(data, self.chunk_bytes):
                yield kvcache_pb2.PutRequest(data=chunk)


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
