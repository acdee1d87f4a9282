"""The shared-memory data plane of kvcache against a real service process (real
nats-server, LMDB, gRPC): the bytes, the segment's checks, the fallback to the
byte stream, and faults on both sides."""

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import grpc
import lmdb
import pytest

from services.kvcache.store import BLOCKS_DB
from shared.kv.block_hash import BlockHash
from shared.kv.wire.client import KVCacheClient
from shared.kv.wire.shm import DATA_OFFSET, Segment, SegmentRef
from shared.proto import kvcache_pb2, kvcache_pb2_grpc
from shared.runtime.rpc import check_health, open_channel
from tests.helpers.kvcache_proc import restart, serving, start_kvcache
from tests.helpers.metrics import exposition_value as metric

KIB = 1 << 10
SMALL_SEGMENT = DATA_OFFSET + 100 * KIB
"""Holds three blocks of 32 KiB: a Get of more is several Gets, one batch each."""


def h(name: str) -> BlockHash:
    return BlockHash(hashlib.sha256(name.encode()).digest())


def blocks_of(prefix: str, n: int, size: int = 32 * KIB) -> list[tuple[BlockHash, str, bytes]]:
    return [(h(f"{prefix}-{i}"), f"u8[{size}]", os.urandom(size)) for i in range(n)]


def hashes_of(blocks: list[tuple[BlockHash, str, bytes]]) -> list[BlockHash]:
    return [b[0] for b in blocks]


def shm_client(address: str, **kwargs: float) -> KVCacheClient:
    """A client with a segment of SMALL_SEGMENT (three blocks of 32 KiB)."""
    return KVCacheClient(address, shm_bytes=SMALL_SEGMENT, **kwargs)


async def put(address: str, blocks: list[tuple[BlockHash, str, bytes]], **kwargs: int) -> None:
    """Store blocks through a client of their own (the byte stream, unless kwargs give a segment)."""
    async with KVCacheClient(address, **kwargs) as kv:
        await kv.put_blocks(blocks)


def unopenable(nonce: bytes) -> SegmentRef:
    """A segment in no process the service can see (as one in another container is)."""
    return SegmentRef(f"/proc/{2**22 + 7}/fd/3", SMALL_SEGMENT, nonce)



@pytest.mark.asyncio
async def test_get_and_put_through_the_segment_equal_the_byte_stream(kvcache):
    blocks = blocks_of("eq", 8) + [(h("eq-odd"), "odd", os.urandom(5 * KIB + 3))]
    hashes = hashes_of(blocks)
    async with shm_client(kvcache.address) as shm, KVCacheClient(kvcache.address, shm_bytes=0) as stream:
        summary = await shm.put_blocks(blocks)
        assert (summary.num_stored, summary.num_bytes) == (9, sum(len(b[2]) for b in blocks))
        assert shm.shm.num_shm_calls == 3 and shm.shm.num_byte_calls == 0  # 3 + 3 + 3 blocks
        batches = [[(b.block_hash, b.layout, bytes(batch.block_data(i))) for i, b in enumerate(batch.blocks)]
                   async for batch in shm.iter_landed(hashes) if batch.via_shm]
        assert [len(b) for b in batches] == [3, 3, 3]  # segment_full twice, then the rest
        assert sum(batches, []) == blocks
        assert await stream.get_blocks(hashes) == blocks  # the same bytes off the stream
        assert stream.shm.num_shm_calls == 0 and stream.shm.num_byte_calls == 1
        # Stops at the first block not held, through the segment as on the stream.
        asked = [hashes[0], h("eq-missing"), hashes[1]]
        assert await shm.get_blocks(asked) == blocks[:1] == await stream.get_blocks(asked)
        assert shm.shm.num_refused == 0 and shm.shm.num_retired == 0


