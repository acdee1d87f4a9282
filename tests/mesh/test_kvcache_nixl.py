"""kvcache's NIXL data plane against a real service process (real nats-server,
LMDB, gRPC, NIXL agents on both sides, UCX underneath): the service WRITEs a
Get's blocks into the client's landing buffer; the bytes, the plane order
(shared memory, NIXL, stream), the refusals and their fallback to the stream,
and a service that dies mid-Get. Here client and service share a host and
namespaces (UCX may pick shared memory); between containers UCX takes TCP and
the same code runs."""

import asyncio
import dataclasses
import hashlib
import os
import time
import urllib.request

import pytest
import torch

from shared.kv.block_hash import BlockHash
from shared.kv.connectors.kvcache import KVCacheConnector
from shared.kv.memory.region import KVRegion
from shared.kv.spec import kv_cache_layout
from shared.kv.transfer import KVTransferParams
from shared.kv.wire.client import KVCacheClient, Plane
from shared.kv.wire.nixl import NixlAgent, agent_name
from shared.kv.wire.nixl_plane import MIN_TARGET_BYTES, LandingBuffer
from shared.kv.wire.shm import DATA_OFFSET, SegmentRef
from shared.proto import kvcache_pb2, kvcache_pb2_grpc
from shared.runtime.rpc import open_channel
from tests.helpers.kvcache_proc import KVCacheProc, serving, start_kvcache, wait_serving
from tests.helpers.mesh_procs import listening, stop_process
from tests.helpers.metrics import exposition_value as metric
from tests.helpers.nixl_wheel import skip_without_nixl

skip_without_nixl()

KIB = 1 << 10
BUFFER = MIN_TARGET_BYTES
"""A landing buffer of 1 MiB: three blocks of 320 KiB per Get."""
BLOCK = 320 * KIB


def h(name: str) -> BlockHash:
    return BlockHash(hashlib.sha256(name.encode()).digest())


def blocks_of(prefix: str, n: int, size: int = BLOCK) -> list[tuple[BlockHash, str, bytes]]:
    return [(h(f"{prefix}-{i}"), f"u8[{size}]", os.urandom(size)) for i in range(n)]


def hashes_of(blocks: list[tuple[BlockHash, str, bytes]]) -> list[BlockHash]:
    return [b[0] for b in blocks]


def nixl_client(address: str, nixl_bytes: int = BUFFER, **kwargs: object) -> KVCacheClient:
    """A client with shared memory off and a NIXL landing buffer (an agent of its own)."""
    return KVCacheClient(address, shm_bytes=0, nixl_bytes=nixl_bytes, **kwargs)


async def put(address: str, blocks: list[tuple[BlockHash, str, bytes]]) -> None:
    async with KVCacheClient(address, shm_bytes=0) as kv:
        await kv.put_blocks(blocks)


def service_metric(svc: KVCacheProc, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=5).read().decode()
    return metric(text, f"infermesh_kvcache_{name}")



@pytest.mark.asyncio
async def test_blocks_through_nixl_equal_the_stored_bytes_and_none_come_by_stream(kvcache):
    blocks = blocks_of("eq", 8) + [(h("eq-odd"), "odd", os.urandom(5 * KIB + 3))]
    hashes = hashes_of(blocks)
    await put(kvcache.address, blocks)
    nixl_before = service_metric(kvcache, "nixl_bytes_total")
    async with nixl_client(kvcache.address) as kv:
        batches = [(batch.plane, [(b.block_hash, b.layout, bytes(batch.block_data(i)))
                                  for i, b in enumerate(batch.blocks)])
                   async for batch in kv.iter_landed(hashes)]
        assert [plane for plane, _ in batches] == [Plane.NIXL] * 3
        assert [len(got) for _, got in batches] == [3, 3, 3]  # segment_full twice, then the rest
        assert sum([got for _, got in batches], []) == blocks
        total = sum(len(b[2]) for b in blocks)
        assert (kv.nixl.num_nixl_calls, kv.nixl.num_nixl_bytes) == (3, total)
        assert kv.get_bytes == {Plane.SHM: 0, Plane.NIXL: total, Plane.STREAM: 0}
        assert kv.shm.num_byte_calls == 0 and kv.nixl.num_refused == 0 and kv.nixl.num_retired == 0
        # Stops at the first block not held, as on the stream.
        asked = [hashes[0], h("eq-missing"), hashes[1]]
        assert await kv.get_blocks(asked) == blocks[:1]
        assert kv.get_bytes[Plane.STREAM] == 0 and kv.nixl.num_nixl_calls == 4
    assert service_metric(kvcache, "nixl_bytes_total") - nixl_before == total + len(blocks[0][2])


