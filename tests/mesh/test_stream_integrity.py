"""Trust on the bus: a token stream is accepted only from the instance the
request was handed to, and a heartbeat's claims are bounded.

The StreamReader tests run against a real nats-server; the mesh tests play an
attacker with a NATS connection of its own (no permissions in these meshes, so
it can publish anywhere: what it must not achieve is text in a victim's answer
or work for an instance that does not exist)."""

import asyncio
import concurrent.futures
import threading
import time
import urllib.request

import nats
import openai
import pytest

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import Bus, StreamReader
from shared.runtime.settings import NatsSettings
from tests.helpers.metrics import balancer_metric as metric
from tools.launch.trace_view import load_spans

ENV = {"INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2"}
SETTLE_S = 10.0
"""How long the balancer (and its trace file) may take to count what it was sent: a generous
deadline for a condition, not a fixed sleep that a loaded 2-core machine can outrun."""


def eventually(what: str, check) -> None:  # noqa: ANN001
    deadline = time.monotonic() + SETTLE_S
    while not check():
        assert time.monotonic() < deadline, f"{what} not within {SETTLE_S} s"
        time.sleep(0.05)


def chunk(rid: str, instance: str, seq: int = 0, tokens: tuple[int, ...] = (1,), **fields) -> mesh_pb2.TokenChunk:
    return mesh_pb2.TokenChunk(request_id=rid, instance_id=instance, seq=seq, token_ids=tokens, **fields)


async def test_the_reader_takes_tokens_only_from_its_source_and_errors_from_prefill(nats_server):  # noqa: F811
    bus = await Bus.connect(NatsSettings(url=nats_server.url), "test")
    rejected: list[tuple[str, str]] = []
    try:
        async with StreamReader(bus, "r1", lambda reason, c: rejected.append((reason, c.instance_id))) as reader:
            await reader.listen("d0")
            await reader.listen("p0", source=False)
            on_d0, on_p0 = subjects.stream("d0", "r1"), subjects.stream("p0", "r1")
            await bus.publish(on_d0, chunk("r1", "evil", seq=0, tokens=(66,)))  # another instance on d0's subject
            await bus.publish(on_d0, chunk("r2", "d0", seq=0, tokens=(66,)))  # another request's chunk
            await bus.publish(on_p0, chunk("r1", "p0", seq=0, tokens=(66,)))  # tokens from prefill
            await bus.publish(subjects.stream("evil", "r1"), chunk("r1", "evil"))  # a subject nobody listens to
            await bus.nc.publish(on_d0, b"\xff\xff not a chunk")
            await bus.publish(on_d0, chunk("r1", "d0", seq=0, tokens=(1,)))
            await bus.publish(on_d0, chunk("r1", "d0", seq=1, tokens=(2,), final=True))
            got = [list(c.token_ids) async for c in reader.chunks(5, 5)]
        assert got == [[1], [2]]
        assert sorted(rejected) == [("instance_mismatch", "evil"), ("malformed", ""), ("not_the_source", "p0"),
                                    ("request_mismatch", "d0")]  # two subscriptions: no order between them
        # Prefill may end the request with an error (before decode has it).
        async with StreamReader(bus, "r3") as reader:
            await reader.listen("d0")
            await reader.listen("p0", source=False)
            await bus.publish(subjects.stream("p0", "r3"), chunk("r3", "p0", tokens=(), error="boom", final=True))
            got_errors = [c.error async for c in reader.chunks(5, 5)]
        assert got_errors == ["boom"]
        # fail() ends the iteration at once (the registry lost the instance).
        async with StreamReader(bus, "r4") as reader:
            await reader.listen("d0")
            reader.fail(ConnectionError("d0 left"))
            with pytest.raises(ConnectionError, match="d0 left"):
                async for _ in reader.chunks(5, 5):
                    pass
    finally:
        await bus.close()


# -- against a mesh ------------------------------------------------------------------------


def ready(mesh) -> dict:
    import json

    with urllib.request.urlopen(mesh.api_url.removesuffix("/v1") + "/ready", timeout=5) as resp:
        return json.loads(resp.read())


