"""GPT-OSS's harmony and DeepSeek-V4's DSML tool calls read from model output
(tool_parsers/harmony.py, dsml.py): the exact calls and content of a whole parse,
streams fed in every piece size (a marker split anywhere) adding up to the whole
parse, broken output given back as content, and the auto choice by template."""

import json

import pytest

from services.balancer.frontend.tool_parsers import PARSERS, choose_parser, parse_whole
from services.balancer.frontend.tool_parsers.base import StreamingParser, StreamPiece
from services.balancer.frontend.tool_parsers.dsml import DsmlParser
from services.balancer.frontend.tool_parsers.harmony import HarmonyParser
from shared.recipe.deepseek_v4_chat import SOURCE as V4_SOURCE
from tools.chat_formats import TEMPLATES

D = "｜DSML｜"


def gathered(parser: StreamingParser, text: str, size: int) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    """The stream of text fed `size` characters at a time: (content, calls, each call's id list)."""
    out = StreamPiece()
    for i in range(0, len(text), size):
        out.add(parser.feed(text[i : i + size]))
    out.add(parser.finish())
    calls: dict[int, list[str]] = {}
    ids: dict[int, list[str]] = {}
    for delta in out.calls:
        if delta.name is not None:
            assert delta.index not in calls, "a call's name goes out once"
            calls[delta.index] = [delta.name, ""]
            ids[delta.index] = [delta.id]
        calls[delta.index][1] += delta.arguments
    assert sorted(calls) == list(range(len(calls))), "indexes count up from 0"
    return out.content.strip() or None, [tuple(calls[i]) for i in sorted(calls)], [i for v in ids.values() for i in v]


def whole(parser: StreamingParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    parsed = parse_whole(parser, text)
    return parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


def check_stream_equals_whole(make: type[StreamingParser], text: str) -> tuple[str | None, list[tuple[str, str]]]:
    expected = whole(make(), text)
    for size in (1, 2, 3, 5, 7, 64, len(text)):
        content, calls, ids = gathered(make(), text, size)
        assert (content, calls) == expected, f"piece size {size}"
        assert all(i.startswith("call_") for i in ids)
    return expected


# -- harmony (GPT-OSS) -----------------------------------------------------------------------

HARMONY_CALL = (
    "<|channel|>analysis<|message|>The user wants the weather in Zürich.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Zürich", "days": 2}<|call|>'
)


def test_harmony_call_after_reasoning() -> None:
    # The analysis message is reasoning: not content (the reasoning field is the API issue's).
    assert check_stream_equals_whole(HarmonyParser, HARMONY_CALL) == (
        None, [("get_weather", '{"city": "Zürich", "days": 2}')],
    )  # fmt: skip


def test_harmony_recipient_before_the_channel_and_without_constrain() -> None:
    # The order the chat template writes calls in history, and a bare content type.
    text = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>'
    assert check_stream_equals_whole(HarmonyParser, text) == (None, [("get_time", "{}")])


def test_harmony_final_answer_is_content() -> None:
    text = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny in Bern.<|return|>"
    assert check_stream_equals_whole(HarmonyParser, text) == ("It is sunny in Bern.", [])


def test_harmony_preamble_then_two_calls() -> None:
    text = (
        "<|channel|>commentary<|message|>Looking both up.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Bern"}<|end|>'
        "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|> {} <|call|>"
    )
    assert check_stream_equals_whole(HarmonyParser, text) == (
        "Looking both up.", [("get_weather", '{"city": "Bern"}'), ("get_time", "{}")],
    )  # fmt: skip


def test_harmony_without_the_end_token() -> None:
    # The engine stops at <|call|> and may not pass its text on.
    assert whole(HarmonyParser(), HARMONY_CALL.removesuffix("<|call|>")) == (
        None, [("get_weather", '{"city": "Zürich", "days": 2}')],
    )  # fmt: skip


def test_harmony_broken_output_is_content() -> None:
    # Not harmony at all: content, the stray tokens removed as skip_special_tokens would.
    assert check_stream_equals_whole(HarmonyParser, "Hello <|end|>there") == ("Hello there", [])
    # A call whose arguments are not a JSON object: its text is content.
    bad = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": <|call|>"
    assert whole(HarmonyParser(), bad) == ('{"city":', [])
    # A header that is not one.
    assert whole(HarmonyParser(), "<|channel|>final oops junk here<|message|>hi") == ("final oops junk herehi", [])
    # Built-in tools (browser, python) are not the client's functions.
    text = '<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"query": "x"}<|call|>'
    assert whole(HarmonyParser(), text) == (None, [])


