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
from tests.helpers.tool_api import MODEL as TOOLS_MODEL
from tests.helpers.tool_api import Served, served_model
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



# -- reasoning items: the chat call's own split (the server's reasoning format) -------

THINK_REPLY = "<think>\nAdd them: 2+2.\n</think>\n\nIt is 4."
THINK_REASONING_TOKENS = 9
"""THINK_REPLY's tokens holding reasoning in the ChatML tokenizer: '>\\n' (the tag's end
and the reasoning's first newline), 'Add', ' them', ':', ' ', '2', '+', '2', '.\\n';
not '<', 'th', 'ink', '</', 'th', 'ink', '>' (tag only) nor the content's."""
HARMONY_CALL = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Bern"}<|call|>')  # fmt: skip
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The project's ChatML model read as Qwen3's <think> format; its tokenizer has no
    <think> token, so one token per event splits the tags over several events."""
    yield from served_model(tmp_path_factory.mktemp("qwen3"), None, reasoning_parser="qwen3")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from served_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss")


def respond(served: Served, reply: str, **body: Any) -> Any:
    served.generator.reply = reply
    return served.client.responses.create(model=TOOLS_MODEL, input="What is 2+2?", **body)


def test_a_reasoning_reply_is_a_reasoning_item_then_the_message(qwen3: Served) -> None:
    assert len(qwen3.recipe.encode("<think>", add_special_tokens=False)) > 1
    got = respond(qwen3, THINK_REPLY)
    assert [item.type for item in got.output] == ["reasoning", "message"]
    reasoning = got.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.status == "completed"
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "\nAdd them: 2+2.\n")]
    assert got.output_text == "\n\nIt is 4."
    assert got.usage.output_tokens == len(qwen3.recipe.encode(THINK_REPLY, add_special_tokens=False))
    assert got.usage.output_tokens_details.reasoning_tokens == THINK_REASONING_TOKENS
    # The stored turn is the answer alone, as chat templates drop past reasoning.
    respond(qwen3, "Yes.", previous_response_id=got.id)
    assert qwen3.prompt_text().count("It is 4.") == 1 and "Add them" not in qwen3.prompt_text()


def test_reasoning_items_sent_back_are_left_out_of_the_prompt(qwen3: Served) -> None:
    # A client keeping its own context sends the whole output back (OpenAI asks it to):
    # the prompt is the one previous_response_id makes, the reasoning dropped from both.
    got = respond(qwen3, THINK_REPLY)
    respond(qwen3, "Yes.", previous_response_id=got.id)
    by_id = qwen3.prompt_text()
    qwen3.generator.reply = "Yes."
    qwen3.client.responses.create(model=TOOLS_MODEL, input=[
        {"role": "user", "content": "What is 2+2?"}, *got.output, {"role": "user", "content": "What is 2+2?"}])
    assert qwen3.prompt_text() == by_id and "Add them" not in by_id
    item = got.output[0].model_dump(exclude_none=True) | {"encrypted_content": "opaque"}
    refused = qwen3.http.post("/v1/responses", json={"model": TOOLS_MODEL, "input": [item]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input.0.encrypted_content", refused.text


def test_a_streamed_reasoning_reply_splits_exactly_across_events(qwen3: Served) -> None:
    qwen3.generator.reply = THINK_REPLY
    with qwen3.client.responses.stream(model=TOOLS_MODEL, input="What is 2+2?") as stream:
        events = list(stream)
        final = stream.get_final_response()  # the client's accumulator accepts the item sequence
    types = [e.type for e in events]
    num_reasoning, num_text = types.count("response.reasoning_text.delta"), types.count("response.output_text.delta")
    assert num_reasoning > 1 and num_text > 1  # streamed as it came, not at the end
    assert types == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.reasoning_text.delta"] * num_reasoning, "response.reasoning_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * num_text, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    text = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert ("".join(reasoning), "".join(text)) == ("\nAdd them: 2+2.\n", "\n\nIt is 4.")
    assert not any("<" in piece or "think>" in piece for piece in reasoning + text)
    added = events[2]
    assert added.item.type == "reasoning" and added.output_index == 0 and added.item.status == "in_progress"
    assert all(e.item_id == added.item.id for e in events[3:num_reasoning + 7] if hasattr(e, "item_id"))
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == "".join(reasoning) and done.output_index == 0
    assert [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"] == [
        (0, "reasoning"), (1, "message")]  # fmt: skip
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "".join(reasoning) and final.output_text == "".join(text)
    assert final.usage.output_tokens_details.reasoning_tokens == THINK_REASONING_TOKENS
    stored = qwen3.client.responses.retrieve(final.id)
    assert stored.output[0].id == added.item.id and stored.output[0].content[0].text == "".join(reasoning)


def test_reasoning_then_a_tool_call_whole_and_streamed(gpt_oss: Served) -> None:
    got = respond(gpt_oss, HARMONY_CALL, tools=[WEATHER])
    assert [item.type for item in got.output] == ["reasoning", "function_call"]
    assert got.output[0].content[0].text == "Need weather."
    assert (got.output[1].name, got.output[1].arguments) == ("get_weather", '{"city": "Bern"}')
    gpt_oss.generator.reply = HARMONY_CALL
    events = list(gpt_oss.client.responses.create(model=TOOLS_MODEL, input="Weather?", tools=[WEATHER], stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "Need weather."
    assert [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"] == [
        (0, "reasoning"), (1, "function_call")]  # fmt: skip
    assert "response.output_text.delta" not in [e.type for e in events]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert final.output[1].arguments == '{"city": "Bern"}'


def test_a_forced_call_is_not_split(qwen3: Served) -> None:
    # Chat's rule: a reply constrained to calls holds no reasoning, so it is not read for any.
    got = respond(qwen3, '[{"name": "get_weather", "arguments": {"city": "Bern"}}]', tools=[WEATHER],
                  tool_choice="required")  # fmt: skip
    assert [item.type for item in got.output] == ["function_call"]
    assert got.usage.output_tokens_details.reasoning_tokens == 0


def test_a_model_without_a_reasoning_format_makes_no_reasoning_item(app: App) -> None:
    app.generator.reply = "<think>hmm</think>Yes."
    got = app.client().responses.create(model=MODEL, input="Hi")
    assert [item.type for item in got.output] == ["message"] and got.output_text == "<think>hmm</think>Yes."
    events = list(app.client().responses.create(model=MODEL, input="Hi", stream=True))
    assert not any(e.type.startswith("response.reasoning") for e in events)
    assert events[-1].response.output_text == "<think>hmm</think>Yes."
    # Nothing is read as reasoning, so no token counts as reasoning.
    assert got.usage.output_tokens_details.reasoning_tokens == 0
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == 0
