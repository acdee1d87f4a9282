"""The kvcache service as a real process: real nats-server, real LMDB folder,
real gRPC, driven through KVCacheClient (and a raw stub for malformed input)."""

import asyncio
import hashlib
import json
import os
import urllib.request

import grpc
import nats
import pytest

from services.kvcache.__main__ import bind_port
from shared.kv.block_hash import BlockHash
from shared.kv.wire.block_stream import MAX_CHUNK_BYTES, BlockAssembler, check_chunk_bytes, iter_chunks
from shared.kv.wire.client import KVCacheClient, KVCacheProtocolError, PutSummary, _feed
from shared.proto import kvcache_pb2, kvcache_pb2_grpc, mesh_pb2
from shared.runtime.rpc import check_health, open_channel
from shared.runtime.settings import load_settings
from shared.runtime.subjects import KV_EVENTS
from tests.helpers.kvcache_proc import restart, start_kvcache, wait_serving
from tests.helpers.mesh_procs import stop_process
from tests.helpers.metrics import exposition_value as metric

MIB = 1 << 20


def h(name: str) -> BlockHash:
    return BlockHash(hashlib.sha256(name.encode()).digest())


def test_block_stream_cuts_and_assembles_and_says_what_is_wrong():
    """The chunking both ends share (client Put, service Get) and the assembly
    both ends share (service Put, client Get)."""
    data = os.urandom(2 * MIB + 5)
    chunks = list(iter_chunks(data, MIB))
    assert [len(c) for c in chunks] == [MIB, MIB, 5]
    small = b"abc"
    assert list(iter_chunks(small, MIB)) == [small] and next(iter_chunks(small, MIB)) is small  # no copy
    assembler = BlockAssembler()
    assembler.header(kvcache_pb2.BlockHeader(block_hash=h("x"), num_bytes=len(data), layout="f16[2]"))
    assert [assembler.data(c) for c in chunks[:-1]] == [None, None]
    block = assembler.data(chunks[-1])
    assert (block.block_hash, block.layout, block.data) == (h("x"), "f16[2]", data)
    assembler.finish()  # nothing left half-way
    with pytest.raises(ValueError, match="exceeds the kvcache capacity of 10 bytes"):
        BlockAssembler(capacity_bytes=10).header(kvcache_pb2.BlockHeader(block_hash=h("y"), num_bytes=11))
    with pytest.raises(ValueError, match=f"chunk_bytes must be in \\(0, {MAX_CHUNK_BYTES}\\]"):
        check_chunk_bytes(MAX_CHUNK_BYTES + 1)
    # The client turns a Get stream that does not add up into its own error.
    with pytest.raises(KVCacheProtocolError, match="data came before any block header"):
        _feed(BlockAssembler(), kvcache_pb2.GetReply(data=b"x"))
    cut = BlockAssembler()
    _feed(cut, kvcache_pb2.GetReply(header=kvcache_pb2.BlockHeader(block_hash=h("z"), num_bytes=4)))
    with pytest.raises(KVCacheProtocolError, match="the stream ended after 0 of 4 bytes"):
        _feed(cut, None)


def test_port_rule():
    def port(**env: str) -> int:
        return bind_port(load_settings(env={f"INFERMESH_{k.upper()}": v for k, v in env.items()}))

    assert port(kvcache__address="kvcache.mesh:50123") == 50123
    assert port(kvcache__address="kvcache.mesh:50123", worker__grpc_port="7000") == 7000
    with pytest.raises(ValueError, match="no port"):
        port(kvcache__address="kvcache.mesh")


async def next_event(sub, timeout_s: float = 5.0) -> mesh_pb2.KvEvent:
    msg = await sub.next_msg(timeout=timeout_s)
    event = mesh_pb2.KvEvent()
    event.ParseFromString(msg.data)
    return event


