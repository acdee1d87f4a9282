"""/v1/responses through the whole mesh (real nats-server with JetStream, kvcache,
prefill, decode and balancer processes; conftest.py's `mesh`) with the official
`openai` client: plain (the text of the chat completion of the same conversation,
greedy), streamed (the Responses events in order, their deltas the text), a
function tool round trip, previous_response_id across two balancers (a second
balancer process on the same NATS: the store is JetStream's key-value bucket,
not either balancer's memory), retrieval and deletion.

The seeded model writes no calls by itself: the call is forced (a named function),
which needs structured outputs in the engine; that test is skipped without them.
"""

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services.balancer.frontend.tool_schema import structured_outputs_available
from tests.helpers.mesh_procs import start_service, stop_process
from tools.launch.up import free_port

MESH = dict(num_prefill=1, num_decode=1, extra_env={"INFERMESH_ENGINE__BLOCK_SIZE": "16"})
MESH_SHARED = True  # its prompts are its own, its assertions hold on a used mesh
PROMPT = "Tell me about the weather."
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Bern", "Paris"]}},
                       "required": ["city"], "additionalProperties": False}}  # fmt: skip


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="not-needed", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(mesh: Any) -> str:
    return httpx.get(mesh.api_url + "/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def second_balancer(mesh: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Another balancer process on the mesh's NATS (the same user, as a second replica
    runs): its API URL, once it is ready."""
    port = free_port()
    env = mesh._env("balancer", INFERMESH_BALANCER__PORT=str(port), INFERMESH_WORKER__METRICS_PORT=str(free_port()))
    proc = start_service("balancer", env, Path(tmp_path_factory.mktemp("balancer-2")) / "balancer.log")
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the second balancer did not come up"
            try:
                if httpx.get(f"http://{mesh.host}:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield f"http://{mesh.host}:{port}/v1"
    finally:
        stop_process(proc)


def test_plain_response_is_the_greedy_chat_completion(mesh: Any, model_name: str) -> None:
    api = client(mesh.api_url)
    chat = api.chat.completions.create(
        model=model_name, temperature=0, max_completion_tokens=12,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
    )
    got = api.responses.create(model=model_name, input=PROMPT, instructions="Be brief.", temperature=0,
                               max_output_tokens=12)  # fmt: skip
    assert got.id.startswith("resp_") and got.object == "response"
    assert got.output_text == chat.choices[0].message.content
    assert got.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    assert got.usage.output_tokens == chat.usage.completion_tokens
    assert got.usage.total_tokens == chat.usage.total_tokens


def test_streamed_response_events_in_order(mesh: Any, model_name: str) -> None:
    api = client(mesh.api_url)
    whole = api.responses.create(model=model_name, input=PROMPT + " Stream it.", temperature=0, max_output_tokens=12)
    events = list(api.responses.create(model=model_name, input=PROMPT + " Stream it.", temperature=0,
                                       max_output_tokens=12, stream=True))  # fmt: skip
    types = [e.type for e in events]
    num_deltas = types.count("response.output_text.delta")
    assert num_deltas >= 1
    last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * num_deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     last]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


@pytest.mark.skipif(not structured_outputs_available(), reason="needs structured outputs in the engine")
def test_function_tool_round_trip(mesh: Any, model_name: str) -> None:
    api = client(mesh.api_url)
    asked = api.responses.create(model=model_name, input="Weather in Bern?", tools=[TOOL],
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    [call] = asked.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Bern", "Paris")
    # The result goes back as an item; the follow-up continues the stored conversation.
    answered = api.responses.create(
        model=model_name, previous_response_id=asked.id, tools=[TOOL], tool_choice="none", max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}], temperature=0,
    )
    assert answered.output[0].type == "message" and answered.usage.input_tokens > asked.usage.input_tokens


def test_previous_response_id_across_two_balancers(mesh: Any, model_name: str, second_balancer: str) -> None:
    first, second = client(mesh.api_url), client(second_balancer)
    turn1 = first.responses.create(model=model_name, input="My name is Ada.", temperature=0, max_output_tokens=6)
    turn2 = second.responses.create(model=model_name, input="What is my name?", previous_response_id=turn1.id,
                                    temperature=0, max_output_tokens=6)  # fmt: skip
    # The other balancer served the whole conversation: the same prompt chat makes of it.
    chat = first.chat.completions.create(model=model_name, temperature=0, max_completion_tokens=6, messages=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": turn1.output_text},
        {"role": "user", "content": "What is my name?"}])  # fmt: skip
    assert turn2.usage.input_tokens == chat.usage.prompt_tokens
    assert turn2.output_text == chat.choices[0].message.content
    assert turn2.previous_response_id == turn1.id
    # Each balancer finds what the other stored; deleted on one, gone on both.
    assert first.responses.retrieve(turn2.id).output_text == turn2.output_text
    assert second.responses.retrieve(turn1.id).model_dump() == turn1.model_dump()
    assert httpx.delete(f"{second_balancer}/responses/{turn1.id}").json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        first.responses.retrieve(turn1.id)
    with pytest.raises(openai.NotFoundError):
        first.responses.create(model=model_name, input="Hi", previous_response_id=turn1.id)
