"""BlockStore on real LMDB files: exact assertions on what is held, evicted and expired."""

import hashlib
import threading

import lmdb
import pytest

from services.kvcache.store import BLOCKS_DB, BlockStore, StoreClosed
from shared.kv.block_hash import BlockHash
from shared.kv.wire.stats import KVCacheStats
from shared.proto import kvcache_pb2
from tests.helpers.clock import Clock

T0 = 1_800_000_000.0  # unix seconds; the tests move this clock by hand


def h(name: str) -> BlockHash:
    return BlockHash(hashlib.sha256(name.encode()).digest())


def data(name: str, size: int = 1000) -> bytes:
    return (name.encode() * size)[:size]


@pytest.fixture
def clock() -> Clock:
    return Clock(T0)


def open_store(path, clock: Clock, capacity: int = 1 << 20, ttl_s: float = 3600.0) -> BlockStore:
    return BlockStore(path, capacity, ttl_s, clock=clock)


def test_put_get_roundtrip(tmp_path, clock):
    with open_store(tmp_path, clock) as store:
        outcome = store.put(h("a"), "f16[2,16,4,64]", data("a", 5000))
        assert outcome.is_new and outcome.evicted == []
        assert store.get(h("a")) == ("f16[2,16,4,64]", data("a", 5000))
        assert store.get(h("b")) is None
        again = store.put(h("a"), "f16[2,16,4,64]", data("a", 5000))
        assert not again.is_new
        stats = store.stats()
        assert (stats.num_blocks, stats.num_bytes, stats.num_hits, stats.num_misses) == (1, 5000, 1, 1)


def test_the_stats_cross_the_wire_field_by_field() -> None:
    # The store's stats are what the Stats RPC carries and the client returns: one type, each
    # field to the proto field of its name (distinct values, so a swap shows).
    names = [f.name for f in kvcache_pb2.StatsReply.DESCRIPTOR.fields]
    stats = KVCacheStats(*range(1, len(names) + 1))
    reply = stats.to_proto()
    assert [getattr(reply, n) for n in names] == [getattr(stats, n) for n in names] == list(range(1, len(names) + 1))
    assert KVCacheStats.from_proto(reply) == stats


def test_put_rejects_bad_blocks(tmp_path, clock):
    with open_store(tmp_path, clock, capacity=4000) as store:
        with pytest.raises(ValueError, match="32 bytes"):
            store.put(BlockHash(b"short"), "x", b"data")
        with pytest.raises(ValueError, match="exceeds"):
            store.put(h("big"), "x", data("big", 4001))
        with pytest.raises(ValueError, match="has data"):
            store.put(h("empty"), "x", b"")
        assert store.stats().num_blocks == 0


def test_lookup_counts_leading_blocks_only(tmp_path, clock):
    with open_store(tmp_path, clock) as store:
        for name in ("a", "b", "d"):
            store.put(h(name), "x", data(name))
        assert store.lookup([h("a"), h("b"), h("d")]) == 3
        assert store.lookup([h("a"), h("b"), h("c"), h("d")]) == 2  # c is a gap: d does not count
        assert store.lookup([h("c"), h("a")]) == 0
        assert store.lookup([]) == 0


def test_corrupt_block_is_deleted_never_served(tmp_path, clock):
    with open_store(tmp_path, clock) as store:
        store.put(h("good"), "x", data("good"))
        store.put(h("bad"), "x", data("bad"))
    env = lmdb.open(str(tmp_path), max_dbs=4, writemap=True)
    with env.begin(write=True) as txn:
        db = env.open_db(BLOCKS_DB, txn=txn)
        value = bytearray(txn.get(h("bad"), db=db))
        value[-1] ^= 0x01  # one bit of the block's data
        txn.put(h("bad"), bytes(value), db=db)
    env.close()
    with open_store(tmp_path, clock) as store:
        assert store.get(h("bad")) is None
        stats = store.stats()
        assert (stats.num_corrupt, stats.num_blocks, stats.num_bytes) == (1, 1, 1000)
        assert store.lookup([h("bad")]) == 0  # gone, not just hidden
        assert store.get(h("bad")) is None
        assert store.stats().num_corrupt == 1  # the second miss is a plain miss
        assert store.get(h("good")) == ("x", data("good"))


