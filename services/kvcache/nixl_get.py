"""kvcache's side of the NIXL data plane (shared/kv/wire/nixl_plane.py): Gets whose
blocks are WRITTEN into a client's landing buffer, for clients in another
container, pod or node.

The service has one NIXL agent and staging memory registered with it, cut into
NUM_SLOTS slots; a Get holds one slot. Its blocks are placed as in the client's
buffer (back to back from the start, up to the smaller of the buffer and the
slot), read and verified from LMDB into the slot by the servicer's thread pool,
all at once, and written into the buffer in pieces of about WRITE_BYTES, in
order, one write at a time while the reads go on (on this 2-core machine 16 MiB
writes reached ~1.8 GB/s over UCX's TCP, single 2 MiB ones ~0.3). A block is
announced `landed` once the write that carried it is done. The rest of the
stream is the shared-memory Get's: `segment_full` at the first block that did
not fit, `missing` at the first not held.

A target it cannot use (NIXL off or not started here, bad fields, another
agent's token, metadata NIXL will not add) is answered `nixl_refused` before any
block; a write that fails or times out is answered `nixl_refused` after the
blocks already landed, and the blocks from the first not landed follow as bytes
on the same stream. The peer is forgotten then (its metadata is added anew next
time: it may have restarted).
"""

import asyncio
import concurrent.futures
import hmac
import logging
import mmap
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from services.kvcache.store import BlockStore, LandedOutcome
from shared.kv.block_hash import BlockHash
from shared.kv.wire.nixl import MemoryRegion, NixlAgent, NixlUnavailable
from shared.kv.wire.nixl_plane import DEFAULT_STAGING_BYTES, MIN_TARGET_BYTES, NixlRefused, TargetRef
from shared.kv.wire.shm import place
from shared.proto import kvcache_pb2

log = logging.getLogger(__name__)

NUM_SLOTS = 4
"""Gets through NIXL served at once (a fifth waits for a slot)."""
WRITE_BYTES = 16 << 20
"""A write carries the blocks read since the last one, once they add up to this."""
MAX_PEERS = 256
"""Client agents whose metadata is kept (least recently used forgotten beyond)."""


def check_staging_bytes(size: int) -> None:
    if size < NUM_SLOTS * MIN_TARGET_BYTES:
        raise ValueError(f"kvcache.nixl_staging_bytes must be at least {NUM_SLOTS * MIN_TARGET_BYTES} "
                         f"({NUM_SLOTS} slots of {MIN_TARGET_BYTES}), got {size}")


@dataclass(slots=True)
class _Peer:
    token: bytes
    metadata: bytes


class NixlPeers:
    """The client agents the service has added, each bound to the token of the first
    request that named it. Any thread may call it."""

    def __init__(self, agent: NixlAgent, max_peers: int = MAX_PEERS) -> None:
        self.agent = agent
        self.max_peers = max_peers
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._lock = threading.Lock()

    def ensure(self, ref: TargetRef) -> None:
        """Make the target's agent writable (NixlRefused: why not)."""
        ref.check()
        with self._lock:
            peer = self._peers.get(ref.agent)
            if peer is not None and not hmac.compare_digest(peer.token, ref.token):
                raise NixlRefused(f"agent {ref.agent!r} is bound to another token")
            if peer is not None and peer.metadata == ref.metadata:
                self._peers.move_to_end(ref.agent)
                return
            try:  # new, or its buffer changed (a retired one replaced): add, or update
                self.agent.add_peer(ref.agent, ref.metadata)
            except Exception as exc:
                raise NixlRefused(f"NIXL did not add agent {ref.agent!r}: {exc}") from None
            self._peers[ref.agent] = _Peer(bytes(ref.token), bytes(ref.metadata))
            self._peers.move_to_end(ref.agent)
            dropped = []
            while len(self._peers) > self.max_peers:
                dropped.append(self._peers.popitem(last=False)[0])
        for name in dropped:
            self.agent.forget_peer(name)

    def forget(self, name: str) -> None:
        """After a failed write: its metadata is added anew next time (the token stays bound)."""
        with self._lock:
            peer = self._peers.get(name)
            if peer is not None:
                peer.metadata = b""
        self.agent.forget_peer(name)

    def __len__(self) -> int:
        return len(self._peers)


