"""Mutual TLS on the gRPC plane, with real certificates (openssl) and real
servers: a kvcache process given worker.tls_* refuses a client that brings no
certificate, or one signed by another CA, before any call (health included);
its own CA's client certificate plus the token gets in; and a whole mesh with
TLS on serves, its workers storing to and loading from kvcache over TLS."""

import asyncio
import json
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.proto import kvcache_pb2, kvcache_pb2_grpc
from shared.runtime.rpc import TlsFiles, check_health, open_channel
from shared.runtime.settings import WorkerSettings
from tests.helpers.certs import Cert, make_ca, make_cert
from tests.helpers.mesh import GRPC_PEERS, GRPC_TOKEN
from tests.helpers.mesh_procs import span_attributes, start_service, stop_process
from tools.launch.up import free_port, grpc_serving


def tls_of(cert: Cert, ca: Cert) -> TlsFiles:
    return TlsFiles(cert.cert.read_bytes(), cert.key.read_bytes(), ca.cert.read_bytes())


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Cert]:
    folder = tmp_path_factory.mktemp("pki")
    ca, other_ca = make_ca(folder, "mesh-ca"), make_ca(folder, "other-ca")
    return {"ca": ca, "other_ca": other_ca, "kvcache": make_cert(folder, ca, "kvcache"),
            "prefill": make_cert(folder, ca, "prefill"), "rogue": make_cert(folder, other_ca, "rogue")}


@pytest.fixture(scope="module")
def tls_kvcache(pki, nats_server, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("tls-kvcache")
    address = f"127.0.0.1:{free_port()}"
    env = {"INFERMESH_KVCACHE__ADDRESS": address, "INFERMESH_KVCACHE__PATH": str(folder / "lmdb"),
           "INFERMESH_NATS__URL": nats_server.url, "INFERMESH_WORKER__GRPC_PEERS": GRPC_PEERS,
           "INFERMESH_TELEMETRY__TRACE_DIR": str(folder / "traces"), **pki["kvcache"].env(pki["ca"])}
    proc = start_service("kvcache", env, folder / "kvcache.log")
    tls = tls_of(pki["prefill"], pki["ca"])
    for _ in range(300):
        if grpc_serving(address, tls=tls):
            break
        assert proc.poll() is None, (folder / "kvcache.log").read_text()
        asyncio.run(asyncio.sleep(0.1))
    else:
        raise TimeoutError("kvcache with TLS never served")
    yield address
    stop_process(proc)


def test_tls_settings_go_together_and_name_what_is_missing(pki, tmp_path):
    assert TlsFiles.load(WorkerSettings()) is None
    with pytest.raises(ValueError, match="worker.tls_ca is not set"):
        TlsFiles.load(WorkerSettings(tls_cert=str(pki["kvcache"].cert), tls_key=str(pki["kvcache"].key)))
    with pytest.raises(ValueError, match="worker.tls_key: cannot read"):
        TlsFiles.load(WorkerSettings(tls_cert=str(pki["kvcache"].cert), tls_key=str(tmp_path / "none"),
                                     tls_ca=str(pki["ca"].cert)))


async def put_and_lookup(address: str, tls: TlsFiles | None, token: str | None = GRPC_TOKEN) -> int:
    """Store one block and ask how many leading blocks of it the store holds."""
    block = bytes(range(32))
    channel = open_channel(address, token, tls) if tls else grpc.aio.insecure_channel(address)
    async with channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        metadata = (("authorization", f"Bearer {token}"),) if token and not tls else None

        puts = [kvcache_pb2.PutRequest(header=kvcache_pb2.BlockHeader(block_hash=block, num_bytes=4, layout="x")),
                kvcache_pb2.PutRequest(data=b"\x00\x01\x02\x03")]
        await stub.Put(iter(puts), timeout=5, metadata=metadata)
        reply = await stub.Lookup(kvcache_pb2.LookupRequest(block_hashes=[block]), timeout=5, metadata=metadata)
        return reply.num_leading


@pytest.mark.asyncio
async def test_kvcache_over_mutual_tls_takes_its_cas_clients_only(pki, tls_kvcache):
    ours, rogue = tls_of(pki["prefill"], pki["ca"]), tls_of(pki["rogue"], pki["other_ca"])
    assert await put_and_lookup(tls_kvcache, ours) == 1
    # No TLS at all (the token alone), TLS without a client certificate, a certificate of another CA
    # (trusting our CA, so only the client side is wrong): the handshake fails, nothing runs.
    no_client_cert = grpc.ssl_channel_credentials(root_certificates=pki["ca"].cert.read_bytes())
    rogue_trusting_us = TlsFiles(rogue.cert, rogue.key, ours.ca)
    for name, attempt in (("plaintext with the token", put_and_lookup(tls_kvcache, None)),
                          ("a certificate of another CA", put_and_lookup(tls_kvcache, rogue_trusting_us))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await attempt
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name
    async with grpc.aio.secure_channel(tls_kvcache, no_client_cert) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # Health answers our certificate only; a server certificate of another CA is refused by our client.
    assert await check_health(tls_kvcache, tls=ours)
    assert not await check_health(tls_kvcache, tls=rogue)
    assert not await check_health(tls_kvcache, tls=TlsFiles(ours.cert, ours.key, rogue.ca))
    # The token is still checked under TLS.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await put_and_lookup(tls_kvcache, ours, token="wrong")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_mesh_serves_with_mutual_tls_on(start_mesh, mesh_model_dir, pki):
    mesh = start_mesh(extra_env={**pki["kvcache"].env(pki["ca"]), "INFERMESH_ENGINE__BLOCK_SIZE": "16",
                                 "INFERMESH_ENGINE__KV_DIRECT_TRANSFER": "false"})
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=60)
    name = client.models.list().data[0].id
    prompt = "".join(f"line {i}: enough text to fill a few KV blocks of sixteen tokens\n" for i in range(4))
    first = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
    second = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
    assert first.choices[0].text == second.choices[0].text and first.usage.completion_tokens == 8
    # kvcache answered over TLS: prefill's lookup ("ok"), and decode loaded the blocks from it.
    assert span_attributes(mesh.trace_dir, first.id, "prefill")["kv.kvcache"] == "ok"
    assert span_attributes(mesh.trace_dir, first.id, "decode")["kv.loaded_blocks"] > 0
    # The balancer's probe gets through too: kvcache is "up", not "down".
    with urllib.request.urlopen(mesh.api_url.removesuffix("/v1") + "/ready", timeout=5) as resp:
        assert json.loads(resp.read())["kvcache"] == "up"