def test_capacity_evicts_least_recently_used(tmp_path, clock):
    with open_store(tmp_path, clock, capacity=3000) as store:
        for name in ("a", "b", "c"):
            clock.now += 1
            assert store.put(h(name), "x", data(name)).evicted == []
        clock.now += 1
        assert store.get(h("a")) is not None  # a is now the most recently used
        clock.now += 1
        outcome = store.put(h("d"), "x", data("d"))
        assert outcome.is_new and outcome.evicted == [h("b")]
        clock.now += 1
        assert store.lookup([h("a")]) == 1 and store.lookup([h("b")]) == 0
        # A refresh by put also counts as a use: c survives, a goes next.
        store.put(h("c"), "x", data("c"))
        clock.now += 1
        assert store.put(h("e"), "x", data("e", 1500)).evicted == [h("a"), h("d")]
        stats = store.stats()
        assert (stats.num_blocks, stats.num_bytes, stats.num_evicted) == (2, 2500, 3)


def test_ttl_expiry(tmp_path, clock):
    with open_store(tmp_path, clock, ttl_s=10.0) as store:
        store.put(h("a"), "x", data("a"))
        clock.now += 5
        assert store.get(h("a")) is not None  # used at T0+5
        store.put(h("b"), "x", data("b"))  # stored at T0+5
        clock.now += 1
        store.put(h("c"), "x", data("c"))  # stored at T0+6
        clock.now += 10  # T0+16: a and b unused for 11 s, c for 10 s
        assert store.lookup([h("c")]) == 1
        assert store.lookup([h("a")]) == 0
        read = store.read(h("a"))  # expired: not served, purged on access
        assert read.block is None and read.removed
        assert store.purge_expired() == [h("b")]
        assert store.purge_expired() == []
        stats = store.stats()
        assert (stats.num_blocks, stats.num_bytes, stats.num_expired) == (1, 1000, 2)
        clock.now += 1
        assert store.get(h("c")) is None


def test_reopen_keeps_blocks_and_access_order(tmp_path, clock):
    with open_store(tmp_path, clock) as store:
        for name in ("a", "b"):
            clock.now += 1
            store.put(h(name), f"layout-{name}", data(name, 3000))
    with open_store(tmp_path, clock) as store:
        assert store.get(h("a")) == ("layout-a", data("a", 3000))
        assert store.stats().num_bytes == 6000
    # Reopened with less capacity: the least recently used (b; a was just read) goes.
    with open_store(tmp_path, clock, capacity=4000) as store:
        assert store.lookup([h("a")]) == 1 and store.lookup([h("b")]) == 0
        assert store.stats().num_evicted == 1


def test_closed_store_refuses_calls(tmp_path, clock):
    store = open_store(tmp_path, clock)
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreClosed):
        store.lookup([h("a")])


def test_threads_share_one_store(tmp_path):
    """The servicer calls from worker threads: concurrent puts, reads and
    evictions keep the accounting exact and never serve wrong bytes."""
    with BlockStore(tmp_path, 64 * 1000, 3600.0) as store:  # the real clock: accesses are ordered
        errors: list[BaseException] = []

        def work(worker: int) -> None:
            try:
                for i in range(50):
                    name = f"{worker}-{i}"
                    store.put(h(name), "x", data(name))
                    assert store.get(h(name)) in (("x", data(name)), None)  # None: evicted by another thread
            except BaseException as exc:  # a thread's failure must fail the test
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        stats = store.stats()
        assert stats.num_bytes == stats.num_blocks * 1000 <= 64 * 1000
        assert stats.num_blocks + stats.num_evicted == 200