class StagingSlots:
    """The service's registered staging memory, NUM_SLOTS slots of equal size."""

    def __init__(self, agent: NixlAgent, staging_bytes: int) -> None:
        check_staging_bytes(staging_bytes)
        self.slot_bytes = staging_bytes // NUM_SLOTS
        self._mmap = mmap.mmap(-1, self.slot_bytes * NUM_SLOTS)
        self.buffer = memoryview(self._mmap)
        self.address = int(np.frombuffer(self.buffer, dtype=np.uint8).ctypes.data)
        agent.register([MemoryRegion(self.address, len(self.buffer), 0)], "DRAM")
        self._free: asyncio.LifoQueue[int] | None = None  # made on the service's loop, at first use

    async def acquire(self) -> int:
        if self._free is None:
            self._free = asyncio.LifoQueue()  # the slot used last is reused first: its pages are in
            for slot in range(NUM_SLOTS):
                self._free.put_nowait(slot)
        return await self._free.get()

    def release(self, slot: int) -> None:
        assert self._free is not None
        self._free.put_nowait(slot)

    def window(self, slot: int, offset: int, num_bytes: int) -> memoryview:
        if offset < 0 or num_bytes < 0 or offset + num_bytes > self.slot_bytes:
            raise ValueError(f"bytes [{offset}, {offset + num_bytes}) outside a slot of {self.slot_bytes}")
        start = slot * self.slot_bytes + offset
        return self.buffer[start : start + num_bytes]


BytesFrom = Callable[[Sequence[bytes]], AsyncIterator[kvcache_pb2.GetReply]]
"""The servicer's byte stream of these blocks (after a failed write)."""


class GetTally(Protocol):
    """What a Get served (the servicer's GetTally)."""

    served: list[BlockHash]
    removed: list[BlockHash]
    num_bytes: int
    num_nixl_bytes: int


@dataclass(slots=True, frozen=True)
class _Write:
    future: "concurrent.futures.Future[int]"
    first: int
    end: int


