"""A NATS outage as the balancer lives it (issue 11), piece by piece; the whole of
it under load, 32 streams through a NATS restart, is tests/mesh/test_failover.py's.

- The registry does not read the balancer's own outage as every instance's death:
  paused while the connection is down, silence counts again only a grace after it
  is back, and no disconnect advisory counts meanwhile.
- A disconnect advisory for a connection the instance no longer beats on (its old
  one, closed after it reconnected) makes nobody leave; its current one's does.
- A stream that misses a seq, or says nothing once the bus is back, is lost
  (StreamLost) at once, not at the 30 s stream timeout.
- The bus says when NATS went and came back, buffers what is published meanwhile,
  and names its new connection."""

import asyncio
import signal
import subprocess
import time
import urllib.parse

import nats
import pytest

from services.balancer.router.departures import Departure, instance_departed
from services.balancer.router.registry import Registry
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import GAP_TIMEOUT_S, Bus, StreamLost, StreamReader
from shared.runtime.settings import NatsSettings
from tests.helpers.clock import Clock
from tests.helpers.mesh_procs import stop_process, wait_for_port
from tests.helpers.metrics import balancer_metric as metric
from tools.launch.up import find_nats_server, free_port


def beat(reg: Registry, iid: str, seq: int, connection: str = "") -> None:
    stage = iid.split("-")[0]
    hb = mesh_pb2.Heartbeat(stage=stage, instance_id=iid, seq=seq, interval_s=0.5)
    assert reg.on_heartbeat(hb, stage, iid, connection) is None


def test_the_registry_does_not_read_its_own_outage_as_every_instances_death():
    clock = Clock()
    reg = Registry(misses=3, clock=clock)
    left: list[tuple[str, str]] = []
    reg.on_removed.append(lambda inst, why: left.append((inst.instance_id, why.split(" ")[0])))
    beat(reg, "decode-0", 1, "S1/7")
    beat(reg, "prefill-0", 1, "S1/8")
    reg.pause()  # our connection dropped: 10 s without a heartbeat from anyone
    clock.now += 10
    assert reg.silent() == [] and reg.sweep() == [] and left == []
    assert [i.instance_id for i in reg.live("decode")] == ["decode-0"]  # still a candidate
    assert instance_departed(reg, Departure("decode-0", "decode-0", "Client Closed", "S1/7")) is None
    reg.resume(1.0)  # back: grace 1 s, then 3 missed intervals of 0.5 s
    clock.now += 0.9  # within the grace
    assert instance_departed(reg, Departure("decode-0", "decode-0", "Stale Connection", "S1/7")) is None
    clock.now += 1.1
    beat(reg, "prefill-0", 2, "S2/3")  # prefill reconnected (a new server, a new connection); decode did not
    clock.now += 0.4
    assert reg.sweep() == [] and left == []  # 2.4 s after the reconnect: not yet
    clock.now += 0.2
    assert [i.instance_id for i in reg.sweep()] == ["decode-0"]  # 2.6 s > 1 + 3 x 0.5: gone
    assert left == [("decode-0", "missed")]
    assert reg.num_departures_ignored == 2
    # After the grace, advisories count again, for the connection the instance beats on only.
    assert instance_departed(reg, Departure("prefill-0", "prefill-0", "Stale Connection", "S1/8")) is None
    assert reg.get("prefill-0") is not None and reg.num_departures_ignored == 3
    assert instance_departed(reg, Departure("prefill-0", "prefill-0", "Client Closed", "S2/3")) is not None
    assert left == [("decode-0", "missed"), ("prefill-0", "disconnected")]


def chunk(rid: str, seq: int, final: bool = False) -> mesh_pb2.TokenChunk:
    return mesh_pb2.TokenChunk(request_id=rid, instance_id="d0", seq=seq, token_ids=[100 + seq], final=final)


