"""The mesh end to end: nats-server, kvcache, prefill, decode and the balancer
as real processes (started the way `infermesh up` starts them), driven with
the official openai client."""

import asyncio
import concurrent.futures
import subprocess
import sys
import time

import httpx
import openai
import pytest

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.kv.wire.client import KVCacheClient
from tools.launch.trace_view import load_spans
from tools.launch.up import grpc_serving
from tests.helpers.mesh import kv_blocks_settled
from tests.helpers.mesh_procs import span_attributes

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


# The module's mesh (conftest.py's `mesh` fixture): one prefill, one decode.
MESH = dict(
    num_prefill=1,
    num_decode=1,
    extra_env={"INFERMESH_ENGINE__BLOCK_SIZE": "16", "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2"},
)
MESH_SHARED = True  # shares the session's mesh of this MESH (conftest.py's `mesh`): its assertions hold on a used one


@pytest.fixture(scope="module")
def offline(mesh_model_dir):
    return LLM(mesh_model_dir, block_size=16)


@pytest.fixture
def client(mesh):
    return openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=120)


def model_name(client) -> str:
    return client.models.list().data[0].id


def test_greedy_output_equals_offline_generation(mesh, client, offline):
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0))[0]
    name = model_name(client)
    out = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.choices[0].text == expected.text
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.choices[0].finish_reason == expected.finish_reason
    streamed = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text


def test_chat_stream_equals_offline_chat(mesh, client, offline):
    messages = [{"role": "user", "content": "Name three sorting algorithms."}]
    expected = offline.chat([messages], SamplingParams(max_tokens=20, temperature=0.0))[0]
    stream = client.chat.completions.create(
        model=model_name(client), messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    assert text == expected.text
    assert usage.completion_tokens == len(expected.token_ids)


def test_decode_copies_prefills_kv_directly_not_through_kvcache(mesh, client, offline):
    prompt = PROMPT * 4
    expected = offline.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    out = client.completions.create(model=model_name(client), prompt=prompt, max_tokens=8, temperature=0)
    assert out.choices[0].text == expected.text
    attrs = span_attributes(mesh.trace_dir, out.id, "decode")
    assert attrs["kv.loaded_direct"] is True and attrs["kv.load_failed"] is False
    assert attrs["kv.path"] == "peer"  # the same-namespace copy, ahead of NIXL
    # Decode already holds the blocks of PROMPT's first 16 tokens (an earlier test): it copies the rest.
    assert attrs["kv.loaded_blocks"] == len(expected.prompt_token_ids) // 16 - expected.num_cached_tokens // 16
    # The load's time (for its bandwidth in traces): measured, and shorter than the request's decode span;
    # the copy's own time is part of it.
    assert 0 < attrs["kv.load_ms"] < 10_000
    assert 0 < attrs["kv.copy_ms"] <= attrs["kv.load_ms"]


def test_shared_prefix_is_cached_moves_only_new_blocks_and_matches_cold(mesh, client, mesh_model_dir):
    name = model_name(client)
    prefix = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(12))
    cold_llm = LLM(mesh_model_dir, block_size=16, enable_prefix_caching=False)
    second_prompt = prefix + "And then the fox said:"
    cold = cold_llm.generate([second_prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]
    num_prompt = len(cold.prompt_token_ids)

    before = kv_blocks_settled(mesh, 0)
    first = client.completions.create(model=name, prompt=prefix + "Meanwhile the dog", max_tokens=4, temperature=0)
    after_first = kv_blocks_settled(mesh, before + 1)
    out = client.completions.create(model=name, prompt=second_prompt, max_tokens=16, temperature=0)
    after_second = kv_blocks_settled(mesh, after_first + num_prompt // 16 - out.usage.prompt_tokens_details.cached_tokens // 16)

    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0
    # Only the full blocks past the shared prefix were written to kvcache.
    assert after_first > before
    assert after_second - after_first == num_prompt // 16 - cached // 16
    assert out.choices[0].text == cold.text


def test_sixteen_concurrent_streams_complete_in_order(mesh, client, offline):
    name = model_name(client)
    prompts = [f"# task {i}: write a function that returns {i} squared\n" for i in range(16)]
    expected = offline.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))

    def one(prompt: str) -> str:
        stream = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, prompts))
    # A gap, duplicate or reordering in any stream would change its text.
    assert texts == [e.text for e in expected]