def _v1_value(block_hash: bytes, layout: str, payload: bytes, stored_at: float) -> bytes:
    """A block as format version 1 wrote it (CRC-32), built here byte by byte: a
    golden copy of the old format, independent of block_format's own reader."""
    import struct
    import zlib

    layout_bytes = layout.encode()
    crc = zlib.crc32(block_hash)
    crc = zlib.crc32(struct.pack("<dH", stored_at, len(layout_bytes)), crc)
    crc = zlib.crc32(layout_bytes, crc)
    crc = zlib.crc32(payload, crc)
    return struct.pack("<BIdH", 1, crc, stored_at, len(layout_bytes)) + layout_bytes + payload


def test_version_1_blocks_are_still_served_and_new_ones_are_version_2(tmp_path, clock):
    with open_store(tmp_path, clock) as store:
        store.put(h("old"), "x", data("old"))  # makes the databases and the index entry
    env = lmdb.open(str(tmp_path), max_dbs=4, writemap=True)
    with env.begin(write=True) as txn:
        txn.put(h("old"), _v1_value(h("old"), "x", data("old"), T0), db=env.open_db(BLOCKS_DB, txn=txn))
        txn.put(b"version", (1).to_bytes(8, "little"), db=env.open_db(b"meta", txn=txn))
    env.close()
    with open_store(tmp_path, clock) as store:  # a version-1 folder opens
        assert store.get(h("old")) == ("x", data("old"))
        landing = bytearray(1000)
        assert store.read_into(h("old"), memoryview(landing)).layout == "x" and bytes(landing) == data("old")
        store.put(h("new"), "y", data("new"))
        assert store.stats().num_corrupt == 0
    env = lmdb.open(str(tmp_path), max_dbs=4, writemap=True)
    with env.begin() as txn:
        assert txn.get(h("new"), db=env.open_db(BLOCKS_DB, txn=txn))[0] == 2  # new puts write version 2
        assert txn.get(b"version", db=env.open_db(b"meta", txn=txn)) == (2).to_bytes(8, "little")
    env.close()


def test_a_folder_of_an_unknown_version_is_refused(tmp_path, clock):
    open_store(tmp_path, clock).close()
    env = lmdb.open(str(tmp_path), max_dbs=4, writemap=True)
    with env.begin(write=True) as txn:
        txn.put(b"version", (9).to_bytes(8, "little"), db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(ValueError, match="holds kvcache format 9"):
        open_store(tmp_path, clock)


def test_read_into_lands_verified_data_and_never_a_corrupt_block(tmp_path, clock):
    with open_store(tmp_path, clock) as store:
        store.put(h("a"), "la", data("a", 3000))
        store.put(h("b"), "lb", data("b", 2000))
        assert store.sizes([h("a"), h("b"), h("c"), h("a")]) == [3000, 2000]  # up to the first not held
        landing = bytearray(5000)
        view = memoryview(landing)
        assert store.read_into(h("a"), view[:3000]).layout == "la"
        assert store.read_into(h("b"), view[3000:]).layout == "lb"
        assert bytes(landing) == data("a", 3000) + data("b", 2000)
        # A destination of the wrong size is the index disagreeing with the block: not served.
        assert store.read_into(h("a"), view[:10]).layout is None
    env = lmdb.open(str(tmp_path), max_dbs=4, writemap=True)
    with env.begin(write=True) as txn:
        db = env.open_db(BLOCKS_DB, txn=txn)
        value = bytearray(txn.get(h("b"), db=db))
        value[-7] ^= 0x10
        txn.put(h("b"), bytes(value), db=db)
    env.close()
    with open_store(tmp_path, clock) as store:
        landing = bytearray(b"\xaa" * 2000)
        outcome = store.read_into(h("b"), memoryview(landing))
        assert outcome.layout is None and outcome.removed
        assert store.stats().num_corrupt == 1 and store.lookup([h("b")]) == 0
