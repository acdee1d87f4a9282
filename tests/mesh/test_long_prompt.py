"""Prompts past one NATS message (issue 32, point 2): on a nats-server left at its
default 1 MiB max_payload, a message too long for one goes in parts (the Bus,
shared/runtime/bus_parts.py) and the limit on a prompt is the model's context.

- The Bus over a real nats-server: a request of a 1M-token PrefillRequest reaches the
  handler whole and its reply comes back; a stream chunk in parts reaches the
  StreamReader; a message whose part never comes is never handled, and the
  subscription goes on.
- The mesh: a 1,048,576-token prompt sent to /v1/completions reaches prefill whole
  (its dispatched_prompt_tokens_total). The prefill itself is not awaited: the CPU
  path's attention is dense over the whole context (shared/model/attention.py masks
  a [query, key] matrix), ~10^12 mask entries for 1M tokens, hours on this machine.
  One token past the model's context is a 400 naming the limit."""

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import Bus, StreamReader
from shared.runtime.bus_parts import PART_HEADER, header_value, part_size, split
from shared.runtime.settings import NatsSettings
from tests.helpers.metrics import sample, scrape
from tools.make_model import make_model

MILLION = 1 << 20
NATS_DEFAULT_MAX_PAYLOAD = 1 << 20
CONTEXT = MILLION + 4096
"""The test model's max_position_embeddings: a 1M-token prompt and room to answer."""
ENV = {"INFERMESH_KVCACHE__CAPACITY_BYTES": str(512 << 20), "INFERMESH_KVCACHE__BLOB_CAPACITY_BYTES": str(64 << 20)}


async def test_a_million_token_request_crosses_a_default_nats_in_parts(nats_server) -> None:
    bus = await Bus.connect(NatsSettings(url=nats_server.url), "test")
    got: list[mesh_pb2.PrefillRequest] = []

    async def handler(req: mesh_pb2.PrefillRequest) -> mesh_pb2.Ack:
        got.append(req)
        return mesh_pb2.Ack(accepted=True, message=str(len(req.prompt_token_ids)))

    try:
        assert bus.nc.max_payload == NATS_DEFAULT_MAX_PAYLOAD  # the server's default, learnt from its INFO
        await bus.subscribe("im.test.long", mesh_pb2.PrefillRequest, handler)
        ids = [(i * 7919) % 150_000 for i in range(MILLION)]
        message = mesh_pb2.PrefillRequest(request_id="r1", prompt_token_ids=ids)
        assert message.ByteSize() > 2 * NATS_DEFAULT_MAX_PAYLOAD
        ack = await bus.request("im.test.long", message, mesh_pb2.Ack, timeout=60)
        assert ack.accepted and ack.message == str(MILLION)
        assert len(got) == 1 and list(got[0].prompt_token_ids) == ids

        # A stream chunk in parts: the first chunk carries the prompt's logprobs.
        async with StreamReader(bus, "r1") as reader:
            await reader.listen("d0")
            first = mesh_pb2.TokenChunk(request_id="r1", seq=0, token_ids=[5], instance_id="d0", final=True)
            first.prompt_logprobs.extend(
                mesh_pb2.TokenLogprobs(token_id=i, logprob=-1.5, top_token_ids=[1, 2, 3], top_logprobs=[-1, -2, -3])
                for i in range(100_000)
            )
            assert first.ByteSize() > NATS_DEFAULT_MAX_PAYLOAD
            await bus.publish(subjects.stream("d0", "r1"), first)
            chunks = [c async for c in reader.chunks(30, 30)]
        assert len(chunks) == 1 and len(chunks[0].prompt_logprobs) == 100_000

        # Parts 0 and 2 of 3 only: never handled; the next whole message is.
        lost = mesh_pb2.PrefillRequest(request_id="lost", prompt_token_ids=ids)
        parts = split(lost.SerializeToString(), part_size(bus.nc.max_payload))
        assert len(parts) >= 3
        for part, chunk in (parts[0], parts[-1]):
            await bus.nc.publish("im.test.long", chunk, headers={PART_HEADER: header_value(part)})
        ack = await bus.request("im.test.long", mesh_pb2.PrefillRequest(request_id="small", prompt_token_ids=[1]),
                                mesh_pb2.Ack)  # fmt: skip
        assert ack.accepted and [r.request_id for r in got] == ["r1", "small"]
        # A part that cannot be put together, with a reply inbox: a retryable refusal, not silence.
        reply = await bus.nc.request("im.test.long", b"x", timeout=10, headers={PART_HEADER: "m/5/2"})
        refused = mesh_pb2.Ack.FromString(reply.data)
        assert not refused.accepted and refused.code == mesh_pb2.ERROR_CODE_OVERLOADED and "malformed" in refused.message
        assert [r.request_id for r in got] == ["r1", "small"]
    finally:
        await bus.close()


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory) -> str:
    """make-model's tiny-long preset (a context of CONTEXT tokens) as Mistral, every
    layer sliding: one layer of 64, so its KV pool for a whole-context request is small."""
    path = tmp_path_factory.mktemp("long-model")
    make_model(path, arch="mistral", preset="tiny-long", sliding_window=64)
    assert json.loads((path / "config.json").read_text())["max_position_embeddings"] == CONTEXT
    return str(path)


def test_a_million_token_prompt_reaches_prefill_and_the_context_is_the_limit(long_model_dir, tmp_path_factory):
    from tests.helpers.mesh import running_mesh

    with running_mesh(long_model_dir, Path(tmp_path_factory.mktemp("long-mesh")), nats_max_payload=None, extra_env=ENV) as mesh:
        assert "max_payload" not in mesh.nats_config.read_text()  # nats-server's default 1 MiB
        model = httpx.get(mesh.api_url + "/models", timeout=30).json()["data"][0]
        assert model["max_model_len"] == CONTEXT  # the model's context, not a bus limit
        url = mesh.api_url + "/completions"

        # One token past the context: a 400 that names the limit.
        too_long = httpx.post(url, json={"model": model["id"], "prompt": [7] * CONTEXT, "max_tokens": 1}, timeout=120)
        assert too_long.status_code == 400, too_long.text
        error = too_long.json()["error"]
        assert error["type"] == "invalid_request_error" and str(CONTEXT) in error["message"], error

        prompt = [(i * 7919) % 500 + 5 for i in range(MILLION)]
        prefill_metrics = f"http://127.0.0.1:{mesh.metrics_ports['prefill-0']}/metrics"
        name = "infermesh_prefill_dispatched_prompt_tokens_total"
        before = sample(scrape(prefill_metrics), name)
        outcome: dict[str, Any] = {}
        client = httpx.Client(timeout=600)

        def post() -> None:  # answered only once prefill has run 1M tokens: not awaited
            try:
                outcome["response"] = client.post(url, json={"model": model["id"], "prompt": prompt, "max_tokens": 1})
            except Exception as exc:  # the client closed below
                outcome["error"] = exc

        sender = threading.Thread(target=post, daemon=True)
        sender.start()
        deadline = time.monotonic() + 120
        received = before
        while time.monotonic() < deadline and received == before and "response" not in outcome:
            time.sleep(0.5)
            received = sample(scrape(prefill_metrics), name)
        assert received - before == MILLION, outcome  # all 1,048,576 tokens, whole, at prefill
        assert "response" not in outcome or outcome["response"].status_code == 200, outcome["response"].text
        client.close()  # the balancer cancels the request; the mesh stops below
        sender.join(30)
