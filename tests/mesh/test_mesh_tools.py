"""Tools through the whole mesh (real nats-server, kvcache, prefill, decode and
balancer processes; conftest.py's `mesh`) with langchain as the client, on the
seeded default model, whose template takes no tools (the balancer writes them in).

The seeded model writes no tool calls by itself: with tool_choice auto its reply
is content, and the test checks what reached it (the prompt with the tools and
the history written in, counted by usage) and that streaming gives the same
reply. Forced choices (a named function, "required", with_structured_output)
hold the random model to the function's schema, so every reply is a valid call:
those need structured outputs in the engine (issue 14 point 1) and are skipped
without them. with_structured_output(method="json_schema") is response_format,
that work's own field.
"""

from typing import Any, Literal

import httpx
import pytest
from pydantic import BaseModel

from services.balancer.frontend.tool_prompt import inline_tools
from services.balancer.frontend.tool_schema import structured_outputs_available
from shared.recipe import Recipe

langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.utils.function_calling import convert_to_openai_tool  # noqa: E402

MESH = dict(num_prefill=1, num_decode=1, extra_env={"INFERMESH_ENGINE__BLOCK_SIZE": "16"})
MESH_SHARED = True  # shares the session's mesh of this MESH (conftest.py's `mesh`): its assertions hold on a used one
needs_structured = pytest.mark.skipif(
    not structured_outputs_available(), reason="needs structured outputs (issue 14 point 1: SamplingParams.structured)"
)


def get_weather(city: Literal["Bern", "Paris"], days: Literal[1, 2, 3]) -> str:
    """The weather in a city for some days."""
    return "sunny"


class Weather(BaseModel):
    """The weather asked for."""

    city: Literal["Bern", "Paris"]
    days: Literal[1, 2, 3]


HISTORY = [
    HumanMessage("Weather in Bern?"),
    AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Bern", "days": 1}, "id": "call_1"}]),
    ToolMessage("sunny", tool_call_id="call_1"),
]


@pytest.fixture(scope="module")
def model_name(mesh: Any) -> str:
    return httpx.get(mesh.api_url + "/models").json()["data"][0]["id"]


def chat_model(mesh: Any, model_name: str, **kw: Any) -> Any:
    return langchain_openai.ChatOpenAI(
        model=model_name, base_url=mesh.api_url, api_key="not-needed", max_retries=0, timeout=120, **kw
    )


def test_auto_with_history_through_the_mesh(mesh: Any, model_name: str, mesh_model_dir: str) -> None:
    model = chat_model(mesh, model_name, temperature=0, max_completion_tokens=12).bind_tools(
        [get_weather], tool_choice="auto"
    )
    whole = model.invoke(HISTORY)
    # The prompt the mesh saw holds the tools, the call and its result, in tool_prompt.py's format.
    tool = convert_to_openai_tool(get_weather)
    messages = [
        {"role": "user", "content": "Weather in Bern?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern", "days": 1}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]  # fmt: skip
    expected = Recipe.from_pretrained(mesh_model_dir).encode_chat(inline_tools(messages, [tool]))
    assert whole.usage_metadata["input_tokens"] == len(expected)
    assert isinstance(whole.content, str) and whole.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    gathered = None
    for chunk in model.stream(HISTORY):
        gathered = chunk if gathered is None else gathered + chunk
    assert gathered.content == whole.content and gathered.tool_calls == [
        {**c, "id": g["id"]} for c, g in zip(whole.tool_calls, gathered.tool_calls, strict=True)
    ]


@needs_structured
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choice_gives_valid_calls(mesh: Any, model_name: str, stream: bool) -> None:
    for seed in range(3):
        model = chat_model(mesh, model_name, temperature=1.0, seed=seed, max_completion_tokens=64)
        for choice in ("get_weather", "any"):  # a named function, and langchain's "any" (OpenAI's required)
            bound = model.bind_tools([get_weather], tool_choice=choice)
            if stream:
                message = None
                for chunk in bound.stream("Weather?"):
                    message = chunk if message is None else message + chunk
            else:
                message = bound.invoke("Weather?")
            assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather", message
            for call in message.tool_calls:  # the schema: both keys required, each an enum
                assert set(call["args"]) == {"city", "days"}, call
                assert call["args"]["city"] in ("Bern", "Paris") and call["args"]["days"] in (1, 2, 3), call


@needs_structured
def test_with_structured_output_function_calling(mesh: Any, model_name: str) -> None:
    model = chat_model(mesh, model_name, temperature=1.0, seed=7, max_completion_tokens=64)
    got = model.with_structured_output(Weather, method="function_calling").invoke("Weather?")
    assert isinstance(got, Weather)


@needs_structured
def test_with_structured_output_json_schema(mesh: Any, model_name: str) -> None:
    # response_format json_schema: the structured-outputs work's field, checked here as langchain uses it.
    model = chat_model(mesh, model_name, temperature=1.0, seed=7, max_completion_tokens=64)
    got = model.with_structured_output(Weather, method="json_schema").invoke("Weather?")
    assert isinstance(got, Weather)
