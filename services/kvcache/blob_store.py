"""Keyed blobs with a time to live, in the block store's LMDB folder (its environment,
its own three databases): what the vision stage persists, an image's embeddings under
the image's 256-bit identity, so that a restarted mesh does not encode it again.

    blobs        key -> the value of block_format.py (checksummed: layout | data)
    blob_index   key -> expires (µs), ttl (µs), num bytes
    blob_expiry  expires (µs, big-endian) | key -> ""    (soonest first)

Unlike a block, a blob stands alone (no chain) and names its own ttl: it expires ttl
after its last put or read (a read slides it). Beyond capacity_bytes of blob data, the
blobs due to expire soonest go first: with one ttl for all, least recently used first.
Blobs count apart from blocks (kvcache.blob_capacity_bytes): embeddings, megabytes an
image, should not evict the KV the mesh routes by, nor the other way round.

No torch, no gRPC: the servicer calls these blocking methods through asyncio.to_thread,
and each opens its own short transaction, as BlockStore's do."""

import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import lmdb

from services.kvcache.block_format import encode_block, verify_view
from shared.kv.block_hash import HASH_BYTES

BLOBS_DB = b"blobs"
BLOB_INDEX_DB = b"blob_index"
BLOB_EXPIRY_DB = b"blob_expiry"
NUM_DBS = 3
_INDEX = struct.Struct("<QQQ")  # expires (unix µs), ttl (µs), num data bytes
_TIME = struct.Struct(">Q")  # big-endian: LMDB's byte order is then time order
_U64 = struct.Struct("<Q")
_BYTES_KEY = b"blob_bytes"


@dataclass(slots=True)
class BlobCounts:
    """Since the store was opened (a process's life), not persisted."""

    num_hits: int = 0
    num_misses: int = 0
    num_evicted: int = 0
    num_expired: int = 0
    num_corrupt: int = 0


def check_key(key: bytes) -> bytes:
    if len(key) != HASH_BYTES:
        raise ValueError(f"a blob key is {HASH_BYTES} bytes, got {len(key)}")
    return bytes(key)


