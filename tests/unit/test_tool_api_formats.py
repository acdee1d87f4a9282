"""GPT-OSS's and DeepSeek-V4's tool formats through the balancer's HTTP API (the real
app and openai client, tests/helpers/tool_api.py's scripted generator) on make_model's seeded
folders, which carry each family's released chat format: the prompt the mesh gets
(tools, calls and results rendered by the shipped format), the reply read for calls
by the family's parser (chosen by auto), whole and streamed, broken replies as
content with a 200, and refusals as OpenAI error JSON."""

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.tool_api import MODEL, Served, calls_of, chat, chat_streamed
from tools.make_model import make_model

transformers = pytest.importorskip("transformers")

D = "｜DSML｜"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]  # fmt: skip
HISTORY = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]  # fmt: skip


def _for_transformers(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as servers hand it to templates: arguments as objects."""
    out = json.loads(json.dumps(messages))
    for message in out:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def _served(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Iterator[Served]:
    path = tmp_path_factory.mktemp(arch)
    make_model(path, arch=arch)
    served = Served(path)
    with served.http:
        yield served


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _served(tmp_path_factory, "gpt_oss")


@pytest.fixture(scope="module")
def deepseek_v4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _served(tmp_path_factory, "deepseek_v4")


def both(served: Served, reply: str, **body: Any) -> list[Any]:
    """The reply whole and streamed (gathered by the openai client), first choices."""
    return [chat(served, reply, **body).choices[0], chat_streamed(served, reply, **body).choices[0]]


# -- GPT-OSS: harmony ---------------------------------------------------------------------------

HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Bern", "days": 3}<|call|>'
)


def test_gpt_oss_prompt_is_the_shipped_templates(gpt_oss: Served) -> None:
    chat(gpt_oss, "<|channel|>final<|message|>ok<|return|>", messages=HISTORY, tools=TOOLS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gpt_oss.folder)
    expected = tokenizer.apply_chat_template(_for_transformers(HISTORY), tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert gpt_oss.prompt_text() == expected
    assert gpt_oss.generator.requests[-1].prompt_token_ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temp\\": 21}"<|end|>' in expected


def test_gpt_oss_call_whole_and_streamed(gpt_oss: Served) -> None:
    for choice in both(gpt_oss, HARMONY_CALL, tools=TOOLS):
        assert calls_of(choice.message) == [("function", "get_weather", '{"city": "Bern", "days": 3}')]
        assert choice.message.content is None and choice.finish_reason == "tool_calls"


def test_gpt_oss_final_answer_is_content(gpt_oss: Served) -> None:
    reply = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny in Bern.<|return|>"
    for choice in both(gpt_oss, reply, tools=TOOLS):
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("Sunny in Bern.", None, "stop")


def test_gpt_oss_stream_never_leaks_markers(gpt_oss: Served) -> None:
    gpt_oss.generator.reply = HARMONY_CALL
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "stream": True}
    with gpt_oss.http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert not "".join(d.get("content") or "" for d in deltas)
    pieces = [p for d in deltas for p in d.get("tool_calls", [])]
    assert pieces[0]["function"] == {"name": "get_weather", "arguments": ""} and len(pieces) > 2


def test_gpt_oss_broken_reply_is_content(gpt_oss: Served) -> None:
    reply = "Just text, no channels."
    for choice in both(gpt_oss, reply, tools=TOOLS):
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (reply, None, "stop")
    # A call whose arguments break: content in a whole reply; a stream that already sent
    # the call's name cannot take it back and ends it with the text it had (base.py's rule).
    broken = '<|channel|>commentary to=functions.get_weather<|message|>{"city": <|call|>'
    whole, streamed = both(gpt_oss, broken, tools=TOOLS)
    assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == ('{"city":', None, "stop")
    assert calls_of(streamed.message) == [("function", "get_weather", '{"city":')] and streamed.message.content is None


# -- DeepSeek-V4: DSML ----------------------------------------------------------------------------

DSML_CALL = (
    f'Checking.\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Bern</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">3</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>'
)


def test_deepseek_v4_prompt_renders_the_history(deepseek_v4: Served) -> None:
    chat(deepseek_v4, "ok", messages=HISTORY, tools=TOOLS)
    prompt = deepseek_v4.prompt_text()
    assert prompt.startswith("<｜begin▁of▁sentence｜>Use tools.\n\n## Tools\n")
    assert prompt.endswith(
        f'<｜User｜>Weather in Zürich?<｜Assistant｜></think>\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">Zürich</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>'
        '<｜end▁of▁sentence｜><｜User｜><tool_result>{"temp": 21}</tool_result><｜Assistant｜></think>'
    )


def test_deepseek_v4_calls_whole_and_streamed(deepseek_v4: Served) -> None:
    for choice in both(deepseek_v4, DSML_CALL, tools=TOOLS):
        assert calls_of(choice.message) == [("function", "get_weather", '{"city": "Bern", "days": 3}')]
        assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"


def test_deepseek_v4_broken_block_is_content(deepseek_v4: Served) -> None:
    reply = f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="days" string="false">three</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>'
    whole, streamed = both(deepseek_v4, reply, tools=TOOLS)
    assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == (reply, None, "stop")
    # The stream sent the call's name when its invoke tag came: it keeps the call (base.py's rule).
    assert calls_of(streamed.message) == [("function", "get_weather", '{"days": three}')]
    # A block cut off before its name: content in both.
    cut = f"Hmm <{D}tool_calls>\n<{D}inv"
    for choice in both(deepseek_v4, cut, tools=TOOLS):
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (cut, None, "stop")


def test_deepseek_v4_refusal_is_openai_error_json(deepseek_v4: Served) -> None:
    body = {"model": MODEL, "messages": HISTORY[:2], "tools": TOOLS, "chat_template_kwargs": {"reasoning_effort": "max"}}
    response = deepseek_v4.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "reasoning_effort" in error["message"]


def test_a_parser_setting_overrides_the_family(gpt_oss: Served) -> None:
    from shared.runtime.settings import BalancerSettings

    served = Served(gpt_oss.folder, BalancerSettings(tool_call_parser="hermes"))
    reply = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    with served.http:
        for choice in both(served, reply, tools=TOOLS):
            assert calls_of(choice.message) == [("function", "get_time", "{}")] and choice.message.content is None
        # Harmony is not read under hermes: the output is content, special tokens skipped as usual.
        choice = chat(served, HARMONY_CALL, tools=TOOLS).choices[0]
        assert choice.message.tool_calls is None and "functions.get_weather" in choice.message.content
