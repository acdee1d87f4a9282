"""The gRPC plane fails closed (issue 32, point 3), against real service processes.

A service that would serve gRPC beyond loopback without a peers list exits at
once with an error naming the setting, before it binds or loads anything; given
one, it starts. A real kvcache process knows the session's identities by their
tokens' hashes (worker.grpc_peers): no token, a wrong one, or a near miss is
UNAUTHENTICATED on every method; an identity a method is not for (vision, the
balancer) is PERMISSION_DENIED on Put, and what it tried is not stored; prefill
and decode store and read blocks, vision its embeddings."""

import asyncio
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from shared.proto import kvcache_pb2, kvcache_pb2_grpc
from shared.runtime.rpc import open_channel
from shared.runtime.rpc_auth import Peers, peers_setting, require_credentials, token_digest
from tests.helpers.kvcache_proc import start_kvcache, wait_serving
from tests.helpers.mesh import GRPC_PEERS, GRPC_TOKENS
from tests.helpers.mesh_procs import ROOT, listening, stop_process
from tools.launch.up import free_port, grpc_serving

DENIED, UNAUTHENTICATED = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED


def run_service_beyond_loopback(stage: str, tmp_path: Path, **env: str) -> subprocess.Popen:
    """`python -m services.<stage>` told to bind 0.0.0.0; NATS points nowhere (the check comes first)."""
    full = {"PYTHONUNBUFFERED": "1", "INFERMESH_WORKER__BIND_HOST": "0.0.0.0",
            "INFERMESH_NATS__URL": f"nats://127.0.0.1:{free_port()}", "INFERMESH_NATS__CONNECT_TIMEOUT_S": "1",
            "INFERMESH_KVCACHE__PATH": str(tmp_path / "lmdb"), "INFERMESH_TELEMETRY__TRACE_DIR": str(tmp_path / "t"),
            "INFERMESH_ENGINE__MODEL": str(tmp_path / "no-model"), **env}
    base = {k: v for k, v in os.environ.items() if not k.startswith("INFERMESH_")}
    return subprocess.Popen([sys.executable, "-m", f"services.{stage}"], cwd=ROOT, env={**base, **full},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("stage", ["kvcache", "prefill", "decode", "vision"])
def test_a_service_bound_beyond_loopback_without_credentials_will_not_start(stage, tmp_path):
    proc = run_service_beyond_loopback(stage, tmp_path, INFERMESH_KVCACHE__ADDRESS=f"0.0.0.0:{free_port()}")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"{stage}: refusing to serve gRPC on 0.0.0.0 (beyond loopback) without credentials")
    assert "worker.grpc_peers" in last and "Traceback" not in out


def test_the_same_service_with_a_peers_list_starts_beyond_loopback(nats_server, tmp_path):
    """The refusal above is the missing credentials: with them kvcache binds every interface.
    (Its NATS is a real one here: this one serves.)"""
    port = free_port()
    proc = run_service_beyond_loopback("kvcache", tmp_path, INFERMESH_KVCACHE__ADDRESS=f"127.0.0.1:{port}",
                                       INFERMESH_NATS__URL=nats_server.url, INFERMESH_WORKER__GRPC_PEERS=GRPC_PEERS)
    try:
        deadline = time.monotonic() + 60
        while not grpc_serving(f"127.0.0.1:{port}"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.2)
        # Every interface: 0.0.0.0, or gRPC's dual-stack [::] (listening() gives IPv6 in hex).
        assert {a for a, p in listening(proc.pid) if p == port} & {"0.0.0.0", "0" * 32}, listening(proc.pid)
    finally:
        stop_process(proc)


def test_the_peers_setting_and_the_fail_closed_rule():
    peers = Peers.parse(peers_setting(GRPC_TOKENS))
    assert peers is not None and peers.identities == set(GRPC_TOKENS)
    for identity, token in GRPC_TOKENS.items():
        assert peers.identity([("authorization", f"Bearer {token}")]) == identity
    assert peers.identity([("authorization", "Bearer " + GRPC_TOKENS["prefill"] + "x")]) is None
    assert peers.identity([("authorization", token_digest(GRPC_TOKENS["prefill"]))]) is None  # the hash is no token
    assert Peers.parse(None) is None and Peers.parse(" ") is None
    for bad in ("prefill", "prefill:abc", f"prefill:{'g' * 64}", f"a:{'0' * 64},b:{'0' * 64}"):
        with pytest.raises(ValueError, match="worker.grpc_peers"):
            Peers.parse(bad)
    for host in ("127.0.0.1", "::1", "localhost"):
        require_credentials(host, None)
    for host in ("0.0.0.0", "::", "10.1.2.3", "kvcache"):
        with pytest.raises(ValueError, match="beyond loopback"):
            require_credentials(host, None)
        require_credentials(host, peers)


# -- a real kvcache process that knows the session's identities -----------------------------------


