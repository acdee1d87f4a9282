"""Several instances per stage: cache-aware prefill routing, decode load
spreading, and what a client sees when an instance dies (an error, quickly;
never a hang or a silent loss)."""

import concurrent.futures
import signal
import time

import openai
import pytest

from shared.launch.trace_view import load_spans
from shared.launch.up import Mesh, free_port
from shared.model.make_model import make_model


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    model = tmp_path_factory.mktemp("faults-model")
    make_model(model)
    m = Mesh(
        str(model),
        num_prefill=2,
        num_decode=2,
        port=free_port(),
        state_dir=tmp_path_factory.mktemp("faults-state"),
        extra_env={
            "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2",
            "INFERMESH_BALANCER__TOKEN_TIMEOUT_S": "3",
            "INFERMESH_BALANCER__FIRST_TOKEN_TIMEOUT_S": "10",
        },
    )
    try:
        m.start(timeout_s=240)
    except Exception:
        m.stop()
        raise
    yield m
    m.stop()


@pytest.fixture
def client(mesh):
    return openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=60)


def route_spans(mesh, after_ns: int) -> list[dict]:
    time.sleep(0.6)  # span files are written in batches every 200 ms
    spans = [s for s in load_spans(mesh.trace_dir) if s["name"] == "route" and s["start_ns"] > after_ns]
    return sorted(spans, key=lambda s: s["start_ns"])


def test_shared_prefix_goes_to_the_prefill_instance_that_holds_it(mesh, client):
    name = client.models.list().data[0].id
    prefix = "".join(f"step {i}: add the numbers and carry the one\n" for i in range(10))
    t0 = time.time_ns()
    client.completions.create(model=name, prompt=prefix + "first", max_tokens=2, temperature=0)
    time.sleep(0.5)  # block events reach the balancer
    out = client.completions.create(model=name, prompt=prefix + "second", max_tokens=2, temperature=0)
    first, second = route_spans(mesh, t0)[-2:]
    assert second["attributes"]["prefill.reason"] == "prefix"
    assert second["attributes"]["prefill.choice"] == first["attributes"]["prefill.choice"]
    assert out.usage.prompt_tokens_details.cached_tokens > 0


def test_concurrent_requests_spread_over_decode_instances(mesh, client):
    name = client.models.list().data[0].id
    t0 = time.time_ns()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(
            lambda i: client.completions.create(model=name, prompt=f"item {i}", max_tokens=8, temperature=0),
            range(8),
        ))
    assert all(o.usage.completion_tokens == 8 for o in outs)
    chosen = {s["attributes"]["decode.choice"] for s in route_spans(mesh, t0)}
    assert chosen == {"decode-0", "decode-1"}


def test_a_decode_instance_dying_mid_stream_fails_the_request_quickly_and_the_rest_goes_on(mesh, client):
    name = client.models.list().data[0].id
    stream = client.completions.create(
        model=name, prompt="count forever:", max_tokens=4000, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    # Find the decode instance that runs it, and kill it without a chance to drain.
    loads = {}
    for _ in range(10):
        loads = {n: decode_load_of(mesh, n) for n, _ in mesh.procs if n.startswith("decode-")}
        if any(r == 1 for r in loads.values()):
            break
    busy = next(n for n, r in loads.items() if r == 1)
    victim = next(p for n, p in mesh.procs if n == busy)
    victim.send_signal(signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in chunks:
            pass
    assert time.monotonic() - started < 8  # the token timeout (3 s) plus slack, not forever
    # Once its heartbeats stop, the dead instance leaves the registry and new requests succeed.
    time.sleep(1.0)
    for i in range(4):
        out = client.completions.create(model=name, prompt=f"after {i}", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4


def decode_load_of(mesh, instance_id: str) -> int:
    """Running requests of one decode instance, from its heartbeat."""
    import asyncio

    import nats

    from shared.proto import mesh_pb2

    async def go() -> int:
        nc = await nats.connect(mesh.nats_url)
        sub = await nc.subscribe("im.heartbeat.decode")
        try:
            while True:
                msg = await sub.next_msg(timeout=5)
                hb = mesh_pb2.Heartbeat()
                hb.ParseFromString(msg.data)
                if hb.instance_id == instance_id:
                    return hb.load.num_running
        finally:
            await nc.close()

    return asyncio.run(go())