def test_harmony_reads_special_tokens() -> None:
    assert HarmonyParser.keeps_special_tokens and not DsmlParser.keeps_special_tokens


# -- DSML (DeepSeek-V4) ----------------------------------------------------------------------

DSML_CALLS = (
    f"Let me look.\n\n<{D}tool_calls>\n"
    f'<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">Zürich "Nord"</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">2</{D}parameter>\n'
    f'<{D}parameter name="where" string="false">{{"lat": 47.4, "tags": ["a", null]}}</{D}parameter>\n'
    f"</{D}invoke>\n"
    f'<{D}invoke name="get_time">\n\n</{D}invoke>\n'
    f"</{D}tool_calls>"
)


def test_dsml_calls_exact() -> None:
    # Arguments as DeepSeek's decoder rebuilds them: strings by json.dumps, the rest as written.
    assert check_stream_equals_whole(DsmlParser, DSML_CALLS) == (
        "Let me look.",
        [("get_weather", '{"city": "Zürich \\"Nord\\"", "days": 2, "where": {"lat": 47.4, "tags": ["a", null]}}'),
         ("get_time", "{}")],
    )  # fmt: skip
    assert json.loads(whole(DsmlParser(), DSML_CALLS)[1][0][1])["city"] == 'Zürich "Nord"'


def test_dsml_streams_arguments_as_they_come() -> None:
    parser = DsmlParser()
    head = f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="q" string="true">abc'
    piece = parser.feed(head)
    assert [(d.name, d.arguments) for d in piece.calls] == [("f", ""), (None, '{"q": "abc')]
    piece = parser.feed(f"d</{D}para")  # the closing tag in pieces: held back, never content
    assert [d.arguments for d in piece.calls] == ["d"] and piece.content == ""
    piece = parser.feed(f"meter>\n</{D}invoke>\n</{D}tool_calls>")
    assert "".join(d.arguments for d in piece.calls) == '"}' and piece.content == ""


def test_dsml_content_only_and_text_that_looks_like_a_tag() -> None:
    assert check_stream_equals_whole(DsmlParser, "Plain answer, no tools.") == ("Plain answer, no tools.", [])
    text = "Use <｜DSML| carefully"  # not the marker (ASCII bar)
    assert check_stream_equals_whole(DsmlParser, text) == (text, [])


@pytest.mark.parametrize(
    "block",
    [
        f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="n" string="false">not json</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
        f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="n">1</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
        f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="true">1</{D}parameter>\n'
        f'<{D}parameter name="a" string="true">2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
        f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="true">cut off',
        f"<{D}tool_calls>\n{{\"name\": \"f\"}}\n</{D}tool_calls>",
    ],
    ids=["value-not-json", "no-string-attribute", "duplicate-parameter", "cut-off", "json-body"],
)
def test_dsml_broken_block_is_content(block: str) -> None:
    assert whole(DsmlParser(), "Hi. " + block) == ("Hi. " + block.strip(), [])


def test_dsml_block_broken_before_any_call_streams_as_content() -> None:
    # Nothing of the block went out: the stream gives all of it back, as the whole parse does.
    for text in (f"Hmm <{D}tool_calls>\n<{D}inv", f"Hmm <{D}tool_calls>\nnot a call\n</{D}tool_calls> ok"):
        assert check_stream_equals_whole(DsmlParser, text) == (text, [])


def test_dsml_v32_and_v3_formats_are_content() -> None:
    # V3.2's block name and V3's tokens are other formats: not read as V4's calls.
    for text in (f'<{D}function_calls>\n<{D}invoke name="f">\n</{D}invoke>\n</{D}function_calls>',
                 "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"):  # fmt: skip
        assert whole(DsmlParser(), text) == (text, [])


# -- choosing ----------------------------------------------------------------------------------


def test_auto_picks_each_family_and_a_setting_overrides() -> None:
    gpt_oss = (TEMPLATES / "gpt_oss_chat_template.jinja").read_text(encoding="utf-8")
    assert choose_parser("auto", gpt_oss) == "openai" and PARSERS["openai"] is HarmonyParser
    assert choose_parser("auto", V4_SOURCE) == "deepseek_v4" and PARSERS["deepseek_v4"] is DsmlParser
    assert choose_parser("hermes", gpt_oss) == "hermes"
    assert choose_parser("deepseek_v4", None) == "deepseek_v4"