@pytest.mark.asyncio
async def test_a_service_bound_to_loopback_opens_nixl_on_loopback_alone(kvcache):
    """Closed by default: the service binds loopback, so its NIXL agent's UCX listens
    there alone (UCX_NET_DEVICES=lo, unless the deployment sets it); beside gRPC and
    /metrics, UCX's listener is there once a Get went through NIXL."""
    assert "UCX_NET_DEVICES" not in kvcache.env and "UCX_NET_DEVICES" not in os.environ
    blocks = blocks_of("closed", 2)
    await put(kvcache.address, blocks)
    async with nixl_client(kvcache.address) as kv:
        assert await kv.get_blocks(hashes_of(blocks)) == blocks
        assert kv.nixl.num_nixl_calls == 1
    addresses = listening(kvcache.proc.pid)
    assert len(addresses) >= 3, addresses  # gRPC, /metrics, UCX
    assert all(a in ("127.0.0.1", "::1") for a, _ in addresses), addresses


@pytest.mark.asyncio
async def test_a_get_larger_than_one_write_lands_in_several_writes(kvcache):
    """24 blocks of 1 MiB in a 32 MiB buffer: the service writes 16 MiB, then the rest."""
    blocks = blocks_of("big", 24, size=1 << 20)
    await put(kvcache.address, blocks)
    async with nixl_client(kvcache.address, nixl_bytes=32 << 20) as kv:
        assert await kv.get_blocks(hashes_of(blocks)) == blocks
        assert kv.nixl.num_nixl_calls == 1 and kv.get_bytes[Plane.STREAM] == 0


@pytest.mark.asyncio
async def test_a_write_that_fails_mid_get_is_refused_and_the_rest_streams(kvcache):
    """The buffer names more bytes than it registered: the first write (16 MiB) lands,
    NIXL refuses the second; the service says why and streams the blocks not landed."""
    blocks = blocks_of("midway", 24, size=1 << 20)
    await put(kvcache.address, blocks)
    async with nixl_client(kvcache.address, nixl_bytes=20 << 20) as kv:
        buffer = await asyncio.to_thread(kv._targets.the_buffer)
        buffer.ref = dataclasses.replace(buffer.ref, size=32 << 20)  # 12 MiB it never registered
        batches = [(batch.plane, len(batch.blocks)) async for batch in kv.iter_landed(hashes_of(blocks))]
        assert batches == [(Plane.NIXL, 16), (Plane.STREAM, 8)]
        assert "NIXL write failed" in kv.nixl.refused_because
        assert (kv.nixl.num_refused, kv.nixl.num_retired, kv.shm.num_byte_calls) == (1, 1, 1)
        assert kv.get_bytes == {Plane.SHM: 0, Plane.NIXL: 16 << 20, Plane.STREAM: 8 << 20}
        assert await kv.get_blocks(hashes_of(blocks)) == blocks  # the stream from now on, counted once
        assert (kv.nixl.num_refused, kv.shm.num_byte_calls) == (1, 2)
        await kv.reconnect()  # the service may have moved: NIXL is tried again, with a fresh buffer
        assert kv.nixl.refused_because is None
        assert await kv.get_blocks(hashes_of(blocks)) == blocks  # 20 blocks fit, then 4
        assert kv.nixl.num_nixl_calls == 3 and kv.shm.num_byte_calls == 2


