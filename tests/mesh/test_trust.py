"""The mesh's planes as an attacker on this machine sees them (issue 11).

NATS: a real nats-server with the users and permissions `infermesh up` writes
(tools/launch/nats_auth.py); attackers are clients with no, wrong or another
role's credentials. The running mesh: `infermesh up` itself, as a user starts
it: forged kvcache writes without a token or with another service's (the
balancer's: only prefill and decode store blocks), what listens where, a worker
killed with SIGKILL (restarted, the mesh serves again) and `up` killed with
SIGKILL (no child survives it)."""

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import nats
import pytest

from services.balancer.frontend.responses_store import StoredResponse
from services.balancer.response_kv import JetStreamResponseStore
from shared.proto import kvcache_pb2, kvcache_pb2_grpc, mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import inbox_prefix
from shared.runtime.rpc import open_channel
from shared.runtime.settings import Settings
from tests.helpers.mesh_procs import ROOT, listening, stop_process, wait_for_port
from tests.helpers.nats_clients import Client, connected, settle, violations
from tools.launch.nats_auth import MeshCredentials, stream_subjects
from tools.launch.up import find_nats_server, free_port

STREAMS_NAME_THE_INSTANCE = stream_subjects("decode-0") != stream_subjects("*")


# -- NATS: the users and permissions of `up` ------------------------------------------------------


class AuthNats:
    """nats-server with up's credentials: two instances per stage, the balancer, kvcache, monitor."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.creds = MeshCredentials()
        for role in ("balancer", "kvcache", "monitor"):
            self.creds.add(role, role)
        for stage in ("prefill", "decode"):
            for i in range(2):
                self.creds.add(f"{stage}-{i}", stage, instance=f"{stage}-{i}")
        conf = workdir / "nats-auth.conf"
        self.creds.write_config(conf, "127.0.0.1", self.port)
        self.conf = conf
        # JetStream on, as `up` runs it: the balancers' responses bucket lives there.
        self.proc = subprocess.Popen([find_nats_server(), "-c", str(conf), "-js", "-sd", str(workdir / "js")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, proc=self.proc)


@pytest.fixture(scope="module")
def auth_nats(tmp_path_factory):
    server = AuthNats(tmp_path_factory.mktemp("auth-nats"))
    yield server
    stop_process(server.proc)


async def as_user(server: AuthNats, user: str) -> Client:
    return await Client().connect(server.url, user, server.creds.users[user].password)


@pytest.mark.asyncio
async def test_nats_refuses_clients_without_or_with_wrong_credentials(auth_nats):
    for user, password in ((None, None), ("balancer", "wrong"), ("balancer", None), ("root", "root"),
                           ("decode-0", auth_nats.creds.users["prefill-0"].password)):
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await Client().connect(auth_nats.url, user, password)
    ok = await as_user(auth_nats, "balancer")
    await ok.nc.close()


@pytest.mark.asyncio
async def test_only_the_balancer_reads_and_writes_the_responses_bucket(auth_nats):
    """The balancer's grants (tools/launch/nats_auth.py) cover the store's every call;
    a worker can neither open the bucket, read an entry (directly or by subscribing
    to its subjects) nor write one: the store holds users' conversations."""
    balancer, worker = await as_user(auth_nats, "balancer"), await as_user(auth_nats, "decode-0")
    try:
        store = await JetStreamResponseStore.open(balancer.nc, subjects.RESPONSES_BUCKET, ttl_s=60)
        kept = StoredResponse({"id": "resp_1", "object": "response"}, [{"role": "user", "content": "secret"}])
        await store.put("resp_1", kept)
        assert await store.get("resp_1") == kept
        js = worker.nc.jetstream(timeout=1)
        with pytest.raises(Exception):  # the server drops the request: no reply comes
            await js.key_value(subjects.RESPONSES_BUCKET)
        with pytest.raises(Exception):
            await js.get_last_msg(f"KV_{subjects.RESPONSES_BUCKET}", f"$KV.{subjects.RESPONSES_BUCKET}.resp_1")
        got = await worker.received(f"$KV.{subjects.RESPONSES_BUCKET}.>")
        await worker.nc.publish(f"$KV.{subjects.RESPONSES_BUCKET}.resp_1", b"forged")
        await settle(worker, balancer)
        assert got == [] and violations(worker, "subscription") and violations(worker, "publish")
        assert await store.get("resp_1") == kept
        assert await store.delete("resp_1") and await store.get("resp_1") is None
        assert not await store.delete("resp_1")
    finally:
        for c in (balancer, worker):
            await c.nc.close()