def test_one_request_one_trace_across_all_services(mesh, client):
    name = model_name(client)
    resp = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "trace me " * 20}], max_tokens=4, temperature=0
    )
    # Spans reach their files in batches: wait until this request's trace is whole.
    deadline = time.monotonic() + 15
    mine: list[dict] = []
    services: set[str] = set()
    while time.monotonic() < deadline:
        spans = load_spans(mesh.trace_dir)
        roots = [s for s in spans if s["attributes"].get("request.id") == resp.id and s["parent_id"] is None]
        if roots:
            mine = [s for s in spans if s["trace_id"] == roots[0]["trace_id"]]
            services = {s["service"] for s in mine}
            if {"balancer", "prefill", "kvcache", "decode"} <= services:
                break
        time.sleep(0.3)
    assert {"balancer", "prefill", "kvcache", "decode"} <= services
    trace_id = mine[0]["trace_id"]
    ids = {s["span_id"] for s in mine}
    assert all(s["parent_id"] in ids for s in mine if s["parent_id"] is not None)  # one connected tree
    root = next(s for s in mine if s["parent_id"] is None)
    assert root["attributes"]["ttft_ms"] > 0 and root["attributes"]["prompt.tokens"] > 0
    assert "prompt.cached_tokens" in root["attributes"]
    route = next(s for s in mine if s["name"] == "route")
    assert route["attributes"]["prefill.choice"].startswith("prefill-")
    assert route["attributes"]["decode.choice"].startswith("decode-")
    out = subprocess.run(
        [sys.executable, "-m", "tools.cli", "trace", trace_id, "--trace-dir", str(mesh.trace_dir)],
        capture_output=True, text=True, check=True,
    )
    assert "prefill: prefill" in out.stdout and "decode: decode" in out.stdout


def decode_load(mesh) -> tuple[int, int, int]:
    """(running, free blocks, total blocks) of the decode instance, from its heartbeat on NATS."""
    import nats

    from shared.proto import mesh_pb2

    async def go():
        nc = await nats.connect(mesh.nats_url)
        sub = await nc.subscribe("im.heartbeat.decode.*")
        msg = await sub.next_msg(timeout=5)
        await nc.close()
        hb = mesh_pb2.Heartbeat()
        hb.ParseFromString(msg.data)
        return hb.load.num_running, hb.load.num_free_kv_blocks, hb.load.num_total_kv_blocks

    return asyncio.run(go())


def test_cancelled_stream_frees_its_blocks_in_decode(mesh, client):
    stream = client.completions.create(
        model=model_name(client), prompt=PROMPT, max_tokens=2000, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    for chunk in stream:
        seen += 1
        if seen == 5:
            break
    running, free, total = decode_load(mesh)
    assert running == 1 and free < total  # the request is generating
    stream.close()  # the client goes away
    # Generous: on a loaded 2-core CI machine the cancel, the abort and the next heartbeat take a while.
    deadline = time.monotonic() + 30
    while (running, free) != (0, total) and time.monotonic() < deadline:
        time.sleep(0.2)
        running, free, total = decode_load(mesh)
    assert (running, free) == (0, total)


def test_bad_input_gets_openai_errors_and_harms_nothing(mesh, client):
    url = mesh.api_url
    r = httpx.post(f"{url}/completions", json={"model": model_name(client), "prompt": "x", "temperature": -1})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{url}/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404
    out = client.completions.create(model=model_name(client), prompt="still fine", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3


def kv_get(mesh, hashes):
    async def go():
        client = KVCacheClient(mesh.kv_address)
        try:
            return await client.get_blocks(hashes)
        finally:
            await client.close()

    return asyncio.run(go())


def test_kvcache_restart_keeps_serving_blocks(mesh, client, offline):
    prompt = PROMPT * 3
    client.completions.create(model=model_name(client), prompt=prompt, max_tokens=2, temperature=0)
    hashes = offline.engine.kv.hash_chain(offline.recipe.encode(prompt))
    before = kv_get(mesh, hashes)
    assert len(before) == len(hashes) > 0

    old = dict(mesh.procs)["kvcache"]
    old.terminate()
    assert old.wait(15) == 0  # a clean shutdown on SIGTERM
    proc = mesh.restart("kvcache")
    deadline = time.monotonic() + 60
    while not grpc_serving(mesh.kv_address) and time.monotonic() < deadline:
        assert proc.poll() is None
        time.sleep(0.2)
    assert kv_get(mesh, hashes) == before
