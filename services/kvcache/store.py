"""The Block KVCache's store: content-addressed KV blocks in one LMDB folder.

No gRPC here: the servicer calls these blocking methods via asyncio.to_thread.
Every method opens its own short transaction, so any thread may call any
method and no read transaction outlives a call (a long-lived LMDB reader pins
old pages and makes the file grow). Four named databases, always written
together in one transaction:

    blocks  hash -> header | layout | data         (the block, checksummed)
    index   hash -> last access (µs), num bytes    (small: lookups, expiry, eviction)
    lru     last access (µs, big-endian) | hash -> ""   (oldest first)
    meta    b"num_bytes" -> total data bytes, b"version" -> format

The last access time lives in index/lru, not in the block's header: a hit
must not rewrite megabytes of KV data (LMDB is copy-on-write: a rewritten
value is a full copy, and the old pages linger while readers may need them).

The value format and its checksum are in block_format.py (version 2, XXH3; version-1
blocks, CRC-32, are still read).

Durability: ``writemap=True, sync=False``. STACK.md measured LMDB writes at
0.2 GiB/s with fsync per commit, 0.5 with sync=False and 1.3-3.0 with
writemap + sync=False. This is a cache: losing the last seconds of puts on a
power loss costs a recompute, and a process crash loses nothing (the pages are
in the OS page cache). The service calls ``sync()`` after each expiry sweep
and ``close()`` syncs, which bounds the loss window; the checksum catches a
block torn by a crash. writemap makes data.mdb a sparse file of map_size bytes.
"""

import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import lmdb

import numpy as np

from services.kvcache.blob_store import NUM_DBS as BLOB_DBS, BlobStore
from services.kvcache.block_format import (
    FORMAT_VERSION,
    READABLE_VERSIONS,
    StoredBlock,
    VerifiedView,
    encode_block,
    verify_view,
)
from shared.kv.block_hash import HASH_BYTES, BlockHash
from shared.kv.wire.stats import KVCacheStats

log = logging.getLogger(__name__)
T = TypeVar("T")

BLOCKS_DB = b"blocks"
INDEX_DB = b"index"
LRU_DB = b"lru"
META_DB = b"meta"
_INDEX = struct.Struct("<QQ")  # last access (unix µs), num data bytes
_LRU_TIME = struct.Struct(">Q")  # big-endian: LMDB's byte order is then time order
_U64 = struct.Struct("<Q")
_NUM_BYTES_KEY = b"num_bytes"
_VERSION_KEY = b"version"

# Deletions per write transaction in a sweep: keeps one transaction's dirty
# pages bounded however many blocks expired at once.
_PURGE_BATCH = 1024
# When LMDB's map fills anyway (page rounding of many tiny blocks), evict this
# share of the capacity and retry the put once.
_MAP_FULL_EVICT_FRACTION = 0.1


def default_map_size(capacity_bytes: int) -> int:
    """LMDB needs its map size upfront. Capacity counts data bytes only, so leave
    room for headers, page rounding (values are stored in whole 4 KiB pages),
    the three small databases and copy-on-write pages not yet reused: twice the
    capacity plus 256 MiB. Virtual address space, not disk: the file is sparse."""
    return 2 * capacity_bytes + (256 << 20)


class StoreClosed(RuntimeError):
    """The store was closed (the service is shutting down)."""


@dataclass(slots=True, frozen=True)
class PutOutcome:
    is_new: bool
    """False when the block was already held: its last access is refreshed, nothing rewritten."""
    evicted: list[BlockHash]
    """Blocks evicted (least recently used first) to make room for this one."""


@dataclass(slots=True, frozen=True)
class ReadOutcome:
    block: StoredBlock | None
    removed: bool = False
    """The block was held but expired or corrupt, and has now been deleted."""


@dataclass(slots=True, frozen=True)
class LandedOutcome:
    layout: str | None
    """The block's layout when its data was copied into the destination; None: not served."""
    removed: bool = False
    """The block was held but expired or corrupt, and has now been deleted."""


@dataclass(slots=True)
class _Counters:
    """Since this store was opened (a process's life), not persisted."""

    num_evicted: int = 0
    num_expired: int = 0
    num_corrupt: int = 0
    num_hits: int = 0
    num_misses: int = 0


def check_hash(block_hash: bytes) -> BlockHash:
    if len(block_hash) != HASH_BYTES:
        raise ValueError(f"a block hash is {HASH_BYTES} bytes (SHA-256), got {len(block_hash)}")
    return BlockHash(bytes(block_hash))