@pytest.mark.asyncio
async def test_a_worker_cannot_dispatch_cancel_or_forge_another_stages_heartbeats(auth_nats):
    prefill, balancer = await as_user(auth_nats, "prefill-0"), await as_user(auth_nats, "balancer")
    attacker = await as_user(auth_nats, "decode-0")
    try:
        runs = await prefill.received(subjects.prefill_run("prefill-0"))
        cancels = await prefill.received(subjects.CANCEL)
        heartbeats = await balancer.received(subjects.HEARTBEAT_ALL)
        forged_hb = mesh_pb2.Heartbeat(instance_id="prefill-9", stage="prefill").SerializeToString()
        await attacker.nc.publish(subjects.prefill_run("prefill-0"), b"forged dispatch")
        await attacker.nc.publish(subjects.CANCEL, mesh_pb2.Cancel(request_id="victim").SerializeToString())
        await attacker.nc.publish(subjects.heartbeat("prefill", "prefill-9"), forged_hb)
        await settle(attacker, prefill, balancer)
        assert runs == [] and cancels == [] and heartbeats == []
        assert len(violations(attacker, "publish")) == 3, attacker.errors
        # The same subjects work for the roles they belong to: the refusals above are permissions.
        await balancer.nc.publish(subjects.prefill_run("prefill-0"), b"dispatch")
        await balancer.nc.publish(subjects.CANCEL, b"cancel")
        await attacker.nc.publish(subjects.heartbeat("decode", "decode-0"), b"its own heartbeat")
        await settle(attacker, prefill, balancer, until=lambda: runs and cancels and heartbeats)
        assert [m.data for m in runs] == [b"dispatch"] and [m.data for m in cancels] == [b"cancel"]
        assert [m.subject for m in heartbeats] == [subjects.heartbeat("decode", "decode-0")]
    finally:
        for c in (prefill, balancer, attacker):
            await c.nc.close()


@pytest.mark.asyncio
async def test_a_worker_cannot_speak_in_another_instances_name(auth_nats):
    """decode-0's own credentials: its heartbeats and KV events go out on its own
    subjects only; another decode instance's (which would keep a dead decode-1 alive,
    or mark a live one draining), a prefill's KV events (which steer prompts), and
    nats-server's departure advisories (which would make the balancer fail others
    over) are refused by the server, so the balancer never sees them."""
    balancer, attacker = await as_user(auth_nats, "balancer"), await as_user(auth_nats, "decode-0")
    try:
        heartbeats = await balancer.received(subjects.HEARTBEAT_ALL)
        events = await balancer.received(subjects.KV_EVENTS_ALL)
        departures = await balancer.received(subjects.CLIENT_DISCONNECTED)
        await connected(attacker, subjects.heartbeat("decode", "decode-0"), heartbeats, balancer)
        as_decode_1 = mesh_pb2.Heartbeat(instance_id="decode-1", stage="decode", seq=1 << 40, draining=True)
        await attacker.nc.publish(subjects.heartbeat("decode", "decode-1"), as_decode_1.SerializeToString())
        kv = mesh_pb2.KvEvent(instance_id="prefill-0", stored=[b"\x01" * 32])
        await attacker.nc.publish(subjects.kv_events("prefill-0"), kv.SerializeToString())
        await attacker.nc.publish(subjects.kv_events("decode-1"), kv.SerializeToString())
        fake = b'{"type": "io.nats.server.advisory.v1.client_disconnect", "client": {"name": "decode-1"}}'
        await attacker.nc.publish(subjects.CLIENT_DISCONNECTED, fake)
        await settle(attacker, balancer)
        assert heartbeats == [] and events == [] and departures == []
        assert len(violations(attacker, "publish")) == 4, attacker.errors
        # Its own name works (what the balancer then checks: the body names the subject's instance).
        await attacker.nc.publish(subjects.heartbeat("decode", "decode-0"), b"mine")
        await attacker.nc.publish(subjects.kv_events("decode-0"), b"mine")
        await settle(attacker, balancer, until=lambda: heartbeats and events)
        assert [m.subject for m in heartbeats + events] == [subjects.heartbeat("decode", "decode-0"),
                                                              subjects.kv_events("decode-0")]
    finally:
        await balancer.nc.close()
        await attacker.nc.close()