@pytest.mark.asyncio
async def test_the_service_writes_only_where_the_client_named_with_its_token(kvcache):
    """Targets the service must not write: another agent's token, memory the metadata
    does not describe (the agent's other memory), metadata that names another agent.
    Each is refused (or its write fails) and the blocks come as bytes; the memory
    named stays untouched."""
    blocks = blocks_of("trust", 2)
    hashes = hashes_of(blocks)
    await put(kvcache.address, blocks)
    agent = NixlAgent(agent_name("test-trust"))
    other = NixlAgent(agent_name("test-other"))
    buffer = LandingBuffer(agent, BUFFER)
    private = LandingBuffer(agent, BUFFER)  # registered too, but never described to the service
    other_buffer = LandingBuffer(other, BUFFER)
    try:
        ref = buffer.ref
        good = kvcache_pb2.NixlTarget(agent=ref.agent, metadata=ref.metadata, address=ref.address, size=ref.size,
                                      token=ref.token)
        bad = {
            "bound to another token": dict(token=os.urandom(16)),
            "did not add agent": dict(metadata=other_buffer.ref.metadata),  # names test-other, not test-trust
            "NIXL write failed": dict(address=private.address),  # memory the metadata does not describe
            "target size": dict(size=4096),
            "token of 3 bytes": dict(token=b"abc"),
            "agent name": dict(agent="../../etc"),
        }
        async with open_channel(kvcache.address) as channel:
            stub = kvcache_pb2_grpc.KVCacheStub(channel)
            replies = [r async for r in stub.Get(kvcache_pb2.GetRequest(block_hashes=hashes, nixl=good))]
            assert [r.WhichOneof("item") for r in replies] == ["landed", "landed"]
            assert bytes(buffer.buffer[: len(blocks[0][2])]) == blocks[0][2]
            for why, change in bad.items():
                target = kvcache_pb2.NixlTarget()
                target.CopyFrom(good)
                for field, value in change.items():
                    setattr(target, field, value)
                replies = [r async for r in stub.Get(kvcache_pb2.GetRequest(block_hashes=hashes, nixl=target))]
                assert replies[0].WhichOneof("item") == "nixl_refused" and why in replies[0].nixl_refused, \
                    (why, replies[0])
                assert [r.WhichOneof("item") for r in replies[1:]] == ["header", "data"] * 2, why
                assert replies[2].data == blocks[0][2], why
        assert bytes(private.buffer) == bytes(BUFFER)  # never written
        assert bytes(other_buffer.buffer) == bytes(BUFFER)
    finally:
        for b in (buffer, private, other_buffer):
            b.close(retired=False)
        agent.close()
        other.close()


@pytest.mark.asyncio
async def test_planes_in_order_shared_memory_then_nixl_then_stream(kvcache):
    blocks = blocks_of("order", 3)
    hashes = hashes_of(blocks)
    await put(kvcache.address, blocks)
    async with KVCacheClient(kvcache.address, shm_bytes=DATA_OFFSET + BUFFER, nixl_bytes=BUFFER) as kv:
        assert await kv.get_blocks(hashes) == blocks  # the service's host: shared memory
        assert (kv.shm.num_shm_calls, kv.nixl.num_nixl_calls, kv.shm.num_byte_calls) == (1, 0, 0)
        # As in another container: the service cannot open the segment. That Get is
        # asked again through NIXL at once (not left to its stream), and so is the next.
        kv._the_segment().ref = SegmentRef(f"/proc/{2**22 + 7}/fd/3", DATA_OFFSET + BUFFER, os.urandom(16))
        assert await kv.get_blocks(hashes) == blocks
        assert (kv.shm.num_refused, kv.shm.num_byte_calls, kv.nixl.num_nixl_calls) == (1, 0, 1)
        assert await kv.get_blocks(hashes) == blocks
        assert (kv.shm.num_refused, kv.shm.num_byte_calls, kv.nixl.num_nixl_calls) == (1, 0, 2)
        assert kv.get_bytes == {Plane.SHM: sum(len(b[2]) for b in blocks), Plane.NIXL: 2 * sum(len(b[2]) for b in blocks),
                                Plane.STREAM: 0}
        # Without NIXL here, a refused segment's Get takes its stream.
        await kv.reconnect()  # both planes are tried again
        kv._targets.refuse(Plane.NIXL, "no NIXL here (the test says)")
        kv._the_segment().ref = SegmentRef(f"/proc/{2**22 + 7}/fd/3", DATA_OFFSET + BUFFER, os.urandom(16))
        assert await kv.get_blocks(hashes) == blocks
        assert (kv.shm.num_refused, kv.shm.num_byte_calls, kv.nixl.num_nixl_calls) == (2, 1, 2)


