"""/v1/responses over a scripted generator (it answers with a given text, whatever
the prompt): the request's mapping onto chat (instructions, items, tools,
text.format, previous_response_id), the response object and the event stream as
the official `openai` client reads them, the store, and the 400s and 404s."""

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from services.balancer.frontend.api import create_app
from services.balancer.frontend.responses_store import MemoryResponseStore
from services.balancer.generation import GenerationRequest, TokenEvent, Usage
from shared.recipe import Recipe
from shared.runtime.settings import BalancerSettings
from tools.make_model import make_model

MODEL = "tiny"


@dataclass
class Scripted:
    """Answers every request with `reply`'s tokens, two per event; remembers the prompts."""

    recipe: Recipe
    reply: str = "Hello there."
    finish: str = "stop"
    prompts: list[str] = field(default_factory=list)
    num_prompt_tokens: list[int] = field(default_factory=list)

    def num_in_flight(self) -> int:
        return 0

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.prompts.append(self.recipe.decode(request.prompt_token_ids, skip_special_tokens=False))
        self.num_prompt_tokens.append(len(request.prompt_token_ids))
        ids = self.recipe.encode(self.reply, False)
        num_prompt = len(request.prompt_token_ids)
        for start in range(0, len(ids), 2):
            last = start + 2 >= len(ids)
            yield TokenEvent(ids[start:start + 2], finish_reason=self.finish if last else None,
                             usage=Usage(num_prompt, min(start + 2, len(ids)), 3))


@dataclass
class App:
    generator: Scripted
    http: TestClient
    store: MemoryResponseStore

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=self.http, max_retries=0)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Recipe:
    path = tmp_path_factory.mktemp("responses-model")
    make_model(path)
    return Recipe.from_pretrained(str(path))


@pytest.fixture
def app(recipe: Recipe) -> Iterator[App]:
    generator, store = Scripted(recipe), MemoryResponseStore()
    api = create_app(generator=generator, recipe=recipe, model_name=MODEL, max_model_len=512,
                     settings=BalancerSettings(), response_store=store)  # fmt: skip
    with TestClient(api) as http:
        yield App(generator, http, store)


def chat_prompt(app: App, messages: list[dict[str, Any]], **body: Any) -> str:
    """The prompt chat makes of messages (what /v1/responses must make of its input)."""
    app.generator.prompts.clear()
    got = app.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **body})
    assert got.status_code == 200, got.text
    return app.generator.prompts.pop()


def test_a_string_input_is_served_as_the_chat_of_one_user_message(app: App) -> None:
    got = app.client().responses.create(model=MODEL, input="Say hi", instructions="Be brief.", max_output_tokens=20,
                                        metadata={"team": "a"}, user="u1")  # fmt: skip
    prompt, num_prompt = app.generator.prompts[-1], app.generator.num_prompt_tokens[-1]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    assert prompt == chat_prompt(app, messages)
    assert got.id.startswith("resp_") and got.object == "response" and got.status == "completed"
    assert got.output_text == "Hello there."
    [item] = got.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    n = len(app.generator.recipe.encode("Hello there.", False))
    assert got.usage.output_tokens == n and got.usage.input_tokens_details.cached_tokens == 3
    assert (got.usage.input_tokens, got.usage.total_tokens) == (num_prompt, num_prompt + n)
    assert got.usage.output_tokens_details.reasoning_tokens == 0
    assert (got.instructions, got.metadata, got.user, got.max_output_tokens) == ("Be brief.", {"team": "a"}, "u1", 20)


def test_items_become_the_chat_conversation_with_a_tool_round_trip(app: App) -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1, "b": 2}'}
    items = [{"role": "developer", "content": "You add."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "1+2?"}]},
             call, {"type": "function_call_output", "call_id": "call_1", "output": "3"}]  # fmt: skip
    tool = {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {}}}
    app.client().responses.create(model=MODEL, input=items, tools=[tool])
    prompt = app.generator.prompts[-1]
    messages = [{"role": "developer", "content": "You add."}, {"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": call["arguments"]}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]  # fmt: skip
    chat_tool = {"type": "function", "function": {"name": "add", "parameters": tool["parameters"]}}
    assert prompt == chat_prompt(app, messages, tools=[chat_tool])


def test_a_forced_function_call_comes_back_as_a_function_call_item(app: App) -> None:
    app.generator.reply = '{"a": 1, "b": 2}'
    tool = {"type": "function", "name": "add", "parameters": {"type": "object"}}
    got = app.client().responses.create(model=MODEL, input="1+2?", tools=[tool],
                                        tool_choice={"type": "function", "name": "add"})  # fmt: skip
    [item] = got.output
    assert item.type == "function_call" and item.name == "add" and json.loads(item.arguments) == {"a": 1, "b": 2}
    assert item.call_id and item.id.startswith("fc_")
    assert got.tool_choice.name == "add"


