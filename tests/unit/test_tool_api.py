"""Tools through the balancer's HTTP API (the real app, the real openai client and
langchain), with a generator that replies with a scripted text: no model writes
tool calls by itself, so the reply is chosen and the prompt it saw is recorded.

The prompt is checked against transformers' apply_chat_template(..., tools=) on
Qwen 2.5's template (the reference), and against the balancer's own tool prompt
on the project's template (which takes no tools); replies are checked whole,
streamed (gathered by the openai client's own ChatCompletionStreamState) and
through langchain's bind_tools. The mesh itself: tests/mesh/test_mesh_tools.py.
"""

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.balancer.frontend.tool_prompt import TOOLS_PREAMBLE
from services.balancer.frontend.tool_schema import structured_outputs_available
from tools.make_model import make_model
from shared.runtime.settings import BalancerSettings
from tests.helpers.chat_templates import QWEN25_TEMPLATE
from tests.helpers.tool_api import MODEL, Served, calls_of, chat, chat_streamed

transformers = pytest.importorskip("transformers")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
TWO_CALLS = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
HISTORY = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Zürich, and the time?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]

# A Llama 3.1-style template (its tool parts: tools as JSON in the first user turn,
# <|python_tag|> calls, results as ipython turns).
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if tools is not none %}<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}<|python_tag|>{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}{% endfor %}<|eom_id|>
    {%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
    {%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tool-model")
    make_model(path)
    return path


def _with_template(base: Path, folder: Path, template: str) -> Path:
    shutil.copytree(base, folder)
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def qwen(base_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = Served(_with_template(base_model, tmp_path_factory.mktemp("q") / "qwen", QWEN25_TEMPLATE))
    with served.http:
        yield served


@pytest.fixture(scope="module")
def own(base_model: Path) -> Iterator[Served]:
    """The project's own template, which takes no tools."""
    served = Served(base_model)
    with served.http:
        yield served


# -- the prompt ------------------------------------------------------------------------


def test_history_with_calls_renders_as_transformers_does(qwen: Served) -> None:
    chat(qwen, "ok", messages=HISTORY, tools=TOOLS)
    # transformers takes the arguments as objects (as servers hand them to templates).
    reference = json.loads(json.dumps(HISTORY))
    for call in reference[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen.folder)
    expected = tokenizer.apply_chat_template(reference, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert qwen.prompt_text() == expected
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in expected
    assert "<tool_response>\n12:00\n</tool_response>" in expected


def test_template_without_tools_gets_them_written_in(own: Served) -> None:
    chat(own, "ok", messages=HISTORY, tools=[WEATHER_TOOL])
    prompt = own.prompt_text()
    tool_line = json.dumps(WEATHER_TOOL, ensure_ascii=False)
    assert prompt.startswith(f"<|begin_of_text|><|im_start|>system\nUse tools.\n\n{TOOLS_PREAMBLE}\n{tool_line}\n</tools>")
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n"
        "<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in prompt


# -- replies -----------------------------------------------------------------------------


@pytest.mark.parametrize("served_name", ["qwen", "own"])
def test_auto_calls_whole_and_streamed(served_name: str, request: pytest.FixtureRequest) -> None:
    served: Served = request.getfixturevalue(served_name)
    whole = chat(served, TWO_CALLS, tools=TOOLS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert calls_of(choice.message) == [
        ("function", "get_weather", '{"city": "Zürich", "days": 2}'), ("function", "get_time", "{}"),
    ]  # fmt: skip
    ids = [c.id for c in choice.message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    streamed = chat_streamed(served, TWO_CALLS, tools=TOOLS).choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == "Let me look."
    assert calls_of(streamed.message) == calls_of(choice.message)
    assert all(c.id.startswith("call_") for c in streamed.message.tool_calls)


def test_stream_deltas_are_openai_shaped(qwen: Served) -> None:
    qwen.generator.reply = TWO_CALLS
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "stream": True}
    with qwen.http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert chunks[0]["delta"] == {"role": "assistant"}
    pieces = [d for c in chunks for d in c["delta"].get("tool_calls", [])]
    firsts = [d for d in pieces if "id" in d]
    assert [(d["index"], d["type"], d["function"]) for d in firsts] == [
        (0, "function", {"name": "get_weather", "arguments": ""}), (1, "function", {"name": "get_time", "arguments": ""}),
    ]  # fmt: skip
    rest = [d for d in pieces if "id" not in d]
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
    assert len([d for d in rest if d["index"] == 0]) > 1, "arguments go out in pieces as they are generated"
    assert "<tool_call>" not in "".join(c["delta"].get("content") or "" for c in chunks)
    assert [c["finish_reason"] for c in chunks][-1] == "tool_calls"


def test_broken_call_is_content_and_none_reads_nothing(qwen: Served) -> None:
    broken = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    for reply in (broken, "<tool_call>[1, 2]</tool_call>"):
        choice = chat(qwen, reply, tools=TOOLS).choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (reply, None, "stop")
    # tool_choice none: the reply is content as the model wrote it, even a call.
    for got in (chat(qwen, TWO_CALLS, tools=TOOLS, tool_choice="none"),
                chat_streamed(qwen, TWO_CALLS, tools=TOOLS, tool_choice="none")):  # fmt: skip
        assert got.choices[0].message.content == TWO_CALLS and not got.choices[0].message.tool_calls
        assert got.choices[0].finish_reason == "stop"


def test_without_parallel_tool_calls_the_first_call_only(qwen: Served) -> None:
    for got in (chat(qwen, TWO_CALLS, tools=TOOLS, parallel_tool_calls=False),
                chat_streamed(qwen, TWO_CALLS, tools=TOOLS, parallel_tool_calls=False)):  # fmt: skip
        assert calls_of(got.choices[0].message) == [("function", "get_weather", '{"city": "Zürich", "days": 2}')]


def test_llama3_template_and_parser(base_model: Path, tmp_path: Path) -> None:
    served = Served(_with_template(base_model, tmp_path / "llama", LLAMA31_TEMPLATE))
    reply = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
    with served.http:
        whole = chat(served, reply, messages=HISTORY[1:], tools=TOOLS)
        assert '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich"}}' in served.prompt_text()
        assert "<|start_header_id|>ipython<|end_header_id|>\n\n12:00" in served.prompt_text()
        streamed = chat_streamed(served, reply, tools=TOOLS)
    for got in (whole, streamed):
        assert calls_of(got.choices[0].message) == [("function", "get_weather", '{"city": "Paris"}')]
        assert got.choices[0].message.content is None and got.choices[0].finish_reason == "tool_calls"


def test_parser_setting_is_checked(base_model: Path) -> None:
    with pytest.raises(ValueError, match="balancer.tool_call_parser"):
        Served(base_model, BalancerSettings(tool_call_parser="mistral"))


def test_unknown_tool_format_is_refused_not_ignored(base_model: Path, tmp_path: Path) -> None:
    template = "{% for t in tools %}<fn>{{ t | tojson }}</fn>{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    served = Served(_with_template(base_model, tmp_path / "odd", template))
    with served.http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
        response = served.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
        assert "tool_call_parser" in response.json()["error"]["message"]


# -- langchain ---------------------------------------------------------------------------


def get_weather(city: str, days: int = 1) -> str:
    """Weather for a city."""
    return "sunny"


def _chat_model(served: Served) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(  # the app in process, through its TestClient (an httpx.Client)
        model=MODEL, base_url="http://balancer/v1", api_key="none", http_client=served.http, max_retries=0
    )


def test_langchain_bind_tools_auto(qwen: Served) -> None:
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern", "days": 3}}\n</tool_call>'
    qwen.generator.reply = reply
    model = _chat_model(qwen).bind_tools([get_weather], tool_choice="auto")
    message = model.invoke("Weather in Bern for three days?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Bern", "days": 3})]
    assert message.tool_calls[0]["id"].startswith("call_")
    # Streamed, gathered by langchain's chunk addition.
    gathered = None
    for chunk in model.stream("Weather in Bern for three days?"):
        gathered = chunk if gathered is None else gathered + chunk
    assert [(c["name"], c["args"]) for c in gathered.tool_calls] == [("get_weather", {"city": "Bern", "days": 3})]
    # The call and its result go back in the history.
    from langchain_core.messages import HumanMessage, ToolMessage

    qwen.generator.reply = "It is sunny in Bern."
    answer = model.invoke([HumanMessage("Weather in Bern?"), message, ToolMessage("sunny", tool_call_id=message.tool_calls[0]["id"])])
    assert answer.content == "It is sunny in Bern." and answer.tool_calls == []
    assert "<tool_response>\nsunny\n</tool_response>" in qwen.prompt_text()


# -- forced choices: constrained by the function's schema (needs structured outputs) ------

needs_structured = pytest.mark.skipif(
    not structured_outputs_available(), reason="needs structured outputs (issue 14 point 1: SamplingParams.structured)"
)


@pytest.mark.skipif(structured_outputs_available(), reason="the engine has structured outputs")
def test_forced_choice_refused_without_structured_outputs(qwen: Served) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": choice}
        response = qwen.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"


@needs_structured
def test_named_choice_is_constrained_to_the_arguments(qwen: Served) -> None:
    from shared.engine.structured.spec import StructuredSpec

    named = {"type": "function", "function": {"name": "get_weather"}}
    args = '{"city": "Bern", "days": 3}'
    for got in (chat(qwen, args, tools=TOOLS, tool_choice=named), chat_streamed(qwen, args, tools=TOOLS, tool_choice=named)):
        assert calls_of(got.choices[0].message) == [("function", "get_weather", args)]
        assert got.choices[0].message.content is None and got.choices[0].finish_reason == "tool_calls"
        schema = json.dumps(WEATHER_TOOL["function"]["parameters"])
        assert qwen.generator.requests[-1].params.structured == StructuredSpec("json", schema, any_whitespace=False)
    # A function without parameters takes an empty object.
    chat(qwen, "{}", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(qwen.generator.requests[-1].params.structured.source) == {"type": "object", "properties": {}}


@needs_structured
def test_required_is_constrained_to_an_array_of_calls(qwen: Served) -> None:
    reply = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Bern"}}]'
    for parallel in (True, False):
        got = chat(qwen, reply, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
        expected = [("function", "get_time", "{}"), ("function", "get_weather", '{"city": "Bern"}')]
        assert calls_of(got.choices[0].message) == (expected if parallel else expected[:1])
        schema = json.loads(qwen.generator.requests[-1].params.structured.source)
        assert schema["minItems"] == 1 and ("maxItems" not in schema if parallel else schema["maxItems"] == 1)
        names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
        assert names == [["get_weather"], ["get_time"]]
    streamed = chat_streamed(qwen, reply, tools=TOOLS, tool_choice="required")
    assert calls_of(streamed.choices[0].message) == calls_of(chat(qwen, reply, tools=TOOLS, tool_choice="required").choices[0].message)


@needs_structured
def test_forced_choice_refusals(qwen: Served) -> None:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    named = {"type": "function", "function": {"name": "f"}}
    # A schema the grammar cannot enforce: named by its field, before the mesh.
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}
    response = qwen.http.post("/v1/chat/completions", json={**base, "tools": [bad], "tool_choice": named})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools.0.function.parameters"
    # Two constraints at once.
    both = {**base, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}
    response = qwen.http.post("/v1/chat/completions", json=both)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice", response.text


@needs_structured
def test_langchain_forced_tool_and_structured_output(qwen: Served) -> None:
    from pydantic import BaseModel

    class Weather(BaseModel):
        """The weather asked for."""

        city: str
        days: int

    qwen.generator.reply = '{"city": "Bern", "days": 3}'
    forced = _chat_model(qwen).bind_tools([get_weather], tool_choice="get_weather")
    message = forced.invoke("Weather in Bern?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Bern", "days": 3})]
    assert qwen.generator.requests[-1].params.structured is not None
    structured = _chat_model(qwen).with_structured_output(Weather, method="function_calling")
    assert structured.invoke("Weather in Bern?") == Weather(city="Bern", days=3)
    assert json.loads(qwen.generator.requests[-1].params.structured.source)["required"] == ["city", "days"]