@pytest.mark.asyncio
async def test_a_segment_the_service_cannot_use_is_refused_and_the_stream_serves(kvcache, tmp_path):
    blocks = blocks_of("refuse", 2)
    hashes = hashes_of(blocks)
    await put(kvcache.address, blocks)
    segment = Segment(SMALL_SEGMENT)
    plain = tmp_path / "plain-file"
    plain.write_bytes(bytes(SMALL_SEGMENT))
    fd = os.open(plain, os.O_RDWR)
    try:
        bad = {
            "not /proc/<pid>/fd/<fd>": SegmentRef("/dev/shm/../../etc/passwd", SMALL_SEGMENT, segment.nonce),
            "does not match the request's nonce": SegmentRef(segment.ref.path, SMALL_SEGMENT, os.urandom(16)),
            "not the 110592 announced": SegmentRef(segment.ref.path, SMALL_SEGMENT + 4096, segment.nonce),
            "is not a kvcache segment": SegmentRef(f"/proc/{os.getpid()}/fd/{fd}", SMALL_SEGMENT, segment.nonce),
            "cannot open": unopenable(segment.nonce),  # no such process
        }
        async with open_channel(kvcache.address) as channel:
            stub = kvcache_pb2_grpc.KVCacheStub(channel)
            for why, ref in bad.items():
                shm = kvcache_pb2.ShmSegment(path=ref.path, size=ref.size, nonce=ref.nonce)
                replies = [r async for r in stub.Get(kvcache_pb2.GetRequest(block_hashes=hashes, shm=shm))]
                assert replies[0].WhichOneof("item") == "shm_refused" and why in replies[0].shm_refused, why
                # ... and the blocks follow on the same stream as bytes.
                assert [r.WhichOneof("item") for r in replies[1:]] == ["header", "data"] * 2, why
                assert replies[2].data == blocks[0][2]
                header = kvcache_pb2.BlockHeader(block_hash=h(f"never-{why}"), num_bytes=10, layout="x")
                reply = await stub.PutShm(kvcache_pb2.PutShmRequest(
                    shm=shm, blocks=[kvcache_pb2.ShmBlock(header=header, offset=DATA_OFFSET)]))
                assert why in reply.shm_refused and reply.num_stored == 0, why
            # A segment it can use, but a block outside its data area: refused outright.
            good = kvcache_pb2.ShmSegment(path=segment.ref.path, size=segment.size, nonce=segment.nonce)
            for offset, size in ((SMALL_SEGMENT - 5, 10), (0, 10), (2**63, 10)):
                header = kvcache_pb2.BlockHeader(block_hash=h("outside"), num_bytes=size, layout="x")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.PutShm(kvcache_pb2.PutShmRequest(
                        shm=good, blocks=[kvcache_pb2.ShmBlock(header=header, offset=offset)]))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "outside the segment's data area" in err.value.details()
            assert (await stub.Lookup(kvcache_pb2.LookupRequest(block_hashes=[h("outside")]))).num_leading == 0
    finally:
        os.close(fd)
        segment.close()
    assert "blocks[0]" not in plain.read_bytes().decode(errors="replace")
    assert plain.read_bytes() == bytes(SMALL_SEGMENT)  # the service never wrote the file it was pointed at

    # The client: a service that refuses its segment (as one in another container
    # would: it sees no such process) gets the bytes over the stream, counted.
    async with shm_client(kvcache.address) as kv:
        await kv.lookup(hashes)
        kv._the_segment().ref = unopenable(os.urandom(16))
        assert await kv.get_blocks(hashes) == blocks
        assert (kv.shm.num_refused, kv.shm.num_shm_calls, kv.shm.num_byte_calls) == (1, 0, 1)
        assert "cannot open" in kv.shm.refused_because
        more = blocks_of("refuse-put", 2)
        assert (await kv.put_blocks(more)).num_stored == 2  # the stream from now on: no second refusal
        assert (kv.shm.num_refused, kv.shm.num_byte_calls) == (1, 2)
        await kv.reconnect()  # the service may have moved: shared memory is tried again
        assert kv.shm.refused_because is None
    async with shm_client(kvcache.address) as kv:
        assert await kv.get_blocks(hashes_of(more)) == more
        assert kv.shm.num_shm_calls == 1
    # A Put asks first (an empty PutShm), so a refused segment's pages are never written.
    async with shm_client(kvcache.address) as kv:
        segment = kv._the_segment()
        segment.ref = unopenable(os.urandom(16))
        third = blocks_of("refuse-put-first", 2)
        assert (await kv.put_blocks(third)).num_stored == 2
        assert (kv.shm.num_refused, kv.shm.num_shm_calls, kv.shm.num_byte_calls) == (1, 0, 1)
        assert bytes(segment.buffer[DATA_OFFSET:]) == bytes(SMALL_SEGMENT - DATA_OFFSET)
        assert await kv.get_blocks(hashes_of(third)) == third