@pytest.mark.asyncio
async def test_a_service_with_nixl_off_refuses_and_the_stream_serves(nats_server, tmp_path):  # noqa: F811
    blocks = blocks_of("off", 4)
    env = {"INFERMESH_KV_TRANSFER__NIXL": "false"}
    async with serving(start_kvcache(nats_server.url, tmp_path, env=env)) as svc:
        await put(svc.address, blocks)
        async with nixl_client(svc.address) as kv:
            assert await kv.get_blocks(hashes_of(blocks)) == blocks
            assert "NIXL is off on the kvcache service" in kv.nixl.refused_because
            assert (kv.nixl.num_refused, kv.nixl.num_nixl_calls, kv.shm.num_byte_calls) == (1, 0, 1)
            assert await kv.get_blocks(hashes_of(blocks)) == blocks  # no second refusal
            assert (kv.nixl.num_refused, kv.shm.num_byte_calls) == (1, 2)
            assert kv.get_bytes[Plane.NIXL] == 0
        assert service_metric(svc, "nixl_refused_total") == 1


LAYERS, TOKENS, HEADS, DIM = 4, 16, 10, 64
"""A cache whose blocks are 160 KiB: six per landing buffer of 1 MiB."""


def small_region(num_blocks: int) -> KVRegion:
    stacked = torch.zeros((LAYERS, 2, num_blocks, TOKENS, HEADS, DIM), dtype=torch.bfloat16)
    return KVRegion(list(stacked.unbind(0)), kv_cache_layout([None] * LAYERS))


def test_a_service_killed_mid_get_is_an_error_the_connector_reports_not_a_hang(nats_server, tmp_path, monkeypatch):
    """The load's first batch lands through NIXL; the service dies; the next Get fails at
    once (UNAVAILABLE), and the connector reports the load failed: the engine recomputes."""
    import shared.kv.connectors.kvcache as kvcache_connector

    num = 12
    region = small_region(num)
    blocks = [(h(f"kill-{i}"), region.layout, os.urandom(region.block_bytes)) for i in range(num)]
    svc = start_kvcache(nats_server.url, tmp_path)
    asyncio.run(wait_serving(svc))
    try:
        asyncio.run(put(svc.address, blocks))
        write_batch = kvcache_connector._write_batch
        batches = []

        def write_then_kill(region, ids, batch, n):  # noqa: ANN001, ANN202
            batches.append((batch.plane, n))
            write_batch(region, ids, batch, n)
            if svc.proc.poll() is None:
                svc.proc.kill()
                svc.proc.wait()

        monkeypatch.setattr(kvcache_connector, "_write_batch", write_then_kill)
        connector = KVCacheConnector(svc.address, timeout_s=20.0, load_when_faster=False, shm_bytes=0,
                                     nixl_bytes=BUFFER)
        connector.register_kv_region(region)
        try:
            started = time.monotonic()
            connector.start_load("r", 0, hashes_of(blocks), {0: list(range(num))}, KVTransferParams(load=True))
            while not (loads := connector.poll()[0]):
                assert time.monotonic() - started < 10, "the load hangs"
                time.sleep(0.01)
            assert time.monotonic() - started < 5.0  # an error, not a wait for the deadline
            (load,) = loads
            assert load.num_blocks == 0 and "UNAVAILABLE" in load.error, load
            assert batches == [(Plane.NIXL, 6)]
            assert connector.client.nixl.num_nixl_calls == 1 and connector.client.nixl.num_retired == 1
        finally:
            connector.close()
    finally:
        if svc.proc.poll() is None:
            stop_process(svc.proc)


def test_a_connector_load_through_nixl_names_its_plane(kvcache):
    num = 9
    region = small_region(num)
    payload = torch.randint(0, 256, (num, region.block_bytes), dtype=torch.uint8)
    blocks = [(h(f"plane-{i}"), region.layout, payload[i].numpy().tobytes()) for i in range(num)]
    asyncio.run(put(kvcache.address, blocks))
    connector = KVCacheConnector(kvcache.address, load_when_faster=False, shm_bytes=0, nixl_bytes=BUFFER)
    connector.register_kv_region(region)
    try:
        connector.start_load("r", 0, hashes_of(blocks), {0: list(range(num))}, KVTransferParams(load=True))
        deadline = time.monotonic() + 20
        while not (loads := connector.poll()[0]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (load,) = loads
        assert (load.num_blocks, load.error, load.path, load.plane) == (num, None, "kvcache", "nixl")
        assert torch.equal(region.read_payloads({0: list(range(num))}), payload)
        assert connector.client.get_bytes[Plane.STREAM] == 0
    finally:
        connector.close()