@pytest.mark.asyncio
async def test_nats_tells_the_balancer_when_a_worker_connection_closes(auth_nats):
    """The server's departure advisory reaches the balancer's subject (and nobody else's)
    within moments, naming the connection and its user: how a killed worker is noticed."""
    balancer, monitor = await as_user(auth_nats, "balancer"), await as_user(auth_nats, "monitor")
    try:
        departures = await balancer.received(subjects.CLIENT_DISCONNECTED)
        spied = await monitor.received(subjects.CLIENT_DISCONNECTED)
        worker = Client()
        await worker.connect(auth_nats.url, "decode-1", auth_nats.creds.users["decode-1"].password)
        await worker.nc.close()
        await settle(balancer, until=lambda: departures)
        assert [json.loads(m.data)["client"]["user"] for m in departures] == ["decode-1"]
        assert spied == [] and len(violations(monitor, "subscription")) == 1
    finally:
        await balancer.nc.close()
        await monitor.nc.close()


@pytest.mark.asyncio
async def test_no_one_but_the_instance_reads_its_prompts(auth_nats):
    """Dispatches carry prompts: neither a decode instance, nor another prefill
    instance, nor kvcache or the monitor may subscribe to prefill-0's."""
    balancer, owner = await as_user(auth_nats, "balancer"), await as_user(auth_nats, "prefill-0")
    try:
        mine = await owner.received(subjects.prefill_run("prefill-0"))
        for name in ("prefill-1", "decode-0", "kvcache", "monitor"):
            spy = await as_user(auth_nats, name)
            stolen = [await spy.received(s) for s in (subjects.prefill_run("prefill-0"), "im.prefill.>", ">")]
            stolen.append(await spy.received(subjects.decode_admit("decode-1")))  # handoffs carry prompts too
            await settle(spy)
            await balancer.nc.publish(subjects.prefill_run("prefill-0"), b"secret prompt")
            expected = len(mine) + 1
            await settle(balancer, owner, spy, until=lambda: len(mine) >= expected)  # noqa: B023
            assert stolen == [[], [], [], []], name
            assert len(violations(spy, "subscription")) == 4, (name, spy.errors)
            await spy.nc.close()
        assert [m.data for m in mine] == [b"secret prompt"] * 4
    finally:
        await balancer.nc.close()
        await owner.nc.close()


@pytest.mark.skipif(not STREAMS_NAME_THE_INSTANCE,
                    reason="stream subjects do not name the publishing instance yet (shared/runtime/subjects.py)")
@pytest.mark.asyncio
async def test_a_worker_cannot_publish_into_another_instances_stream(auth_nats):
    balancer = await as_user(auth_nats, "balancer")
    attacker = await as_user(auth_nats, "decode-1")
    try:
        chunks = await balancer.received(stream_subjects("*"))
        await connected(attacker, subjects.stream("decode-1", "hello"), chunks, balancer)
        await attacker.nc.publish(subjects.stream("decode-0", "victim"), b"injected tokens")
        await attacker.nc.publish(subjects.stream("decode-1", "mine"), b"its own stream")
        await settle(attacker, balancer, until=lambda: chunks)
        assert [m.subject for m in chunks] == [subjects.stream("decode-1", "mine")]
        assert len(violations(attacker, "publish")) == 1, attacker.errors
    finally:
        await balancer.nc.close()
        await attacker.nc.close()


