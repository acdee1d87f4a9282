"""Several instances per stage: cache-aware prefill routing, decode load
spreading, and what a client sees when an instance dies (an error, quickly;
never a hang or a silent loss). The tests that kill instances start a mesh of
their own, so no test depends on what another left behind."""

import concurrent.futures
import signal
import time

import openai
import pytest

from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tools.launch.trace_view import load_spans
from tools.launch.up import Mesh
from tests.helpers.mesh_procs import span_attributes

ENV = {
    "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2",
    "INFERMESH_BALANCER__TOKEN_TIMEOUT_S": "3",
    "INFERMESH_BALANCER__FIRST_TOKEN_TIMEOUT_S": "10",
}
# The module's mesh (conftest.py's `mesh` fixture), for the tests that kill nothing.
MESH = dict(num_prefill=2, num_decode=2, extra_env=ENV)


def openai_client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture
def client(mesh):
    return openai_client(mesh)


def route_spans(mesh, after_ns: int, count: int) -> list[dict]:
    """The route spans since after_ns, once there are `count` of them: span files are written
    in batches every 200 ms, later on a loaded machine (a deadline, not a fixed sleep)."""
    deadline = time.monotonic() + 10
    while True:
        spans = [s for s in load_spans(mesh.trace_dir) if s["name"] == "route" and s["start_ns"] > after_ns]
        if len(spans) >= count or time.monotonic() > deadline:
            return sorted(spans, key=lambda s: s["start_ns"])
        time.sleep(0.1)


def test_shared_prefix_goes_to_the_prefill_instance_that_holds_it(mesh, client):
    name = client.models.list().data[0].id
    prefix = "".join(f"step {i}: add the numbers and carry the one\n" for i in range(10))
    t0 = time.time_ns()
    client.completions.create(model=name, prompt=prefix + "first", max_tokens=2, temperature=0)
    time.sleep(0.5)  # block events reach the balancer
    out = client.completions.create(model=name, prompt=prefix + "second", max_tokens=2, temperature=0)
    first, second = route_spans(mesh, t0, 2)[-2:]
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
    chosen = {s["attributes"]["decode.choice"] for s in route_spans(mesh, t0, 8)}
    assert chosen == {"decode-0", "decode-1"}


def running_decode(mesh) -> str:
    """The decode instance that is running a request, from heartbeats."""
    for _ in range(20):
        loads = {n: decode_load_of(mesh, n) for n, p in mesh.procs if n.startswith("decode-") and p.poll() is None}
        busy = [n for n, r in loads.items() if r > 0]
        if busy:
            return busy[0]
    raise AssertionError(f"no decode instance is running a request: {loads}")


def test_a_decode_instance_dying_mid_stream_migrates_the_request(start_mesh, mesh_model_dir):
    mesh = start_mesh(num_prefill=1, num_decode=2, extra_env=ENV)
    client = openai_client(mesh)
    name = client.models.list().data[0].id
    # Long enough for several full blocks: the resumed prefill must find them stored.
    prompt = "count with me: one two three four five six seven eight nine ten. " * 4
    expected = LLM(mesh_model_dir).generate([prompt], SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))[0]
    stream = client.completions.create(
        model=name, prompt=prompt, max_tokens=120, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    text = first.choices[0].text
    victim = running_decode(mesh)
    next(p for n, p in mesh.procs if n == victim).send_signal(signal.SIGKILL)  # no chance to drain
    started = time.monotonic()
    usage = None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].text
        usage = chunk.usage or usage
    assert time.monotonic() - started < 30
    # Moved to the other decode instance with prompt + tokens so far: greedy output is unchanged.
    assert text == expected.text
    assert usage.completion_tokens == 120 and usage.prompt_tokens == len(expected.prompt_token_ids)
    # Resumed with the blocks already stored: the second prefill of the request (prompt +
    # tokens so far) found at least the prompt's full blocks cached, not computed again.
    block_size = EngineConfig().block_size
    full = len(expected.prompt_token_ids) // block_size * block_size
    deadline = time.monotonic() + 30
    prefills: list[dict] = []
    while time.monotonic() < deadline and len(prefills) < 2:
        spans = load_spans(mesh.trace_dir)
        root = next((x for x in spans if x["attributes"].get("request.id") == first.id and x["parent_id"] is None), None)
        if root is not None:
            prefills = sorted((x for x in spans if x["trace_id"] == root["trace_id"] and x["name"] == "prefill"),
                              key=lambda x: x["start_ns"])  # fmt: skip
        time.sleep(0.2)
    assert len(prefills) == 2, f"{len(prefills)} prefill spans"
    assert prefills[1]["attributes"]["prompt.cached_tokens"] >= full > 0


def test_with_no_decode_instance_left_requests_fail_fast_with_503(start_mesh):
    mesh = start_mesh(num_prefill=1, num_decode=1, extra_env=ENV)
    client = openai_client(mesh)
    name = client.models.list().data[0].id
    for n, p in mesh.procs:
        if n.startswith("decode-") and p.poll() is None:
            p.send_signal(signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=name, prompt="anyone there?", max_tokens=4, temperature=0)
    assert err.value.status_code == 503
    assert err.value.body["message"]  # OpenAI error JSON
    assert time.monotonic() - started < 20


def decode_load_of(mesh, instance_id: str) -> int:
    """Running requests of one decode instance, from its heartbeat."""
    import asyncio

    import nats

    from shared.proto import mesh_pb2

    async def go() -> int:
        nc = await nats.connect(mesh.nats_url)
        sub = await nc.subscribe("im.heartbeat.decode.*")
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


def test_with_kvcache_down_requests_are_recomputed_not_lost(start_mesh, mesh_model_dir):
    mesh = start_mesh(extra_env={**ENV, "INFERMESH_ENGINE__BLOCK_SIZE": "16"})
    client = openai_client(mesh)
    name = client.models.list().data[0].id
    prompt = "".join(f"item {i}: a line long enough to fill a few KV blocks\n" for i in range(6))
    expected = LLM(mesh_model_dir, block_size=16).generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    kvcache = dict(mesh.procs)["kvcache"]
    kvcache.send_signal(signal.SIGKILL)
    kvcache.wait(10)
    started = time.monotonic()
    out = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
    # Lookups and stores fail at once (no server): prefill computes the whole prompt, its
    # store (written behind) fails, and decode still gets the KV straight from prefill.
    assert out.choices[0].text == expected.text
    assert time.monotonic() - started < 20
    prefill = span_attributes(mesh.trace_dir, out.id, "prefill")
    assert prefill["kv.loaded_blocks"] == 0 and prefill["prompt.cached_tokens"] == 0
    assert span_attributes(mesh.trace_dir, out.id, "decode")["kv.loaded_direct"] is True


def test_without_direct_transfer_decode_reads_kvcache(start_mesh, mesh_model_dir):
    mesh = start_mesh(extra_env={**ENV, "INFERMESH_ENGINE__BLOCK_SIZE": "16", "INFERMESH_ENGINE__KV_DIRECT_TRANSFER": "false"})
    client = openai_client(mesh)
    prompt = "".join(f"entry {i}: enough text to fill several KV blocks\n" for i in range(6))
    expected = LLM(mesh_model_dir, block_size=16).generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=8, temperature=0)
    assert out.choices[0].text == expected.text
    attrs = span_attributes(mesh.trace_dir, out.id, "decode")
    assert attrs["kv.loaded_direct"] is False
    assert attrs["kv.loaded_blocks"] == len(expected.prompt_token_ids) // 16