class NixlServer:
    """The agent, the staging slots and the peers; None of them when NIXL is off."""

    def __init__(self, name: str | None, backends: Sequence[str] = ("UCX",), staging_bytes: int = DEFAULT_STAGING_BYTES,
                 timeout_s: float = 30.0, loopback_only: bool = False) -> None:  # fmt: skip
        """name: the agent's (None: NIXL off here). timeout_s: a write not done by then fails.
        loopback_only: the service binds loopback, so UCX listens there alone (closed by default)."""
        self.timeout_s = timeout_s
        self.agent: NixlAgent | None = None
        self.unavailable = "NIXL is off on the kvcache service (kv_transfer.nixl)"
        if name is None:
            return
        check_staging_bytes(staging_bytes)
        try:
            agent = NixlAgent(name, backends, loopback_only=loopback_only)
        except NixlUnavailable as exc:
            self.unavailable = f"NIXL did not start on the kvcache service: {exc}"
            log.warning("%s: clients elsewhere get the byte stream", self.unavailable)
            return
        self.agent = agent
        self.slots = StagingSlots(agent, staging_bytes)
        self.peers = NixlPeers(agent)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvcache-nixl")
        log.info("NIXL agent %s: %d slots of %d bytes of staging", name, NUM_SLOTS, self.slots.slot_bytes)

    def check(self, ref: TargetRef) -> None:
        """NixlRefused unless a Get may write into this target."""
        if self.agent is None:
            raise NixlRefused(self.unavailable)
        self.peers.ensure(ref)

    async def get(self, hashes: Sequence[bytes], sizes: list[int], ref: TargetRef, store: BlockStore,
                  threads: concurrent.futures.Executor, context: grpc.aio.ServicerContext, tally: "GetTally",
                  bytes_from: BytesFrom) -> AsyncIterator[kvcache_pb2.GetReply]:  # fmt: skip
        """The blocks written into the target, announced in order (check() passed)."""
        slot = await self.slots.acquire()
        try:
            async for reply in self._serve(slot, hashes, sizes, ref, store, threads, context, tally, bytes_from):
                yield reply
        finally:
            self.slots.release(slot)

    async def _serve(self, slot: int, hashes: Sequence[bytes], sizes: list[int], ref: TargetRef, store: BlockStore,
                     threads: concurrent.futures.Executor, context: grpc.aio.ServicerContext, tally: "GetTally",
                     bytes_from: BytesFrom) -> AsyncIterator[kvcache_pb2.GetReply]:  # fmt: skip
        offsets = place(sizes, min(ref.size, self.slots.slot_bytes), start=0)
        if sizes and not offsets:
            yield kvcache_pb2.GetReply(nixl_refused=f"a block of {sizes[0]} bytes does not fit the target "
                                                    f"({ref.size} bytes) or a staging slot ({self.slots.slot_bytes})")
            async for reply in bytes_from(hashes):
                yield reply
            return
        reads = [threads.submit(store.read_into, BlockHash(hashes[i]), self.slots.window(slot, offset, sizes[i]))
                 for i, offset in enumerate(offsets)]
        layouts: list[str] = []
        """Of the blocks read and verified, in order."""
        written = 0
        """Blocks [0, written) are written and announced."""
        write: _Write | None = None
        """The write in flight: blocks [write.first, write.end)."""
        missing: bytes | None = None
        failure: str | None = None
        try:
            for i, read in enumerate(reads):
                if context.cancelled():
                    return
                outcome: LandedOutcome = await asyncio.wrap_future(read)
                if outcome.layout is None:  # evicted, expired or corrupt since sizes() saw it
                    if outcome.removed:
                        tally.removed.append(BlockHash(hashes[i]))
                    missing = hashes[i]
                    break
                layouts.append(outcome.layout)
                unwritten = write.end if write is not None else written
                if offsets[i] + sizes[i] - offsets[unwritten] < WRITE_BYTES:
                    continue
                if write is not None:
                    failure = await self._wait(write)
                    if failure is not None:
                        break
                    for reply in self._announce(write, hashes, sizes, offsets, layouts, tally):
                        yield reply
                    written = write.end
                write = self._start(slot, ref, offsets, sizes, written, i + 1)
            while failure is None and (write is not None or written < len(layouts)):
                if write is None:  # the blocks read since the last write
                    write = self._start(slot, ref, offsets, sizes, written, len(layouts))
                failure = await self._wait(write)
                if failure is None:
                    for reply in self._announce(write, hashes, sizes, offsets, layouts, tally):
                        yield reply
                    written, write = write.end, None
            if failure is None:
                if missing is not None:
                    yield kvcache_pb2.GetReply(missing=missing)
                elif len(offsets) < len(sizes):
                    yield kvcache_pb2.GetReply(segment_full=hashes[len(offsets)])
                elif len(sizes) < len(hashes):
                    store.count_miss()
                    yield kvcache_pb2.GetReply(missing=hashes[len(sizes)])
                return
            log.warning("NIXL write to %s failed (%s): the rest of its Get goes as bytes", ref.agent, failure)
            self.peers.forget(ref.agent)  # it may be gone or restarted
            yield kvcache_pb2.GetReply(nixl_refused=failure)
            async for reply in bytes_from(hashes[written:]):
                yield reply
        finally:
            # Nothing may use the slot after the Get: the next one reuses it. Reads not
            # started are dropped, running ones and the write waited for (the threads' own
            # futures: an asyncio wrapper says done at its cancel while its thread runs on).
            for read in reads:
                read.cancel()
            running = [r for r in reads if not r.done()]
            if write is not None and not write.future.done():
                running.append(write.future)
            if running:
                await asyncio.to_thread(concurrent.futures.wait, running)

    def _start(self, slot: int, ref: TargetRef, offsets: list[int], sizes: list[int], first: int,
               end: int) -> "_Write":  # fmt: skip
        """Write blocks [first, end) from the slot into the target, one descriptor each."""
        assert self.agent is not None
        base = self.slots.address + slot * self.slots.slot_bytes
        where = np.asarray(offsets[first:end], dtype=np.uint64)
        lengths = np.asarray(sizes[first:end], dtype=np.uint64)
        zeros = np.zeros(end - first, dtype=np.uint64)
        local = np.stack([np.uint64(base) + where, lengths, zeros], axis=1)
        remote = np.stack([np.uint64(ref.address) + where, lengths, zeros], axis=1)
        future = self._writer.submit(self.agent.write, ref.agent, local, remote, "DRAM", "DRAM", self.timeout_s)
        return _Write(future, first, end)

    @staticmethod
    async def _wait(write: "_Write") -> str | None:
        """None once the write is done; why, when it failed."""
        try:
            await asyncio.wrap_future(write.future)
        except Exception as exc:  # NixlTransferError, or NIXL's own on a peer it cannot reach
            return f"the NIXL write failed: {type(exc).__name__}: {exc}"
        return None

    @staticmethod
    def _announce(write: "_Write", hashes: Sequence[bytes], sizes: list[int], offsets: list[int], layouts: list[str],
                  tally: "GetTally") -> list[kvcache_pb2.GetReply]:  # fmt: skip
        """The `landed` items of a write that is done."""
        out = []
        for i in range(write.first, write.end):
            header = kvcache_pb2.BlockHeader(block_hash=hashes[i], num_bytes=sizes[i], layout=layouts[i])
            out.append(kvcache_pb2.GetReply(landed=kvcache_pb2.ShmBlock(header=header, offset=offsets[i])))
            tally.served.append(BlockHash(hashes[i]))
            tally.num_bytes += sizes[i]
            tally.num_nixl_bytes += sizes[i]
        return out

    def close(self) -> None:
        if self.agent is not None:
            self._writer.shutdown(wait=True, cancel_futures=True)
            self.agent.close()