@pytest.mark.asyncio
async def test_put_get_lookup_stats_and_events(kvcache, nats_server):  # noqa: F811
    nc = await nats.connect(nats_server.url)
    sub = await nc.subscribe(KV_EVENTS)
    await nc.flush()
    blocks = [
        (h("big-0"), "f32[2,16,8,3584]", os.urandom(3 * MIB + MIB // 2)),  # 4 chunks, the last one partial
        (h("big-1"), "f32[2,16,8,3584]", os.urandom(3 * MIB + MIB // 2)),
        (h("small"), "f32[2,16,1,8]", os.urandom(1024)),
    ]
    hashes = [b[0] for b in blocks]
    num_bytes = sum(len(b[2]) for b in blocks)
    async with KVCacheClient(kvcache.address) as kv:
        before = await kv.stats()
        assert await kv.put_blocks(blocks) == PutSummary(3, 0, num_bytes)
        assert await kv.get_blocks(hashes) == blocks
        assert await kv.lookup(hashes) == 3
        assert await kv.lookup([hashes[0], h("not-there"), hashes[2]]) == 1
        assert await kv.put_blocks(blocks[2:]) == PutSummary(0, 1, 1024)  # already held: refreshed
        after = await kv.stats()
    assert after.num_blocks - before.num_blocks == 3
    assert after.num_bytes - before.num_bytes == num_bytes
    assert after.num_hits - before.num_hits == 3
    assert after.capacity_bytes == 4 << 30

    event = await next_event(sub)
    assert event.instance_id.startswith("kvcache-")
    assert list(event.stored) == hashes and list(event.removed) == []
    with pytest.raises(nats.errors.TimeoutError):
        await next_event(sub, timeout_s=0.5)  # the refresh stored nothing new: no event
    await nc.close()

    url = f"http://127.0.0.1:{kvcache.metrics_port}/metrics"
    text = (await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())).decode()
    assert metric(text, "infermesh_kvcache_blocks") == after.num_blocks
    assert metric(text, "infermesh_kvcache_hits_total") == after.num_hits
    assert metric(text, "infermesh_kvcache_get_bytes_total") >= num_bytes
    assert metric(text, "infermesh_kvcache_put_bytes_total") >= num_bytes + 1024


@pytest.mark.asyncio
async def test_get_stops_at_first_missing(kvcache):
    held = [(h(f"held-{i}"), "x", os.urandom(100)) for i in range(2)]
    async with KVCacheClient(kvcache.address) as kv:
        await kv.put_blocks(held)
        asked = [held[0][0], h("missing"), held[1][0]]
        assert await kv.get_blocks(asked) == held[:1]
        assert await kv.get_blocks([h("missing")]) == []
    async with open_channel(kvcache.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        replies = [r async for r in stub.Get(kvcache_pb2.GetRequest(block_hashes=asked))]
    assert [r.WhichOneof("item") for r in replies] == ["header", "data", "missing"]
    assert replies[2].missing == h("missing")


@pytest.mark.asyncio
async def test_client_stopping_early_cancels_and_service_keeps_serving(kvcache):
    blocks = [(h(f"early-{i}"), "x", os.urandom(2 * MIB)) for i in range(4)]
    async with KVCacheClient(kvcache.address) as kv:
        await kv.put_blocks(blocks)
        async for first in kv.iter_blocks([b[0] for b in blocks]):
            break  # cancels the rest of the stream
        assert first == blocks[0]
        assert await kv.get_blocks([b[0] for b in blocks]) == blocks


def put_stream(*items: kvcache_pb2.BlockHeader | bytes) -> list[kvcache_pb2.PutRequest]:
    return [kvcache_pb2.PutRequest(header=i) if isinstance(i, kvcache_pb2.BlockHeader)
            else kvcache_pb2.PutRequest(data=i) for i in items]


@pytest.mark.asyncio
async def test_malformed_input_is_invalid_argument_and_service_keeps_serving(kvcache):
    header = kvcache_pb2.BlockHeader(block_hash=h("bad"), num_bytes=10, layout="x")
    bad_puts = {
        "data came before any block header": put_stream(b"0123456789"),
        "the stream ended after 5 of 10": put_stream(header, b"01234"),
        "more than its header's num_bytes": put_stream(header, b"0123456789X"),
        "a new header came after 5 of 10": put_stream(header, b"01234", header, b"0123456789"),
        "block_hash is 3 bytes": put_stream(kvcache_pb2.BlockHeader(block_hash=b"abc", num_bytes=1), b"0"),
        "exceeds the kvcache capacity": put_stream(kvcache_pb2.BlockHeader(block_hash=h("huge"), num_bytes=5 << 30)),
    }
    async with open_channel(kvcache.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        for message, requests in bad_puts.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Put(iter(requests))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
            assert message in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Lookup(kvcache_pb2.LookupRequest(block_hashes=[b"short"]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [r async for r in stub.Get(kvcache_pb2.GetRequest(block_hashes=[b"short"]))]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await check_health(kvcache.address)
    async with KVCacheClient(kvcache.address) as kv:
        assert await kv.lookup([h("bad")]) == 0  # the cut-short block was not stored
        await kv.put_blocks([(h("after-bad"), "x", b"fine")])
        assert await kv.get_blocks([h("after-bad")]) == [(h("after-bad"), "x", b"fine")]


@pytest.mark.asyncio
async def test_restart_keeps_blocks_and_traces_have_attributes(nats_server, tmp_path):  # noqa: F811
    blocks = [(h(f"durable-{i}"), "f16[4]", os.urandom(MIB + 7)) for i in range(3)]
    svc = start_kvcache(nats_server.url, tmp_path)
    try:
        await wait_serving(svc)
        async with KVCacheClient(svc.address) as kv:
            assert (await kv.put_blocks(blocks)).num_stored == 3
        assert await asyncio.to_thread(stop_process, svc.proc) == 0, svc.log()

        svc = restart(svc)
        await wait_serving(svc)
        async with KVCacheClient(svc.address) as kv:
            assert await kv.lookup([b[0] for b in blocks]) == 3
            assert await kv.get_blocks([b[0] for b in blocks]) == blocks
            assert (await kv.stats()).num_blocks == 3
    finally:
        assert await asyncio.to_thread(stop_process, svc.proc) == 0, svc.log()

    spans = [json.loads(line) for f in (tmp_path / "traces").glob("*.jsonl") for line in f.read_text().splitlines()]
    # On one host the client's blocks go through its shared-memory segment (PutShm),
    # after an empty PutShm that asks whether the service can use the segment.
    puts = [s for s in spans if s["name"].endswith("KVCache/PutShm")]
    assert [p["attributes"]["kvcache.blocks"] for p in puts] == [0, 3]
    put = puts[1]
    assert put["attributes"]["kvcache.blocks"] == 3
    assert put["attributes"]["kvcache.bytes"] == 3 * (MIB + 7)
    get = next(s for s in spans if s["name"].endswith("KVCache/Get"))
    assert get["attributes"]["kvcache.hits"] == 3
    assert get["attributes"]["kvcache.shm"] is True


@pytest.mark.asyncio
async def test_eviction_and_expiry_are_published(nats_server, tmp_path):  # noqa: F811
    svc = start_kvcache(nats_server.url, tmp_path, capacity_bytes="3000", ttl_s="1")
    nc = await nats.connect(nats_server.url)
    try:
        await wait_serving(svc)
        sub = await nc.subscribe(KV_EVENTS)
        await nc.flush()
        first = [(h(f"evict-{i}"), "x", bytes(1000)) for i in range(3)]
        async with KVCacheClient(svc.address) as kv:
            await kv.put_blocks(first)
            await kv.put_blocks([(h("evict-3"), "x", bytes(1000))])
        stored = await next_event(sub)
        assert list(stored.stored) == [b[0] for b in first]
        evicted = await next_event(sub)
        assert (list(evicted.stored), list(evicted.removed)) == ([h("evict-3")], [h("evict-0")])
        assert evicted.seq == stored.seq + 1
        expired = await next_event(sub, timeout_s=10.0)  # the sweep runs every second at ttl_s=1
        assert sorted(expired.removed) == sorted([h("evict-1"), h("evict-2"), h("evict-3")])
        async with KVCacheClient(svc.address) as kv:
            stats = await kv.stats()
        assert (stats.num_blocks, stats.num_evicted, stats.num_expired) == (0, 1, 3)
    finally:
        await nc.close()
        assert await asyncio.to_thread(stop_process, svc.proc) == 0, svc.log()
