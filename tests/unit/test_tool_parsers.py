"""Tool-call parsers on crafted outputs: whole parses with exact calls and content,
broken calls given back as content, and every stream (cut at every place, one
character at a time) adding up to the whole parse."""

import json
import random

import pytest

from services.balancer.frontend.tool_parsers import (
    NamedCallParser,
    StreamingParser,
    choose_parser,
    json_array,
    llama3_json,
    parse_whole,
)
from services.balancer.frontend.tool_parsers.hermes import HermesParser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2], "unit": "c"}}'
TIME = '{"name": "get_time", "arguments": {}}'


def calls_of(parser: StreamingParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    parsed = parse_whole(parser, text)
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in parsed.tool_calls)
    return parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


def streamed(parser: StreamingParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """The stream's deltas gathered as a client gathers them: by index, name and id once."""
    content = ""
    calls: dict[int, dict[str, str]] = {}
    outs = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    for out in outs:
        content += out.content
        for delta in out.calls:
            if delta.index not in calls:
                assert delta.id is not None and delta.name is not None, "a call's first delta names it"
                calls[delta.index] = {"name": delta.name, "arguments": ""}
            else:
                assert delta.id is None and delta.name is None, "id and name go out once"
            calls[delta.index]["arguments"] += delta.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def cuts(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    ways = [list(text), [text]]
    for _ in range(20):
        points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        ways.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)])
    return ways


HERMES_CASES = [
    # several calls, text before, between and after
    (
        f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\nDone.",
        "Let me look.\n\n\nDone.",
        [("get_weather", '{"city": "Zürich", "days": [1, 2], "unit": "c"}'), ("get_time", "{}")],
    ),
    # calls only: content null
    (f"<tool_call>\n{TIME}\n</tool_call>", None, [("get_time", "{}")]),
    # no calls: the text, ends stripped
    ("Just text, with < and <tool and {json}. ", "Just text, with < and <tool and {json}.", []),
    # a last call whose closing tag never came still counts
    (f"ok <tool_call>\n{WEATHER}\n", "ok", [("get_weather", '{"city": "Zürich", "days": [1, 2], "unit": "c"}')]),
    # arguments first: read whole, re-serialized
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [("f", '{"a": 1}')]),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_whole_and_every_stream(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    assert calls_of(HermesParser(), text) == (content, calls)
    for pieces in cuts(text, seed=len(text)):
        assert streamed(HermesParser(), pieces) == (content, calls), pieces


@pytest.mark.parametrize(
    "broken",
    [
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # a brace short
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # not a call
        '<tool_call>["get_time"]</tool_call>',
    ],
)
def test_hermes_broken_call_is_content(broken: str) -> None:
    text = f"Before. {broken} After."
    assert calls_of(HermesParser(), text) == (text, [])
    # A stream gives it back too, when its name never went out.
    if '"name": "f"' not in broken:
        assert streamed(HermesParser(), list(text)) == (text, [])


def test_hermes_broken_after_its_name_streamed_keeps_the_call() -> None:
    # The name went out before the JSON broke: a stream cannot take it back.
    text = '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>'
    assert calls_of(HermesParser(), text) == (text, [])
    assert streamed(HermesParser(), list(text)) == (None, [("f", '{"a": 1')])


def test_hermes_holds_back_a_partial_tag() -> None:
    parser = HermesParser()
    assert parser.feed("Hi <tool").content == "Hi"
    assert parser.feed("bar").content == " <toolbar"  # it was not a tag after all
    out = parser.feed(f"<tool_call>{TIME}</tool_call>")
    assert out.content == "" and [(d.name, d.arguments) for d in out.calls] == [("get_time", ""), (None, "{}")]


def test_hermes_streams_arguments_in_pieces() -> None:
    parser = HermesParser()
    assert parser.feed('<tool_call>\n{"name": "get_weather", ').calls == []
    first = parser.feed('"arguments": {"city": "Zü')
    assert [(d.name, d.arguments) for d in first.calls] == [("get_weather", ""), (None, '{"city": "Zü')]
    second = parser.feed('rich"}}\n</tool_call>')
    assert [(d.name, d.arguments) for d in second.calls] == [(None, 'rich"}')]


LLAMA_CASES = [
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', None, [("f", '{"a": 1}')]),
    ('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": [true]}}', None,
     [("f", '{"a": 1}'), ("g", '{"b": [true]}')]),
    ('  {"name": "f"}', None, [("f", "{}")]),  # no parameters: {}
    ("The answer is 4.", "The answer is 4.", []),
    ('{"answer": 4}', '{"answer": 4}', []),  # JSON that is not a call
    ('{"name": "f", "parameters": {}} and then text', "and then text", [("f", "{}")]),
    ('{"name": "f", "parameters": {"a": ', '{"name": "f", "parameters": {"a":', []),  # cut off: content whole
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_json(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    assert calls_of(llama3_json(), text) == (content, calls)
    if '"a": ' not in text[-6:]:  # (the cut-off one starts its call in a stream)
        for pieces in cuts(text, seed=len(text)):
            assert streamed(llama3_json(), pieces) == (content, calls), pieces


def test_required_array_and_named() -> None:
    text = '[{"name": "f", "arguments": {"a": 1}},{"name": "g", "arguments": {}}]'
    assert calls_of(json_array(), text) == (None, [("f", '{"a": 1}'), ("g", "{}")])
    for pieces in cuts(text, seed=1):
        assert streamed(json_array(), pieces) == (None, [("f", '{"a": 1}'), ("g", "{}")])
    args = ' {"city": "Paris", "n": 2}\n'
    assert calls_of(NamedCallParser("get_weather"), args) == (None, [("get_weather", '{"city": "Paris", "n": 2}')])
    for pieces in cuts(args, seed=2):
        assert streamed(NamedCallParser("get_weather"), pieces) == (None, [("get_weather", '{"city": "Paris", "n": 2}')])
    assert streamed(NamedCallParser("f"), []) == (None, [("f", "")])  # an empty reply is still the call


def test_arguments_are_the_text_the_model_wrote() -> None:
    # Not re-serialized: unicode, spacing and key order stay as generated.
    raw = '{ "b":1,"a" : "é" }'
    content, calls = calls_of(HermesParser(), f'<tool_call>{{"name": "f", "arguments": {raw}}}</tool_call>')
    assert calls == [("f", raw)] and json.loads(calls[0][1]) == {"b": 1, "a": "é"}


QWEN_TOOLS = "{%- if tools %}...<tools>{{ tool | tojson }}</tools> <tool_call>...{%- endif %}"
LLAMA31_TOOLS = '{%- if tools is not none %}... {"name": function name, "parameters": ...} <|python_tag|>{%- endif %}'


def test_choose_parser() -> None:
    assert choose_parser("auto", QWEN_TOOLS) == "hermes"
    assert choose_parser("auto", LLAMA31_TOOLS) == "llama3_json"
    assert choose_parser("auto", "{{ messages }}") == "hermes"  # no tools: the balancer's own prompt
    assert choose_parser("auto", None) == "hermes"
    assert choose_parser("auto", "{% for tool in tools %}<function>{% endfor %}") is None  # unknown format
    assert choose_parser("llama3_json", QWEN_TOOLS) == "llama3_json"
    with pytest.raises(ValueError, match="balancer.tool_call_parser"):
        choose_parser("mistral", QWEN_TOOLS)