async def test_a_stream_that_misses_a_seq_or_stays_silent_after_an_outage_is_lost_at_once(nats_server):  # noqa: F811
    bus = await Bus.connect(NatsSettings(url=nats_server.url), "test")
    try:
        # Seq 1 never comes, seq 2 does: lost after GAP_TIMEOUT_S, not at the 30 s timeout.
        async with StreamReader(bus, "r1") as reader:
            await reader.listen("d0")
            for seq in (0, 2):
                await bus.publish(subjects.stream("d0", "r1"), chunk("r1", seq))
            got: list[int] = []
            started = time.monotonic()
            with pytest.raises(StreamLost, match="chunk 1 of d0's stream of r1 never came"):
                async for c in reader.chunks(30, 30):
                    got.append(c.seq)
                    started = time.monotonic()
            assert got == [0]
            # Not before the gap's timeout; after it, not the 30 s idle timeout (the match says which
            # check raised): the upper bound only has to stay clear of 30 s on a loaded machine.
            assert GAP_TIMEOUT_S * 0.9 < time.monotonic() - started < 10.0
        # The bus came back: a started stream must say something by the deadline.
        async with StreamReader(bus, "r2") as reader:
            await reader.listen("d0")
            await bus.publish(subjects.stream("d0", "r2"), chunk("r2", 0))
            started = time.monotonic()
            with pytest.raises(StreamLost, match="since NATS came back"):
                async for c in reader.chunks(30, 30):
                    assert reader.started
                    reader.expect_by(time.monotonic() + 0.3)  # what the balancer does when the bus is back
            assert time.monotonic() - started < 10.0  # expect_by's 0.3 s, not the 30 s idle timeout
        # A chunk by the deadline lifts it: the stream ends as usual.
        async with StreamReader(bus, "r3") as reader:
            await reader.listen("d0")
            reader.expect_by(time.monotonic() + 0.5)
            await bus.publish(subjects.stream("d0", "r3"), chunk("r3", 0))
            await asyncio.sleep(0.8)
            await bus.publish(subjects.stream("d0", "r3"), chunk("r3", 1, final=True))
            assert [c.seq async for c in reader.chunks(30, 30)] == [0, 1]
    finally:
        await bus.close()


def start_nats(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([find_nats_server(), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port, proc=proc)
    return proc


async def test_the_bus_says_when_nats_went_and_came_back_and_sends_what_it_buffered():
    port = free_port()
    proc = start_nats(port)
    url = f"nats://127.0.0.1:{port}"
    bus = await Bus.connect(NatsSettings(url=url), "sender")
    events: list[str] = []
    bus.on_disconnected.append(lambda: events.append("down"))
    bus.on_reconnected.append(lambda: events.append("up"))
    before = bus.connection_id()
    received: list[str] = []

    async def on_cancel(msg: mesh_pb2.Cancel) -> None:
        received.append(msg.request_id)

    await bus.subscribe("outage.test", mesh_pb2.Cancel, on_cancel)
    try:
        assert bus.connected and before and bus.down_since is None
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 5
        while bus.down_since is None:
            assert time.monotonic() < deadline, "the bus did not notice NATS went"
            await asyncio.sleep(0.02)
        assert not bus.connected and events == ["down"]
        # Published while NATS is down: buffered, sent once it is back, to our own
        # subscription, made again on the new server before the buffer goes out.
        await bus.publish("outage.test", mesh_pb2.Cancel(request_id="while-down"))
        proc = start_nats(port)
        assert await bus.wait_connected(10)
        assert events == ["down", "up"] and bus.reconnected_at is not None
        assert bus.connection_id() not in ("", before)  # a new server, a new connection
        deadline = time.monotonic() + 5
        while not received and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert received == ["while-down"]
    finally:
        await bus.close()
        stop_process(proc)


def test_an_old_connection_of_an_instance_closing_does_not_make_it_leave(start_mesh):
    """As nats-server does when it notices late that a worker's old connection died
    (the worker reconnected meanwhile): a real advisory naming decode-0, from
    decode-0's user, for a connection decode-0 no longer beats on. It stays; its
    real death still makes it leave at once."""
    mesh = start_mesh()
    port = urllib.parse.urlsplit(mesh.nats_url).port
    user, password = mesh.credentials("decode-0")

    async def old_connection_closes() -> None:
        nc = await nats.connect(f"nats://127.0.0.1:{port}", name="decode-0", user=user, password=password,
                                inbox_prefix=f"_INBOX.{user}", allow_reconnect=False)
        await nc.close()

    asyncio.run(old_connection_closes())
    deadline = time.monotonic() + 5
    while not (metric(mesh, "departures_ignored_total") or metric(mesh, "instances_left_total")):
        assert time.monotonic() < deadline, "the advisory never reached the balancer"
        time.sleep(0.05)
    time.sleep(0.3)
    assert metric(mesh, "instances_left_total") == 0  # decode-0 stays
    assert metric(mesh, "departures_ignored_total") == 1
    dict(mesh.procs)["decode-0"].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    # Heard from nats-server's advisory ("disconnected"), not the heartbeat backstop ("missed",
    # which would keep this label at 0 and fail): the label, not a race against the
    # backstop's ~1.6 s, says how it was heard, so the deadline can be generous.
    while not metric(mesh, "instances_left_total", why="disconnected"):
        assert time.monotonic() - killed < 10.0, "decode-0's death was not heard from its advisory"
        time.sleep(0.05)
    assert metric(mesh, "instances_left_total") == 1