class BlockStore:
    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        ttl_s: float,
        *,
        clock: Callable[[], float] = time.time,
        map_size: int | None = None,
        blob_capacity_bytes: int = 1 << 30,
    ) -> None:
        """clock: unix time in seconds (wall clock, since times outlive the
        process); tests inject their own. blob_capacity_bytes: the keyed blobs'
        own bound (``blobs``, blob_store.py), apart from the blocks'."""
        if capacity_bytes <= 0:
            raise ValueError(f"kvcache capacity_bytes must be positive, got {capacity_bytes}")
        if ttl_s <= 0:
            raise ValueError(f"kvcache ttl_s must be positive, got {ttl_s}")
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        self.ttl_us = int(ttl_s * 1e6)
        self._clock = clock
        self._counters = _Counters()
        self._counters_lock = threading.Lock()
        # close() waits for calls in flight: an LMDB call still running in a
        # worker thread must not see its environment closed under it.
        self._ops = threading.Condition()
        self._num_ops = 0
        self._closed = False
        self.path.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(
            str(self.path),
            map_size=map_size or default_map_size(capacity_bytes + blob_capacity_bytes),
            max_dbs=4 + BLOB_DBS,
            writemap=True,
            sync=False,
        )
        self._env.reader_check()  # frees reader slots left by a crashed process
        self._blocks = self._env.open_db(BLOCKS_DB)
        self._index = self._env.open_db(INDEX_DB)
        self._lru = self._env.open_db(LRU_DB)
        self._meta = self._env.open_db(META_DB)
        self._check_version()
        self.blobs = BlobStore(self._env, self._meta, blob_capacity_bytes, ttl_s, clock, self._op)
        """Keyed blobs with a ttl in the same folder (the vision stage's embeddings)."""
        evicted = self._enforce_capacity()
        if evicted:
            log.info("evicted %d blocks at open: capacity is %d bytes", len(evicted), capacity_bytes)

    # -- the public calls -------------------------------------------------

    def put(self, block_hash: BlockHash, layout: str, data: bytes | memoryview) -> PutOutcome:
        """Store a block, evicting least recently used ones beyond capacity.
        A block already held is refreshed (same address, same content). data may
        be a view of a client's shared-memory segment: it is read once."""
        block_hash = check_hash(block_hash)
        if not data:
            raise ValueError("a block has data; got 0 bytes")
        if len(data) > self.capacity_bytes:
            raise ValueError(f"block of {len(data)} bytes exceeds the kvcache capacity of {self.capacity_bytes}")
        now = self._clock()
        value = encode_block(block_hash, layout, data, now)
        with self._op():
            try:
                outcome = self._put(block_hash, value, len(data), self._us(now))
            except lmdb.MapFullError:
                log.warning("LMDB map full: evicting %.0f%% of the capacity and retrying",
                            100 * _MAP_FULL_EVICT_FRACTION)
                with self._env.begin(write=True) as txn:
                    freed = self._evict(txn, int(self.capacity_bytes * _MAP_FULL_EVICT_FRACTION))
                outcome = self._put(block_hash, value, len(data), self._us(now))
                outcome = PutOutcome(outcome.is_new, freed + outcome.evicted)
        # Counted after the commit: an aborted transaction evicted nothing.
        self._count(num_evicted=len(outcome.evicted))
        return outcome

    def read(self, block_hash: BlockHash) -> ReadOutcome:
        """The block, verified, without touching its last access (the caller
        batches that: see touch). Expired or corrupt blocks are deleted."""
        block, removed = self._read(
            block_hash, lambda view: StoredBlock(view.layout, bytes(view.data), view.stored_at)
        )
        return ReadOutcome(block, removed)

    def read_into(self, block_hash: BlockHash, dst: memoryview) -> LandedOutcome:
        """As read, but the verified data goes straight from LMDB's buffer into dst
        (a client's shared-memory segment), which must be exactly the block's size
        (sizes() gives it). The copy releases the GIL, so threads land blocks at once."""

        def land(view: VerifiedView) -> str | None:
            if len(view.data) != len(dst):
                return None  # the index and the block disagree: counted and deleted as corrupt
            np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(view.data, dtype=np.uint8))
            return view.layout

        layout, removed = self._read(block_hash, land)
        return LandedOutcome(layout, removed)

    def sizes(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The data bytes of the leading blocks held and not expired (from the small
        index: no block data is read), up to the first that is not."""
        out: list[int] = []
        with self._op(), self._env.begin() as txn:
            now_us = self._us(self._clock())
            for block_hash in hashes:
                raw_index = txn.get(bytes(block_hash), db=self._index)
                if raw_index is None or self._is_expired(raw_index, now_us):
                    break
                out.append(_INDEX.unpack(raw_index)[1])
        return out

    def count_miss(self) -> None:
        """A Get that ended at a block sizes() found missing (read() counts its own)."""
        self._count(num_misses=1)

    def _read(self, block_hash: BlockHash, take: Callable[[VerifiedView], T | None]) -> tuple[T | None, bool]:
        """take(the verified block) inside the read transaction (its views die with it);
        (what take returned, or None for a miss; whether the block was deleted)."""
        block_hash = check_hash(block_hash)
        with self._op():
            now_us = self._us(self._clock())
            with self._env.begin(buffers=True) as txn:
                raw_index = txn.get(block_hash, db=self._index)
                expired = raw_index is not None and self._is_expired(raw_index, now_us)
                value = txn.get(block_hash, db=self._blocks) if raw_index is not None and not expired else None
                view = verify_view(block_hash, value) if value is not None else None
                taken = take(view) if view is not None else None
            if taken is not None:
                self._count(num_hits=1)
                return taken, False
            self._count(num_misses=1)
            if raw_index is None:
                return None, False
            if expired:
                self._count(num_expired=1)
            else:
                self._count(num_corrupt=1)
                log.error("corrupt block %s in %s: deleted", block_hash.hex(), self.path)
            with self._env.begin(write=True) as txn:
                self._add_num_bytes(txn, -self._delete(txn, block_hash))
            return None, True

    def touch(self, hashes: Sequence[BlockHash]) -> None:
        """Mark blocks as used now, in one write transaction for all of them
        (a Get of many blocks costs one commit, not one per block)."""
        if not hashes:
            return
        with self._op(), self._env.begin(write=True) as txn:
            now_us = self._us(self._clock())
            for block_hash in hashes:
                raw_index = txn.get(block_hash, db=self._index)
                if raw_index is not None:
                    self._set_access(txn, block_hash, raw_index, now_us)

    def get(self, block_hash: BlockHash) -> tuple[str, bytes] | None:
        """read + touch, for callers that fetch one block at a time."""
        block = self.read(block_hash).block
        if block is None:
            return None
        self.touch([block_hash])
        return block.layout, block.data

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of the chain are held and not expired. Read
        only: it looks at the small index, never at block data, and does not
        count as a use (the Get that follows does)."""
        with self._op(), self._env.begin() as txn:
            now_us = self._us(self._clock())
            for i, block_hash in enumerate(hashes):
                raw_index = txn.get(bytes(block_hash), db=self._index)
                if raw_index is None or self._is_expired(raw_index, now_us):
                    return i
            return len(hashes)

    def purge_expired(self) -> list[BlockHash]:
        """Delete every block unused for ttl_s; returns their hashes, oldest first."""
        removed: list[BlockHash] = []
        with self._op():
            cutoff_us = self._us(self._clock()) - self.ttl_us
            while True:
                with self._env.begin(write=True) as txn:
                    batch = self._oldest(txn, _PURGE_BATCH, before_us=cutoff_us)
                    freed = sum(self._delete(txn, h) for h in batch)
                    self._add_num_bytes(txn, -freed)
                removed += batch
                if len(batch) < _PURGE_BATCH:
                    break
        if removed:
            self._count(num_expired=len(removed))
        return removed

    def stats(self) -> KVCacheStats:
        with self._op(), self._env.begin() as txn:
            num_blocks = txn.stat(self._index)["entries"]
            num_bytes = self._read_num_bytes(txn)
        num_blobs, blob_bytes = self.blobs.sizes()
        blobs = self.blobs.snapshot()
        with self._counters_lock:
            c = self._counters
            return KVCacheStats(num_blocks, num_bytes, self.capacity_bytes, c.num_evicted, c.num_expired,
                                c.num_corrupt, c.num_hits, c.num_misses, num_blobs, blob_bytes, blobs.num_hits,
                                blobs.num_misses)

    def sync(self) -> None:
        """Flush to disk now (sync=False leaves that to the OS otherwise)."""
        with self._op():
            self._env.sync(True)

    def close(self) -> None:
        """Wait for calls in flight, flush, close. Later calls raise StoreClosed."""
        with self._ops:
            if self._closed:
                return
            self._closed = True
            if not self._ops.wait_for(lambda: self._num_ops == 0, timeout=30.0):
                log.error("closing the block store with %d calls still in flight", self._num_ops)
        self._env.sync(True)
        self._env.close()

    def __enter__(self) -> "BlockStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside a transaction ---------------------------------------------

    def _put(self, block_hash: BlockHash, value: bytes, num_bytes: int, now_us: int) -> PutOutcome:
        with self._env.begin(write=True) as txn:
            raw_index = txn.get(block_hash, db=self._index)
            if raw_index is not None:
                self._set_access(txn, block_hash, raw_index, now_us)
                return PutOutcome(False, [])
            over = self._read_num_bytes(txn) + num_bytes - self.capacity_bytes
            evicted = self._evict(txn, over) if over > 0 else []
            txn.put(block_hash, value, db=self._blocks)
            txn.put(block_hash, _INDEX.pack(now_us, num_bytes), db=self._index)
            txn.put(_LRU_TIME.pack(now_us) + block_hash, b"", db=self._lru)
            self._add_num_bytes(txn, num_bytes)
        return PutOutcome(True, evicted)

    def _evict(self, txn: lmdb.Transaction, num_bytes: int) -> list[BlockHash]:
        """Delete least recently used blocks until num_bytes are freed."""
        evicted: list[BlockHash] = []
        freed = 0
        cursor = txn.cursor(db=self._lru)
        while freed < num_bytes and cursor.first():
            block_hash = BlockHash(cursor.key()[_LRU_TIME.size:])
            freed += self._delete(txn, block_hash)
            evicted.append(block_hash)
        self._add_num_bytes(txn, -freed)
        return evicted

    def _oldest(self, txn: lmdb.Transaction, limit: int, before_us: int) -> list[BlockHash]:
        out: list[BlockHash] = []
        cursor = txn.cursor(db=self._lru)
        for key in cursor.iternext(keys=True, values=False):
            if len(out) >= limit or _LRU_TIME.unpack_from(key)[0] >= before_us:
                break
            out.append(BlockHash(bytes(key[_LRU_TIME.size:])))
        return out

    def _delete(self, txn: lmdb.Transaction, block_hash: BlockHash) -> int:
        """Remove a block from all three databases; returns its data bytes (0 if absent)."""
        raw_index = txn.get(block_hash, db=self._index)
        if raw_index is None:
            return 0
        last_us, num_bytes = _INDEX.unpack(raw_index)
        txn.delete(block_hash, db=self._blocks)
        txn.delete(block_hash, db=self._index)
        txn.delete(_LRU_TIME.pack(last_us) + block_hash, db=self._lru)
        return num_bytes

    def _set_access(self, txn: lmdb.Transaction, block_hash: BlockHash, raw_index: bytes, now_us: int) -> None:
        last_us, num_bytes = _INDEX.unpack(raw_index)
        if last_us == now_us:
            return
        txn.delete(_LRU_TIME.pack(last_us) + block_hash, db=self._lru)
        txn.put(_LRU_TIME.pack(now_us) + block_hash, b"", db=self._lru)
        txn.put(block_hash, _INDEX.pack(now_us, num_bytes), db=self._index)

    def _enforce_capacity(self) -> list[BlockHash]:
        """At open: a store reopened with a smaller capacity sheds its oldest blocks."""
        with self._env.begin(write=True) as txn:
            over = self._read_num_bytes(txn) - self.capacity_bytes
            evicted = self._evict(txn, over) if over > 0 else []
        self._count(num_evicted=len(evicted))
        return evicted

    def _check_version(self) -> None:
        """A folder of an older format this code still reads (version 1) is taken
        over: its meta says the new version from now on, since new puts write it."""
        with self._env.begin(write=True) as txn:
            raw = txn.get(_VERSION_KEY, db=self._meta)
            if raw is None or _U64.unpack(raw)[0] in READABLE_VERSIONS:
                if raw is None or _U64.unpack(raw)[0] != FORMAT_VERSION:
                    txn.put(_VERSION_KEY, _U64.pack(FORMAT_VERSION), db=self._meta)
            else:
                raise ValueError(f"{self.path} holds kvcache format {_U64.unpack(raw)[0]}, this code reads "
                                 f"{READABLE_VERSIONS}: point kvcache.path at an empty folder")

    def _read_num_bytes(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(_NUM_BYTES_KEY, db=self._meta)
        return _U64.unpack(raw)[0] if raw is not None else 0

    def _add_num_bytes(self, txn: lmdb.Transaction, delta: int) -> None:
        if delta:
            txn.put(_NUM_BYTES_KEY, _U64.pack(self._read_num_bytes(txn) + delta), db=self._meta)

    def _is_expired(self, raw_index: bytes | memoryview, now_us: int) -> bool:
        return _INDEX.unpack_from(raw_index)[0] + self.ttl_us < now_us

    @staticmethod
    def _us(t: float) -> int:
        return int(t * 1_000_000)

    def _count(self, **deltas: int) -> None:
        with self._counters_lock:
            for name, delta in deltas.items():
                setattr(self._counters, name, getattr(self._counters, name) + delta)

    @contextmanager
    def _op(self) -> Iterator[None]:
        with self._ops:
            if self._closed:
                raise StoreClosed(f"block store {self.path} is closed")
            self._num_ops += 1
        try:
            yield
        finally:
            with self._ops:
                self._num_ops -= 1
                self._ops.notify_all()