class BlobStore:
    def __init__(self, env: lmdb.Environment, meta: object, capacity_bytes: int, max_ttl_s: float,
                 clock: Callable[[], float], op: Callable[[], AbstractContextManager[None]]) -> None:  # fmt: skip
        """env, meta: the block store's LMDB environment and meta database; op: its guard
        around every call (close waits for calls in flight)."""
        if capacity_bytes <= 0:
            raise ValueError(f"kvcache blob_capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.max_ttl_us = int(max_ttl_s * 1e6)
        self._env = env
        self._meta = meta
        self._clock = clock
        self._op = op
        self._blobs = env.open_db(BLOBS_DB)
        self._index = env.open_db(BLOB_INDEX_DB)
        self._expiry = env.open_db(BLOB_EXPIRY_DB)
        self.counts = BlobCounts()
        self._lock = threading.Lock()

    def put(self, key: bytes, layout: str, data: bytes | memoryview, ttl_s: float) -> bool:
        """Store (or replace) a blob; True when it was not held. ttl_s <= 0 or past the
        store's ttl takes the store's."""
        key = check_key(key)
        if not data:
            raise ValueError("a blob has data; got 0 bytes")
        if len(data) > self.capacity_bytes:
            raise ValueError(f"blob of {len(data)} bytes exceeds the blob capacity of {self.capacity_bytes}")
        now = self._clock()
        ttl_us = min(int(ttl_s * 1e6), self.max_ttl_us) if ttl_s > 0 else self.max_ttl_us
        value = encode_block(key, layout, data, now)
        with self._op(), self._env.begin(write=True) as txn:
            replaced = self._delete(txn, key)  # the same key again: the newer value wins
            self._add_bytes(txn, -replaced)
            is_new = replaced == 0
            over = self._num_bytes(txn) + len(data) - self.capacity_bytes
            evicted = self._evict(txn, over) if over > 0 else 0
            expires = _us(now) + ttl_us
            txn.put(key, value, db=self._blobs)
            txn.put(key, _INDEX.pack(expires, ttl_us, len(data)), db=self._index)
            txn.put(_TIME.pack(expires) + key, b"", db=self._expiry)
            self._add_bytes(txn, len(data))
        self._count(num_evicted=evicted)
        return is_new

    def get(self, key: bytes) -> tuple[str, bytes] | None:
        """(layout, data), verified, its expiry slid to now + its ttl; None when absent,
        expired or corrupt (those two deleted)."""
        key = check_key(key)
        with self._op():
            now_us = _us(self._clock())
            with self._env.begin(write=True, buffers=True) as txn:
                raw = txn.get(key, db=self._index)
                if raw is None:
                    self._count(num_misses=1)
                    return None
                expires, ttl_us, num_bytes = _INDEX.unpack(raw)
                value = txn.get(key, db=self._blobs) if expires >= now_us else None
                view = verify_view(key, value) if value is not None else None
                if view is None:
                    self._add_bytes(txn, -self._delete(txn, key))
                    self._count(num_misses=1, **({"num_expired": 1} if value is None else {"num_corrupt": 1}))
                    return None
                found = view.layout, bytes(view.data)
                txn.delete(_TIME.pack(expires) + key, db=self._expiry)
                txn.put(key, _INDEX.pack(now_us + ttl_us, ttl_us, num_bytes), db=self._index)
                txn.put(_TIME.pack(now_us + ttl_us) + key, b"", db=self._expiry)
        self._count(num_hits=1)
        return found

    def purge_expired(self) -> int:
        """Delete every blob past its expiry; how many."""
        removed = 0
        with self._op():
            now_us = _us(self._clock())
            with self._env.begin(write=True) as txn:
                due = [key for key in self._soonest(txn) if _TIME.unpack_from(key)[0] < now_us]
                freed = sum(self._delete(txn, bytes(key[_TIME.size :])) for key in due)
                self._add_bytes(txn, -freed)
                removed = len(due)
        self._count(num_expired=removed)
        return removed

    def sizes(self) -> tuple[int, int]:
        """(blobs held, their data bytes)."""
        with self._op(), self._env.begin() as txn:
            return txn.stat(self._index)["entries"], self._num_bytes(txn)

    def snapshot(self) -> BlobCounts:
        with self._lock:
            c = self.counts
            return BlobCounts(c.num_hits, c.num_misses, c.num_evicted, c.num_expired, c.num_corrupt)

    # -- inside a transaction ---------------------------------------------

    def _soonest(self, txn: lmdb.Transaction) -> Iterator[bytes]:
        cursor = txn.cursor(db=self._expiry)
        for key in cursor.iternext(keys=True, values=False):
            yield bytes(key)

    def _evict(self, txn: lmdb.Transaction, num_bytes: int) -> int:
        """Delete the blobs due soonest until num_bytes are freed; how many."""
        freed = count = 0
        cursor = txn.cursor(db=self._expiry)
        while freed < num_bytes and cursor.first():
            freed += self._delete(txn, bytes(cursor.key()[_TIME.size :]))
            count += 1
        self._add_bytes(txn, -freed)
        return count

    def _delete(self, txn: lmdb.Transaction, key: bytes) -> int:
        """Remove a blob from its three databases; its data bytes (0 if absent). The
        caller subtracts them from the total."""
        raw = txn.get(key, db=self._index)
        if raw is None:
            return 0
        expires, _, num_bytes = _INDEX.unpack(raw)
        txn.delete(key, db=self._blobs)
        txn.delete(key, db=self._index)
        txn.delete(_TIME.pack(expires) + key, db=self._expiry)
        return num_bytes

    def _num_bytes(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(_BYTES_KEY, db=self._meta)
        return _U64.unpack(raw)[0] if raw is not None else 0

    def _add_bytes(self, txn: lmdb.Transaction, delta: int) -> None:
        if delta:
            txn.put(_BYTES_KEY, _U64.pack(self._num_bytes(txn) + delta), db=self._meta)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.counts, name, getattr(self.counts, name) + delta)


def _us(t: float) -> int:
    return int(t * 1_000_000)