class Attacker:
    """A NATS client that watches every token stream and, for each request it sees,
    publishes forged chunks with the next seq: on the victim's subject as itself, and
    on the old subject form as the decode instance."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.forged = 0
        self.victims: set[str] = set()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    async def _run(self) -> None:
        nc = await nats.connect(self.nats_url)

        async def on_chunk(msg) -> None:  # noqa: ANN001
            real = mesh_pb2.TokenChunk()
            real.ParseFromString(msg.data)
            if real.final or real.instance_id == "attacker":  # not our own forgeries
                return
            self.victims.add(real.request_id)
            forged = chunk(real.request_id, "attacker", seq=real.seq + 1, tokens=(7, 7, 7))
            await nc.publish(msg.subject, forged.SerializeToString())
            forged.instance_id = real.instance_id
            await nc.publish(f"im.stream.{real.request_id}", forged.SerializeToString())
            self.forged += 1

        await nc.subscribe("im.stream.*.*", cb=on_chunk)
        await nc.flush()
        self._ready.set()
        while not self._stop.is_set():
            await asyncio.sleep(0.05)
        await nc.drain()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def test_forged_chunks_never_reach_the_client_and_are_counted(start_mesh, mesh_model_dir):
    mesh = start_mesh(extra_env=ENV)
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=60)
    name = client.models.list().data[0].id
    prompts = [f"victim {i} says:" for i in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [o.text for o in LLM(mesh_model_dir).generate(prompts, params)]
    attacker = Attacker(mesh.nats_url)
    try:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            outs = list(pool.map(lambda p: client.completions.create(
                model=name, prompt=p, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}), prompts))
    finally:
        attacker.stop()
    assert [o.choices[0].text for o in outs] == expected  # 0 of 5 answers carry forged text
    assert len(attacker.victims) == 5 and attacker.forged >= 5 * 20
    eventually("every forgery on the old subject counted",
               lambda: metric(mesh, "stream_chunks_rejected_total", reason="old_subject") >= attacker.forged)
    # Forged chunks on a victim's subject were dropped and counted, but those that came
    # after the stream's end (nobody listens any more: a lagging attacker races the last
    # chunks); those on the old form all (the balancer subscribes there only to count them).
    on_subject = metric(mesh, "stream_chunks_rejected_total", reason="instance_mismatch")
    assert 5 <= on_subject <= attacker.forged
    assert metric(mesh, "stream_chunks_rejected_total", reason="old_subject") == attacker.forged
    # ... and each request's span says how many of its chunks were dropped.
    ids = {o.id for o in outs}
    eventually("each request's span written", lambda: ids <= {
        s["attributes"].get("request.id") for s in load_spans(mesh.trace_dir) if s["name"].startswith("POST ")})
    counts = {s["attributes"]["request.id"]: s["attributes"].get("stream.rejected_chunks", 0)
              for s in load_spans(mesh.trace_dir) if s["name"].startswith("POST ")}
    # (Most, not all: on a loaded machine the attacker's thread can lag one whole stream.)
    assert sum(counts[o.id] >= 1 for o in outs) >= 3 and sum(counts[o.id] for o in outs) <= on_subject


def test_a_forged_heartbeat_is_refused_or_expires_and_gets_no_work(start_mesh):
    mesh = start_mesh(extra_env=ENV)
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=60)
    name = client.models.list().data[0].id

    async def forge(*beats: mesh_pb2.Heartbeat, subject: str | None = None) -> None:
        nc = await nats.connect(mesh.nats_url)  # the operator: past NATS's permissions, as a Helm insider is
        for hb in beats:
            await nc.publish(subject or subjects.heartbeat("decode", hb.instance_id), hb.SerializeToString())
        await nc.flush()
        await nc.close()

    idle = mesh_pb2.Load(num_free_kv_blocks=1 << 20)  # the idlest decode instance there could be
    asyncio.run(forge(mesh_pb2.Heartbeat(stage="decode", instance_id="forever", seq=1, interval_s=1e9, load=idle)))
    asyncio.run(forge(mesh_pb2.Heartbeat(stage="decode", instance_id="nan", seq=1, interval_s=float("nan"), load=idle)))
    asyncio.run(forge(mesh_pb2.Heartbeat(stage="decode", instance_id="sideways", seq=1, interval_s=0.2, load=idle),
                      subject=subjects.heartbeat("prefill", "sideways")))
    # In another instance's name: the subject names the sender, the body decode-0.
    asyncio.run(forge(mesh_pb2.Heartbeat(stage="decode", instance_id="decode-0", seq=1 << 40, interval_s=0.2,
                                         load=idle, draining=True), subject=subjects.heartbeat("decode", "evil")))
    eventually("the 4 forged heartbeats refused", lambda: metric(mesh, "heartbeats_refused_total") >= 4)
    assert metric(mesh, "heartbeats_refused_total", reason="interval") == 2
    assert metric(mesh, "heartbeats_refused_total", reason="stage") == 1
    assert metric(mesh, "heartbeats_refused_total", reason="instance_mismatch") == 1
    # Block events in prefill-0's name (which would pull prompts to it) from another subject: refused.
    async def forge_kv_event() -> None:
        nc = await nats.connect(mesh.nats_url)
        event = mesh_pb2.KvEvent(instance_id="prefill-0", seq=1, stored=[b"\x01" * 32], cleared=True)
        await nc.publish(subjects.kv_events("evil"), event.SerializeToString())
        await nc.flush()
        await nc.close()

    asyncio.run(forge_kv_event())
    deadline = time.monotonic() + 5
    while metric(mesh, "kv_events_refused_total") != 1:
        assert time.monotonic() < deadline, "the forged KV event was not refused"
        time.sleep(0.05)
    assert ready(mesh)["instances"].get("decode", 0) <= 1  # none of them counts (decode-0 may, if not late)
    # A well-formed forgery (valid interval) that stops beating is gone within misses * interval.
    asyncio.run(forge(mesh_pb2.Heartbeat(stage="decode", instance_id="ghost", seq=1, interval_s=0.2, load=idle)))
    # (misses x 0.2 s and a sweep: ~1 s idle; the deadline only tells "expired" from "never".)
    eventually("the ghost expiring", lambda: ready(mesh)["instances"].get("decode") == 1)
    t0 = time.time_ns()
    outs = [client.completions.create(model=name, prompt=f"real work {i}", max_tokens=4, temperature=0)
            for i in range(4)]
    assert all(o.usage.completion_tokens == 4 for o in outs)

    def routes() -> list[str]:
        return [s["attributes"]["decode.choice"] for s in load_spans(mesh.trace_dir)
                if s["name"] == "route" and s["start_ns"] > t0]

    eventually("the 4 requests' route spans written", lambda: len(routes()) >= 4)
    assert set(routes()) == {"decode-0"}