def test_previous_response_id_continues_the_stored_conversation(app: App) -> None:
    first = app.client().responses.create(model=MODEL, input="Hi", instructions="Be brief.")
    app.client().responses.create(model=MODEL, input="Again", previous_response_id=first.id)
    # Instructions are not carried over (OpenAI's rule); the earlier turn is.
    assert app.generator.prompts[-1] == chat_prompt(app, [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
        {"role": "user", "content": "Again"}])  # fmt: skip


def test_retrieve_and_delete(app: App) -> None:
    client = app.client()
    made = client.responses.create(model=MODEL, input="Hi")
    assert client.responses.retrieve(made.id).model_dump() == made.model_dump()
    deleted = app.http.delete(f"/v1/responses/{made.id}")
    assert deleted.json() == {"id": made.id, "object": "response.deleted", "deleted": True}
    for got in (app.http.get(f"/v1/responses/{made.id}"), app.http.delete(f"/v1/responses/{made.id}")):
        assert got.status_code == 404 and got.json()["error"]["param"] == "response_id"


def test_store_false_keeps_nothing(app: App) -> None:
    made = app.client().responses.create(model=MODEL, input="Hi", store=False)
    assert made.store is False and app.http.get(f"/v1/responses/{made.id}").status_code == 404


def test_the_stream_is_responses_events_in_order(app: App) -> None:
    events = list(app.client().responses.create(model=MODEL, input="Hi", stream=True))
    types = [e.type for e in events]
    num_deltas = types.count("response.output_text.delta")
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * num_deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Hello there." and events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == len(app.generator.recipe.encode(text, False))
    stored = app.client().responses.retrieve(events[-1].response.id)
    assert stored.output_text == text and stored.status == "completed"


def test_a_streamed_forced_call_streams_its_arguments(app: App) -> None:
    app.generator.reply = '[{"name": "add", "arguments": {"a": 1}}]'
    tool = {"type": "function", "name": "add", "parameters": {"type": "object"}}
    with app.client().responses.stream(model=MODEL, input="1?", tools=[tool], tool_choice="required") as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert "response.function_call_arguments.delta" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"a": 1}
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    [item] = final.output
    assert item.type == "function_call" and item.name == "add" and item.arguments == done.arguments


def test_max_output_tokens_reached_is_incomplete(app: App) -> None:
    app.generator.finish = "length"
    got = app.client().responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"


def test_text_format_json_schema_becomes_chat_response_format(app: App) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    app.generator.reply = '{"x": 1}'
    got = app.client().responses.create(
        model=MODEL, input="x?", text={"format": {"type": "json_schema", "name": "X", "schema": schema}})
    assert json.loads(got.output_text) == {"x": 1} and got.text.format.type == "json_schema"


@pytest.mark.parametrize("body, param", [
    ({"input": "Hi", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": "Hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": [{"type": "bogus"}]}, "input.0"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "temperature": -1.0}, "temperature"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "X", "schema": {"type": "nonsense"}}}},
     "text.format.schema"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "strict": True}]}, "tools.0.strict"),
])  # fmt: skip
def test_bad_or_unimplemented_fields_are_400s_naming_them(app: App, body: dict[str, Any], param: str) -> None:
    got = app.http.post("/v1/responses", json={"model": MODEL, **body})
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param, got.json()


def test_unknown_previous_response_is_a_404(app: App) -> None:
    got = app.http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "previous_response_id": "resp_nope"})
    assert got.status_code == 404 and got.json()["error"]["param"] == "previous_response_id"


def test_a_reasoning_splitter_makes_a_reasoning_item(recipe: Recipe) -> None:
    generator = Scripted(recipe, reply="<think>hmm</think>Yes.")

    def split(text: str) -> tuple[str | None, str]:
        head, sep, tail = text.partition("</think>")
        return (head.removeprefix("<think>"), tail) if sep else (None, text)

    api = create_app(generator=generator, recipe=recipe, model_name=MODEL, max_model_len=512,
                     settings=BalancerSettings(), split_reasoning=split)  # fmt: skip
    with TestClient(api) as http:
        got = http.post("/v1/responses", json={"model": MODEL, "input": "Hi"}).json()
    assert [item["type"] for item in got["output"]] == ["reasoning", "message"]
    assert got["output"][0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert got["output"][1]["content"][0]["text"] == "Yes."
