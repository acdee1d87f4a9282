"""The kvcache store's keyed blobs with a ttl (services/kvcache/blob_store.py) on real
LMDB files: what the vision stage persists (an image's embeddings under its identity)."""

import hashlib

import pytest

from services.kvcache.store import BlockStore
from tests.helpers.clock import Clock

T0 = 1_800_000_000.0


def key(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=32).digest()


def test_a_blob_round_trips_slides_its_ttl_expires_and_outlives_a_reopen(tmp_path) -> None:
    clock = Clock(T0)
    with BlockStore(tmp_path, 1 << 20, ttl_s=3600.0, clock=clock, blob_capacity_bytes=1 << 20) as store:
        assert store.blobs.put(key("a"), "emb1;float32;3,4", b"x" * 48, ttl_s=100.0)
        assert not store.blobs.put(key("a"), "emb1;float32;3,4", b"y" * 48, ttl_s=100.0)  # replaced
        assert store.blobs.get(key("a")) == ("emb1;float32;3,4", b"y" * 48)
        assert store.blobs.get(key("b")) is None
        clock.now += 90.0
        assert store.blobs.get(key("a")) is not None  # a read slides its expiry: 100 s from now
        clock.now += 90.0
        assert store.blobs.get(key("a")) is not None
        stats = store.stats()
        assert (stats.num_blobs, stats.blob_bytes, stats.num_blob_hits, stats.num_blob_misses) == (1, 48, 3, 1)
        assert stats.num_blocks == 0  # blobs are no blocks
        store.blobs.put(key("c"), "l", b"z" * 10, ttl_s=10.0)
        clock.now += 11.0
        assert store.blobs.purge_expired() == 1  # c; a is due in 89 s
        assert store.blobs.get(key("c")) is None
    with BlockStore(tmp_path, 1 << 20, ttl_s=3600.0, clock=clock, blob_capacity_bytes=1 << 20) as store:
        assert store.blobs.get(key("a")) == ("emb1;float32;3,4", b"y" * 48)  # persisted
        clock.now += 101.0
        assert store.blobs.get(key("a")) is None  # expired: deleted on access
        assert store.stats().num_blobs == 0


def test_blobs_beyond_their_capacity_evict_those_due_soonest_and_leave_blocks_alone(tmp_path) -> None:
    clock = Clock(T0)
    with BlockStore(tmp_path, 1 << 20, ttl_s=3600.0, clock=clock, blob_capacity_bytes=250) as store:
        store.put(hashlib.sha256(b"block").digest(), "kv", b"k" * 100)
        for i in range(3):
            store.blobs.put(key(str(i)), "l", bytes([i]) * 100, ttl_s=1000.0)
            clock.now += 1.0
        # 300 bytes of blobs in 250: the first (due soonest) went; 1 and 2 stay.
        assert store.blobs.get(key("0")) is None
        assert store.blobs.get(key("1")) == ("l", b"\x01" * 100)
        assert store.blobs.get(key("2")) == ("l", b"\x02" * 100)
        assert store.stats().blob_bytes == 200 and store.stats().num_blocks == 1
        with pytest.raises(ValueError, match="32 bytes"):
            store.blobs.put(b"short", "l", b"x", ttl_s=1.0)
        # A ttl past the store's is capped at it.
        store.blobs.put(key("long"), "l", b"x", ttl_s=1e9)
        clock.now += 3601.0
        assert store.blobs.get(key("long")) is None