@pytest.mark.asyncio
async def test_a_corrupt_block_is_never_landed(nats_server, tmp_path):  # noqa: F811
    blocks = blocks_of("corrupt", 3)
    async with serving(start_kvcache(nats_server.url, tmp_path)) as svc:
        await put(svc.address, blocks, shm_bytes=SMALL_SEGMENT)
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=4, writemap=True)
    with env.begin(write=True) as txn:
        db = env.open_db(BLOCKS_DB, txn=txn)
        value = bytearray(txn.get(blocks[1][0], db=db))
        value[len(value) // 2] ^= 0x01  # one bit in the middle of the block's data
        txn.put(blocks[1][0], bytes(value), db=db)
    env.close()
    async with serving(restart(svc)) as svc, shm_client(svc.address) as kv:
        assert await kv.get_blocks(hashes_of(blocks)) == blocks[:1]
        assert kv.shm.num_shm_calls == 1
        stats = await kv.stats()
        assert stats.num_corrupt == 1 and await kv.lookup([blocks[1][0]]) == 0


@pytest.mark.asyncio
async def test_concurrent_clients_each_get_their_own_blocks(kvcache):
    sets = [blocks_of(f"conc{c}", 7, size=(24 + 8 * c) * KIB) for c in range(4)]
    await put(kvcache.address, sum(sets, []))

    async def client(c: int) -> None:
        async with shm_client(kvcache.address) as kv:
            for round_ in range(5):
                mine = sets[c] if round_ % 2 == 0 else sets[(c + 1) % 4]  # others' blocks too
                assert await kv.get_blocks(hashes_of(mine)) == mine
            assert kv.shm.num_byte_calls == 0 and kv.shm.num_shm_calls >= 10

    await asyncio.gather(*(client(c) for c in range(4)))


@pytest.mark.asyncio
async def test_a_call_that_does_not_end_cleanly_retires_the_segment(kvcache):
    """A Get that times out may leave the service copying into the segment: the
    client never writes it again and makes a fresh one."""
    blocks = blocks_of("retire", 3)
    async with shm_client(kvcache.address, timeout_s=1.0) as kv:
        await kv.put_blocks(blocks)
        first = kv._segment
        kvcache.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await kv.get_blocks(hashes_of(blocks))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            kvcache.proc.send_signal(signal.SIGCONT)
        assert kv._segment is None and kv.shm.num_retired == 1
        assert await kv.get_blocks(hashes_of(blocks)) == blocks
        assert kv._segment is not None and kv._segment is not first


CLIENT = textwrap.dedent("""
    import asyncio, hashlib, os, sys
    from shared.kv.block_hash import BlockHash
    from shared.kv.wire.client import KVCacheClient

    async def main(address, mode):
        async with KVCacheClient(address, shm_bytes=8 << 20, timeout_s=30) as kv:
            blocks = [(BlockHash(hashlib.sha256(f"kill-{i}".encode()).digest()), "x", os.urandom(2 << 20))
                      for i in range(16)]
            if mode == "get":
                await kv.put_blocks(blocks)
            print("ready", flush=True)
            while True:  # killed somewhere in here
                if mode == "get":
                    await kv.get_blocks([b[0] for b in blocks])
                else:
                    await kv.put_blocks([(BlockHash(os.urandom(32)), "x", b[2]) for b in blocks])

    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")


def start_client(address: str, mode: str) -> subprocess.Popen:
    """CLIENT in a process of its own, once it is ready: from then on in its calls."""
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, address, mode], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    proc.stdout.close()


@pytest.mark.parametrize("mode", ["get", "put"])
def test_a_client_killed_mid_call_leaves_the_service_serving(kvcache, mode):
    for i in range(3):
        proc = start_client(kvcache.address, mode)
        time.sleep(0.3 + 0.2 * i)  # in the middle of its calls
        kill(proc)
    blocks = blocks_of(f"after-kill-{mode}", 4)

    async def check() -> None:
        assert await check_health(kvcache.address)
        async with shm_client(kvcache.address) as kv:
            await kv.put_blocks(blocks)
            assert await kv.get_blocks(hashes_of(blocks)) == blocks
            assert kv.shm.num_shm_calls == 4  # 3 + 1 blocks each way

    asyncio.run(check())
    assert kvcache.proc.poll() is None, kvcache.log()


@pytest.mark.asyncio
async def test_a_service_killed_mid_get_ends_the_load_in_an_error(nats_server, tmp_path):  # noqa: F811
    blocks = blocks_of("server-kill", 9)
    async with serving(start_kvcache(nats_server.url, tmp_path), killed=True) as svc, \
            shm_client(svc.address, timeout_s=10.0) as kv:
        await kv.put_blocks(blocks)
        got = []
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for batch in kv.iter_landed(hashes_of(blocks)):
                got += batch.blocks
                svc.proc.kill()  # after the first batch of three: the next Get finds no service
                svc.proc.wait()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(got) == 3 and time.monotonic() - started < 5.0  # an error, not a wait for the deadline


def shm_segments(svc) -> float:  # noqa: ANN001
    url = f"http://127.0.0.1:{svc.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return metric(text, "infermesh_kvcache_shm_segments")


async def wait_for_segments(svc, count: int, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while (now := await asyncio.to_thread(shm_segments, svc)) != count:
        assert time.monotonic() < deadline, f"{now} segments mapped, waited for {count}"
        await asyncio.sleep(0.2)


@pytest.mark.asyncio
async def test_the_service_unmaps_a_segment_once_its_client_closed_it_or_died(nats_server, tmp_path):  # noqa: F811
    blocks = blocks_of("unmap", 2)
    async with serving(start_kvcache(nats_server.url, tmp_path)) as svc:
        first, second = shm_client(svc.address), shm_client(svc.address)
        await first.put_blocks(blocks)
        assert await second.get_blocks(hashes_of(blocks)) == blocks
        await wait_for_segments(svc, 2)  # one per client, mapped once for all their calls
        assert await first.get_blocks(hashes_of(blocks)) == blocks
        assert await asyncio.to_thread(shm_segments, svc) == 2
        await first.close()
        await wait_for_segments(svc, 1)  # the next prune (every 2 s) dropped it
        proc = start_client(svc.address, "get")
        await wait_for_segments(svc, 2)
        kill(proc)
        await wait_for_segments(svc, 1)
        await second.close()
        await wait_for_segments(svc, 0)


OTHER_NAMESPACE_CLIENT = textwrap.dedent("""
    import asyncio, dataclasses, hashlib, json, os, sys
    from shared.kv.block_hash import BlockHash
    from shared.kv.wire.client import KVCacheClient

    async def main(address):
        blocks = [(BlockHash(hashlib.sha256(f"netns-{i}".encode()).digest()), "x", os.urandom(40000 + i))
                  for i in range(3)]
        async with KVCacheClient(address, timeout_s=30) as kv:
            await kv.put_blocks(blocks)
            same = await kv.get_blocks([b[0] for b in blocks]) == blocks
            print(json.dumps({"pid": os.getpid(), "same": same, **dataclasses.asdict(kv.shm)}))

    asyncio.run(main(sys.argv[1]))
""")


def test_a_client_in_another_pid_namespace_gets_the_byte_stream(kvcache):
    """As a client in another container would: its /proc/<pid>/fd/<fd> names nothing
    of its own in the service's namespace, so the service refuses the segment."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.decode().strip()}")
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                           OTHER_NAMESPACE_CLIENT, kvcache.address],
                          capture_output=True, timeout=60, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    seen = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert seen["pid"] == 1, seen  # its own namespace
    assert "cannot open /proc/" in seen["refused_because"] or "not a kvcache segment" in seen["refused_because"]
    assert seen["same"] and (seen["num_refused"], seen["num_shm_calls"], seen["num_byte_calls"]) == (1, 0, 2)
    assert kvcache.proc.poll() is None