@pytest.fixture(scope="module")
def guarded_kvcache(nats_server, tmp_path_factory):
    """kvcache on loopback, given the session's peers list: it checks every call."""
    svc = start_kvcache(nats_server.url, tmp_path_factory.mktemp("guarded-kvcache"),
                        env={"INFERMESH_WORKER__GRPC_PEERS": GRPC_PEERS})
    try:
        asyncio.run(wait_serving(svc))
        yield svc.address
    finally:
        code = stop_process(svc.proc)
    assert code == 0, svc.log()


def block_puts(block_hash: bytes, data: bytes) -> list[kvcache_pb2.PutRequest]:
    return [kvcache_pb2.PutRequest(header=kvcache_pb2.BlockHeader(block_hash=block_hash, num_bytes=len(data), layout="x")),
            kvcache_pb2.PutRequest(data=data)]


async def code_of(call) -> grpc.StatusCode:  # noqa: ANN001
    """The status a call ends with (OK when it succeeds); a stream is read to its end."""
    try:
        if isinstance(call, grpc.aio.UnaryStreamCall):
            _ = [reply async for reply in call]
        else:
            await call
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def calls_as(address: str, token: str | None) -> dict[str, grpc.StatusCode]:
    """Each method of kvcache called once with token (None: no metadata at all)."""
    probe = hashlib.sha256(f"probe {token}".encode()).digest()
    channel = grpc.aio.insecure_channel(address) if token is None else open_channel(address, token)
    async with channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        return {
            "Put": await code_of(stub.Put(iter(block_puts(probe, b"evil")), timeout=10)),
            "PutShm": await code_of(stub.PutShm(kvcache_pb2.PutShmRequest(), timeout=10)),
            "Get": await code_of(stub.Get(kvcache_pb2.GetRequest(block_hashes=[probe]), timeout=10)),
            "Lookup": await code_of(stub.Lookup(kvcache_pb2.LookupRequest(block_hashes=[probe]), timeout=10)),
            "Stats": await code_of(stub.Stats(kvcache_pb2.StatsRequest(), timeout=10)),
            "PutBlobs": await code_of(stub.PutBlobs(iter(block_puts(probe, b"emb")), timeout=10)),
            "GetBlobs": await code_of(stub.GetBlobs(kvcache_pb2.GetRequest(block_hashes=[probe]), timeout=10)),
        }


async def held(address: str, block_hash: bytes) -> int:
    """How many leading blocks of [block_hash] kvcache holds (asked as prefill)."""
    async with open_channel(address, GRPC_TOKENS["prefill"]) as channel:
        reply = await kvcache_pb2_grpc.KVCacheStub(channel).Lookup(kvcache_pb2.LookupRequest(block_hashes=[block_hash]))
        return reply.num_leading


@pytest.mark.asyncio
async def test_no_wrong_or_near_miss_token_gets_in(guarded_kvcache):
    for token in (None, "wrong-token", GRPC_TOKENS["prefill"] + "x", token_digest(GRPC_TOKENS["prefill"])):
        got = await calls_as(guarded_kvcache, token)
        assert set(got.values()) == {UNAUTHENTICATED}, (token, got)
    assert await held(guarded_kvcache, hashlib.sha256(b"probe wrong-token").digest()) == 0


@pytest.mark.asyncio
async def test_only_prefill_and_decode_store_and_read_blocks(guarded_kvcache):
    OK = grpc.StatusCode.OK
    got = {identity: await calls_as(guarded_kvcache, token) for identity, token in GRPC_TOKENS.items()}
    for worker in ("prefill", "decode"):  # blobs are vision's to store
        assert got[worker] == {"Put": OK, "PutShm": OK, "Get": OK, "Lookup": OK, "Stats": OK, "PutBlobs": DENIED,
                               "GetBlobs": OK}, worker
    assert got["vision"] == {"Put": DENIED, "PutShm": DENIED, "Get": DENIED, "Lookup": DENIED, "Stats": OK,
                             "PutBlobs": OK, "GetBlobs": OK}
    assert got["balancer"] == {"Put": DENIED, "PutShm": DENIED, "Get": DENIED, "Lookup": DENIED, "Stats": OK,
                               "PutBlobs": DENIED, "GetBlobs": DENIED}
    # What the refused identities tried to store is not there; what prefill and decode stored is.
    for identity in ("vision", "balancer"):
        assert await held(guarded_kvcache, hashlib.sha256(f"probe {GRPC_TOKENS[identity]}".encode()).digest()) == 0
    for identity in ("prefill", "decode"):
        assert await held(guarded_kvcache, hashlib.sha256(f"probe {GRPC_TOKENS[identity]}".encode()).digest()) == 1


@pytest.mark.asyncio
async def test_a_refused_put_says_who_was_refused_what(guarded_kvcache):
    async with open_channel(guarded_kvcache, GRPC_TOKENS["balancer"]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kvcache_pb2_grpc.KVCacheStub(channel).Put(iter(block_puts(b"\x07" * 32, b"x")), timeout=10)
    assert err.value.code() == DENIED
    assert err.value.details() == "balancer may not call /infermesh.v1.KVCache/Put"