@pytest.mark.asyncio
async def test_replies_go_to_the_asker_only(auth_nats):
    """A request's reply subject is the asker's own inbox: another user cannot listen on it."""
    balancer, owner = await as_user(auth_nats, "balancer"), await as_user(auth_nats, "prefill-0")
    spy = await as_user(auth_nats, "prefill-1")
    try:
        async def answer(msg) -> None:  # noqa: ANN001
            await msg.respond(b"ack")

        await owner.nc.subscribe(subjects.prefill_run("prefill-0"), cb=answer)
        await owner.nc.flush()  # the server has the subscription before the request comes
        stolen = await spy.received(inbox_prefix("balancer") + ".>")
        reply = await balancer.nc.request(subjects.prefill_run("prefill-0"), b"prompt", timeout=5)
        await settle(spy)
        assert reply.data == b"ack" and stolen == []
        assert violations(spy, "subscription"), spy.errors
    finally:
        for c in (balancer, owner, spy):
            await c.nc.close()


# -- `infermesh up`: the token, the binds, supervision ----------------------------------------------


def children(pid: int) -> list[int]:
    """Processes whose parent is pid."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Up:
    """`infermesh up` as a user runs it, in its own process."""

    def __init__(self, model: str, state: Path) -> None:
        self.state = state
        self.port = free_port()
        self.log = (state / "up.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", "up", "--model", model, "--port", str(self.port),
             "--state-dir", str(state), "--prefill", "1", "--decode", "1"],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2"},
        )
        deadline = time.monotonic() + 240
        while "InferMesh is up" not in self.output():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()[-3000:]
            time.sleep(0.2)

    def output(self) -> str:
        return (self.state / "up.log").read_text()

    def child(self, name: str) -> int:
        """The pid of a child by the service it runs (python -m services.<stage>) and instance id."""
        for pid in children(self.proc.pid):
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if name == "nats" and b"nats-server" in cmd[0]:
                    return pid
                if f"services.{name.split('-')[0]}".encode() in cmd and (
                        "-" not in name or f"INFERMESH_WORKER__INSTANCE_ID={name}".encode() in env):
                    return pid
        raise LookupError(name)

    def token(self, name: str = "prefill-0") -> str:
        """The gRPC token up gave the child `name` (its stage's identity's)."""
        env = Path(f"/proc/{self.child(name)}/environ").read_bytes().split(b"\0")
        return next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"INFERMESH_WORKER__GRPC_TOKEN="))

    def kv_address(self) -> str:
        env = Path(f"/proc/{self.child('kvcache')}/environ").read_bytes().split(b"\0")
        return next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"INFERMESH_KVCACHE__ADDRESS="))

    def complete(self) -> int:
        api = f"http://127.0.0.1:{self.port}/v1"
        model = httpx.get(f"{api}/models", timeout=30).json()["data"][0]["id"]
        reply = httpx.post(f"{api}/completions", timeout=60,
                           json={"model": model, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["completion_tokens"]


@pytest.fixture(scope="module")
def up(mesh_model_dir, tmp_path_factory):
    mesh = Up(mesh_model_dir, tmp_path_factory.mktemp("up"))
    yield mesh
    if mesh.proc.poll() is None:
        stop_process(mesh.proc, timeout_s=30)


def test_up_writes_its_secrets_for_its_user_only(up):
    conf = up.state / "nats-auth.conf"
    assert conf.stat().st_mode & 0o777 == 0o600
    text = conf.read_text()
    # One user per instance number the supervisor may scale to (the planner's max_replicas).
    slots = Settings().planner.max_replicas
    instances = {f"{stage}-{i}" for stage in ("prefill", "decode", "vision") for i in range(slots)}
    assert {"balancer", "kvcache", "monitor", "admin"} | instances == set(re.findall(r'user: "([^"]+)"', text))
    tokens = {up.token(name) for name in ("prefill-0", "decode-0", "balancer")}
    assert len(tokens) == 3, "each service its own token"
    assert not any(token in up.output() for token in tokens)


def test_every_service_listens_on_loopback_only(up):
    names = ["nats", "kvcache", "prefill-0", "decode-0", "balancer"]
    for name in names:
        addresses = listening(up.child(name))
        assert addresses, name
        assert all(a in ("127.0.0.1", "::1") for a, _ in addresses), (name, addresses)
    # kvcache: gRPC and /metrics; workers: gRPC and /metrics; the balancer: HTTP and /metrics.
    assert len(listening(up.child("kvcache"))) >= 2 and len(listening(up.child("decode-0"))) >= 2


@pytest.mark.asyncio
async def test_kvcache_refuses_forged_puts_without_a_workers_token_and_stores_nothing(up):
    forged = hashlib.sha256(b"poisoned block").digest()
    puts = [kvcache_pb2.PutRequest(header=kvcache_pb2.BlockHeader(block_hash=forged, num_bytes=4, layout="x")),
            kvcache_pb2.PutRequest(data=b"evil")]
    address = up.kv_address()
    for token in (None, "wrong-token", up.token() + "x"):
        async with grpc.aio.insecure_channel(address) if token is None else open_channel(address, token) as ch:
            stub = kvcache_pb2_grpc.KVCacheStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Put(iter(puts))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, token
            for call in (stub.Lookup(kvcache_pb2.LookupRequest(block_hashes=[forged])),
                         stub.Stats(kvcache_pb2.StatsRequest()), stub.PutShm(kvcache_pb2.PutShmRequest())):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                _ = [r async for r in stub.Get(kvcache_pb2.GetRequest(block_hashes=[forged]))]
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The balancer's own token is a real identity of the mesh, but not one that stores blocks.
    async with open_channel(address, up.token("balancer")) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kvcache_pb2_grpc.KVCacheStub(ch).Put(iter(puts))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with open_channel(address, up.token()) as ch:
        stub = kvcache_pb2_grpc.KVCacheStub(ch)
        assert (await stub.Lookup(kvcache_pb2.LookupRequest(block_hashes=[forged]))).num_leading == 0
        await stub.Put(iter([kvcache_pb2.PutRequest(header=kvcache_pb2.BlockHeader(
            block_hash=hashlib.sha256(b"honest").digest(), num_bytes=2, layout="x")), kvcache_pb2.PutRequest(data=b"ok")]))


def kill_and_wait_for_restart(up: Up, name: str) -> None:
    """SIGKILL the child `name`; return once up has started it again (and logged why)."""
    victim = up.child(name)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(LookupError):
            if up.child(name) != victim:
                break
        assert time.monotonic() < deadline, up.output()[-3000:]
        time.sleep(0.2)
    assert re.search(rf"{name} exited with -9 .*restarting", up.output())


def serves_again(up: Up, timeout_s: float = 60) -> None:
    """A completion succeeds within timeout_s (the balancer needs the new
    instance's heartbeats, and may still hold the dead one for a few)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            assert up.complete() >= 1
            return
        except (AssertionError, httpx.HTTPError):
            if time.monotonic() > deadline:
                raise
        time.sleep(0.3)


def test_a_worker_killed_with_sigkill_is_restarted_and_the_mesh_serves_again(up):
    assert up.complete() >= 1
    kill_and_wait_for_restart(up, "decode-0")
    serves_again(up)
    assert up.proc.poll() is None and all(alive(up.child(n)) for n in ("nats", "kvcache", "prefill-0", "balancer"))


def test_nats_killed_with_sigkill_is_restarted_and_the_services_log_in_again(up):
    others = {n: up.child(n) for n in ("kvcache", "prefill-0", "decode-0", "balancer")}
    kill_and_wait_for_restart(up, "nats")
    serves_again(up)
    assert {n: up.child(n) for n in others} == others  # nobody else was restarted: they reconnected


def test_up_killed_with_sigkill_leaves_no_child(up):
    kids = children(up.proc.pid)
    assert len(kids) == 5, kids
    up.proc.send_signal(signal.SIGKILL)
    up.proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in kids if alive(pid)]


def test_up_stopped_with_sigterm_drains_everything_and_restarts_nothing(mesh_model_dir, tmp_path):
    up = Up(mesh_model_dir, tmp_path)
    kids = {n: up.child(n) for n in ("nats", "kvcache", "prefill-0", "decode-0", "balancer")}
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0
    assert not [n for n, pid in kids.items() if alive(pid)]
    assert "restart" not in up.output().split("stopping the mesh")[-1]  # the supervisor stood down
    for name in ("kvcache", "prefill-0", "decode-0", "balancer"):  # each drained on its SIGTERM
        assert "stopping" in (tmp_path / "logs" / f"{name}.log").read_text(), name
