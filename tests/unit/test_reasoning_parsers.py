"""Reasoning split off a reply, one format at a time (reasoning_parsers): exact at the
tags, whole and streamed, wherever the stream cuts (a tag split across two pieces,
or one character a piece), a prompt that opened the block, a reply cut off inside
it, harmony kept as written for the tool parser; where in the reply the reasoning
lies, and how many tokens hold it (count.py); and the format chosen by setting or
chat template."""

import pytest

from services.balancer.frontend.reasoning_parsers import (
    ReasoningTokenCount,
    choose_reasoning_parser,
    new_splitter,
    split_reasoning,
)

H_ANALYSIS = "<|channel|>analysis<|message|>User asks weather. Say sunny.<|end|>"
H_FINAL = "<|start|>assistant<|channel|>final<|message|>It is <b>sunny</b>.<|return|>"
CASES = [
    # (parser, prompt tail, reply, reasoning, content)
    ("qwen3", "<|im_start|>assistant\n", "<think>\nWeigh a < b.\n</think>\n\nThe answer: 4.",
     "\nWeigh a < b.\n", "\n\nThe answer: 4."),
    ("qwen3", "<|im_start|>assistant\n", "No thinking here </thin", None, "No thinking here </thin"),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Plain.", None, "Plain."),
    ("qwen3", "<|im_start|>assistant\n", "<think>cut off by max_tok", "cut off by max_tok", ""),
    ("qwen3", "<|im_start|>assistant\n", "<think>a</think>b<think>c</think>", "a", "b<think>c</think>"),
    ("deepseek_r1", "<｜Assistant｜>", "Let me see.</think>Paris.", "Let me see.", "Paris."),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Hmm.\n</think>\n\nParis.", "Hmm.\n", "\n\nParis."),
    ("deepseek_v4", "<｜User｜>hi<｜Assistant｜><think>", "Think.</think>Answer.", "Think.", "Answer."),
    ("deepseek_v4", "<｜User｜>hi<｜Assistant｜></think>", "Answer only.", None, "Answer only."),
    ("openai_gptoss", "<|start|>assistant", H_ANALYSIS + H_FINAL, "User asks weather. Say sunny.",
     "It is <b>sunny</b>."),
    ("openai_gptoss", "<|start|>assistant", "<|channel|>final<|message|>Just this.<|return|>", None, "Just this."),
    ("openai_gptoss", "<|start|>assistant", "not harmony <|end|> at all", None, "not harmony  at all"),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "tail", "reply", "reasoning", "content"), CASES)
def test_whole_split_is_exact(parser: str, tail: str, reply: str, reasoning: str | None, content: str) -> None:
    assert split_reasoning(reply, parser, tail) == (reasoning, content)


def _streamed(parser: str, tail: str, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    splitter = new_splitter(parser, tail)
    out = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
    return "".join(p.reasoning for p in out), "".join(p.content for p in out), [(p.reasoning, p.content) for p in out]


@pytest.mark.parametrize(("parser", "tail", "reply", "reasoning", "content"), CASES)
def test_streamed_split_is_exact_wherever_the_stream_cuts(
    parser: str, tail: str, reply: str, reasoning: str | None, content: str
) -> None:
    for cut in range(len(reply) + 1):  # every two-piece stream: each tag split at each of its characters
        assert _streamed(parser, tail, [reply[:cut], reply[cut:]])[:2] == (reasoning or "", content), cut
    assert _streamed(parser, tail, list(reply))[:2] == (reasoning or "", content)


def test_a_split_tag_is_held_until_the_next_piece_decides_it() -> None:
    *_, pieces = _streamed("qwen3", "", ["<thi", "nk>plan</th", "ink>done", "<"])
    assert pieces == [("", ""), ("plan", ""), ("", "done"), ("", "<"), ("", "")]
    # Harmony's end token split over two tokens' text: the analysis body goes out whole, never the marker.
    *_, pieces = _streamed("openai_gptoss", "", ["<|channel|>analysis<|message|>ab<|e", "nd|><|start|>assistant<|channel|>final<|message|>c"])
    assert pieces == [("ab", ""), ("", "c"), ("", "")]


def test_harmony_kept_as_written_for_the_tool_parser() -> None:
    call = "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>"
    splitter = new_splitter("openai_gptoss", raw=True)
    piece = splitter.feed(H_ANALYSIS + call)
    piece.add(splitter.finish())
    assert (piece.reasoning, piece.content) == ("User asks weather. Say sunny.", call)


@pytest.mark.parametrize(("setting", "source", "parser"), [
    ("auto", "{{ '<|channel|>analysis<|message|>' }}", "openai_gptoss"),
    ("auto", "{% if enable_thinking %}<think>\n\n</think>{% endif %}", "qwen3"),
    ("auto", "DeepSeek-V4 ... ｜DSML｜tool_calls ... </think>", "deepseek_v4"),
    ("auto", "{{ '<|im_start|>' + message.content }}", None),
    ("auto", None, None),
    ("none", "<think></think>", None),
    ("deepseek_r1", None, "deepseek_r1"),
])  # fmt: skip
def test_parser_chosen_by_setting_or_template(setting: str, source: str | None, parser: str | None) -> None:
    assert choose_reasoning_parser(setting, source) == parser


def test_unknown_setting_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        choose_reasoning_parser("granite", None)


@pytest.mark.parametrize(("parser", "tail", "reply", "reasoning", "content"), CASES)
def test_reasoning_spans_are_where_the_reasoning_is_wherever_the_stream_cuts(
    parser: str, tail: str, reply: str, reasoning: str | None, content: str
) -> None:
    cuts = [[reply], list(reply)] + [[reply[:i], reply[i:]] for i in range(1, len(reply))]
    for pieces in cuts:
        splitter = new_splitter(parser, tail)
        for piece in pieces:
            splitter.feed(piece)
        splitter.finish()
        assert "".join(reply[start:end] for start, end in splitter.reasoning_spans) == (reasoning or ""), pieces
        assert all(end > start for start, end in splitter.reasoning_spans)


@pytest.mark.parametrize(("pieces", "tail", "num_reasoning"), [
    (["<think>", "a", "b", "</think>", "c"], "", 2),  # single-token tags: the tokens between them
    (["<th", "ink>\n", "ab", "\n</th", "ink>", "c"], "", 3),  # a token holding reasoning and a tag's part counts
    (["<think>", "a", "", "é", "</think>"], "", 3),  # a character's first bytes count with it
    (["<think>", "a", ""], "\ufffd", 2),  # cut off inside a character: flushed, still reasoning
    (["x", "<think>", "a"], "", 1),  # cut off inside the block
    (["no", " tags"], "", 0),
])  # fmt: skip
def test_reasoning_tokens_counted_exactly_however_the_tokens_arrive(
    pieces: list[str], tail: str, num_reasoning: int
) -> None:
    # pieces[i]: token i's own text ("" for a token whose character is not whole yet);
    # tail: the unfinished character flushed at the end.
    for groups in ([pieces], [[p] for p in pieces], [pieces[:2], pieces[2:]]):
        count = ReasoningTokenCount(new_splitter("qwen3"))
        for group in groups[:-1]:
            assert count.add(group) <= num_reasoning
        assert count.finish(groups[-1], tail) == num_reasoning, groups
