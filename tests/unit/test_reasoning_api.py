"""Reasoning through the balancer's HTTP API (the real app and openai client,
tests/helpers/tool_api.py's scripted generator) on make_model's seeded folders:
message.reasoning_content and delta.reasoning_content split exactly at each
family's tags, whole and streamed token by token; the format chosen by the chat
template (GPT-OSS's harmony, DeepSeek-V4's and Qwen3's <think>) or the setting (qwen3
on the project's ChatML model); reasoning before tool calls; reasoning_effort and the
thinking switch passed where the template reads them, a 400 naming them elsewhere;
usage's reasoning_tokens exact, whole and in the stream's usage chunk."""

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.helpers.tool_api import Served, chat, served_model

HARMONY = ("<|channel|>analysis<|message|>The user greets. Greet back.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>Hello, friend.<|return|>")  # fmt: skip


def _served(tmp_path_factory: pytest.TempPathFactory, arch: str | None, **settings: Any) -> Iterator[Served]:
    yield from served_model(tmp_path_factory.mktemp(arch or "chatml"), arch, **settings)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _served(tmp_path_factory, "gpt_oss")


@pytest.fixture(scope="module")
def deepseek_v4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _served(tmp_path_factory, "deepseek_v4")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _served(tmp_path_factory, None, reasoning_parser="qwen3")


def streamed(served: Served, reply: str, **body: Any) -> tuple[list[str], list[str]]:
    """The reasoning and content pieces of a stream, in order (empty ones left out)."""
    reasoning: list[str] = []
    content: list[str] = []
    for chunk in chat(served, reply, stream=True, **body):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            assert not (delta.get("reasoning_content") and delta.get("content")), delta
            if delta.get("reasoning_content"):
                reasoning.append(delta["reasoning_content"])
            if delta.get("content"):
                content.append(delta["content"])
    return reasoning, content


def test_gpt_oss_analysis_channel_is_the_reasoning(gpt_oss: Served) -> None:
    message = chat(gpt_oss, HARMONY).choices[0].message
    assert (message.reasoning_content, message.content) == ("The user greets. Greet back.", "Hello, friend.")  # type: ignore[attr-defined]
    reasoning, content = streamed(gpt_oss, HARMONY)
    assert ("".join(reasoning), "".join(content)) == ("The user greets. Greet back.", "Hello, friend.")
    assert len(reasoning) > 1  # streamed as it came, not at the end


def test_gpt_oss_reasoning_then_a_tool_call(gpt_oss: Served) -> None:
    reply = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
             'to=functions.get_weather <|constrain|>json<|message|>{"city": "Bern"}<|call|>')  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}}]
    choice = chat(gpt_oss, reply, tools=tools).choices[0]
    assert choice.message.reasoning_content == "Need weather."  # type: ignore[attr-defined]
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("get_weather", '{"city": "Bern"}')]
    assert choice.finish_reason == "tool_calls"


def test_gpt_oss_reasoning_effort_reaches_its_template(gpt_oss: Served) -> None:
    chat(gpt_oss, HARMONY, reasoning_effort="high")
    assert "Reasoning: high" in gpt_oss.prompt_text()
    with pytest.raises(openai.BadRequestError) as refused:
        chat(gpt_oss, HARMONY, reasoning_effort="minimal")
    assert refused.value.body["param"] == "reasoning_effort"  # type: ignore[index]


def test_deepseek_v4_thinking_switch_opens_the_block_and_splits_the_reply(deepseek_v4: Served) -> None:
    reply = "Two and two.</think>Four."
    message = chat(deepseek_v4, reply, extra_body={"chat_template_kwargs": {"thinking": True}}).choices[0].message
    assert deepseek_v4.prompt_text().endswith("<｜Assistant｜><think>")
    assert (message.reasoning_content, message.content) == ("Two and two.", "Four.")  # type: ignore[attr-defined]
    reasoning, content = streamed(deepseek_v4, reply, extra_body={"chat_template_kwargs": {"thinking": True}})
    assert ("".join(reasoning), "".join(content)) == ("Two and two.", "Four.")
    # Chat mode: the prompt closed the block, the reply is content (no reasoning key at all).
    plain = chat(deepseek_v4, "Four.").choices[0].message
    assert plain.content == "Four." and plain.model_dump().get("reasoning_content") is None
    with pytest.raises(openai.BadRequestError) as refused:
        chat(deepseek_v4, reply, reasoning_effort="high")
    assert refused.value.body["param"] == "reasoning_effort"  # type: ignore[index]


def test_qwen3_think_tags_split_across_tokens(qwen3: Served) -> None:
    reply = "<think>\nAdd them: 2+2.\n</think>\n\nIt is 4."
    # The project's tokenizer has no <think> token: the tags are split over several tokens.
    assert len(qwen3.recipe.encode("<think>", add_special_tokens=False)) > 1
    message = chat(qwen3, reply).choices[0].message
    assert (message.reasoning_content, message.content) == ("\nAdd them: 2+2.\n", "\n\nIt is 4.")  # type: ignore[attr-defined]
    reasoning, content = streamed(qwen3, reply)
    assert ("".join(reasoning), "".join(content)) == ("\nAdd them: 2+2.\n", "\n\nIt is 4.")
    assert not any("<" in piece and "think" in piece for piece in reasoning + content)


def test_switches_the_template_does_not_read_are_400s(qwen3: Served) -> None:
    for extra, param in [({"reasoning_effort": "low"}, "reasoning_effort"),
                         ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking")]:
        with pytest.raises(openai.BadRequestError) as refused:
            chat(qwen3, "x", extra_body=extra)
        assert refused.value.body["param"] == param  # type: ignore[index]



# -- usage: the reasoning's tokens (reasoning_parsers/count.py) ------------------------------


def stream_usage(served: Served, reply: str, **body: Any) -> Any:
    """The usage of a stream's last chunk (stream_options.include_usage)."""
    chunks = list(chat(served, reply, stream=True, stream_options={"include_usage": True}, **body))
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    return chunks[-1].usage


def test_reasoning_tokens_are_counted_where_the_tags_span_several_tokens(qwen3: Served) -> None:
    reply = "<think>\nAdd them: 2+2.\n</think>\n\nIt is 4."
    pieces = [qwen3.recipe.decode([t], skip_special_tokens=False) for t in qwen3.recipe.encode(reply, False)]
    assert pieces[:13] == ["<", "th", "ink", ">\n", "Add", " them", ":", " ", "2", "+", "2", ".\n", "</"]
    # Counted: '>\n' (it ends the tag and holds the reasoning's first newline) to '.\n';
    # not the tokens of the tags alone, nor the content's.
    whole = chat(qwen3, reply).usage
    assert whole.completion_tokens == len(pieces) and whole.completion_tokens_details.reasoning_tokens == 9
    streamed = stream_usage(qwen3, reply)
    assert streamed.completion_tokens == len(pieces) and streamed.completion_tokens_details.reasoning_tokens == 9
    # Each choice counted, then summed, as completion_tokens are.
    assert chat(qwen3, reply, n=2).usage.completion_tokens_details.reasoning_tokens == 18
    assert stream_usage(qwen3, reply, n=2).completion_tokens_details.reasoning_tokens == 18


def test_reasoning_tokens_of_single_token_tags_are_those_between_them(deepseek_v4: Served) -> None:
    # V4's </think> is one token and the prompt opened the block: vLLM's count, the
    # tokens before the end tag, the tag not counted.
    recipe, reasoning = deepseek_v4.recipe, "Two and two."
    ids = recipe.encode(f"{reasoning}</think>Four.", add_special_tokens=False)
    [end] = recipe.encode("</think>", add_special_tokens=False)
    assert ids[: ids.index(end)] == recipe.encode(reasoning, add_special_tokens=False)
    thinking = {"extra_body": {"chat_template_kwargs": {"thinking": True}}}
    for usage in (chat(deepseek_v4, f"{reasoning}</think>Four.", **thinking).usage,
                  stream_usage(deepseek_v4, f"{reasoning}</think>Four.", **thinking)):  # fmt: skip
        assert usage.completion_tokens == len(ids)
        assert usage.completion_tokens_details.reasoning_tokens == ids.index(end)
    # Thinking off (the prompt closed the block): the reply is content, no token is reasoning.
    for usage in (chat(deepseek_v4, "Four.").usage, stream_usage(deepseek_v4, "Four.")):
        assert usage.completion_tokens > 0 and usage.completion_tokens_details.reasoning_tokens == 0


def test_reasoning_tokens_of_harmony_are_the_analysis_bodys(gpt_oss: Served) -> None:
    recipe = gpt_oss.recipe
    ids = recipe.encode(HARMONY, add_special_tokens=False)
    message, end = (recipe.encode(t, add_special_tokens=False)[0] for t in ("<|message|>", "<|end|>"))
    body = ids[ids.index(message) + 1 : ids.index(end)]
    assert body == recipe.encode("The user greets. Greet back.", add_special_tokens=False)
    for usage in (chat(gpt_oss, HARMONY).usage, stream_usage(gpt_oss, HARMONY)):
        assert usage.completion_tokens == len(ids) and usage.completion_tokens_details.reasoning_tokens == len(body)


def test_a_reply_not_read_for_reasoning_reports_no_reasoning_tokens(qwen3: Served) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = '[{"name": "get_weather", "arguments": {"city": "Bern"}}]'
    forced = chat(qwen3, call, tools=tools, tool_choice="required")
    assert forced.choices[0].message.tool_calls and forced.usage.completion_tokens_details is None


@pytest.fixture(scope="module")
def qwen3_released(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """make_model's Qwen3 folder: the released template, <think> one token; the format read off the template."""
    yield from _served(tmp_path_factory, "qwen3")


def test_qwen3_template_picks_the_format_and_its_switch_turns_thinking_off(qwen3_released: Served) -> None:
    recipe, reasoning = qwen3_released.recipe, "\nAdd them: 2+2.\n"
    reply = f"<think>{reasoning}</think>\n\nIt is 4."
    ids = recipe.encode(reply, add_special_tokens=False)
    start, end = (recipe.encode(t, add_special_tokens=False) for t in ("<think>", "</think>"))
    assert ids[: ids.index(end[0]) + 1] == start + recipe.encode(reasoning, add_special_tokens=False) + end
    got = chat(qwen3_released, reply)
    assert qwen3_released.prompt_text().endswith("<|im_start|>assistant\n")
    message = got.choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, "\n\nIt is 4.")  # type: ignore[attr-defined]
    # vLLM's count: the tokens between the two tag tokens.
    assert got.usage.completion_tokens_details.reasoning_tokens == ids.index(end[0]) - 1
    assert stream_usage(qwen3_released, reply).completion_tokens_details.reasoning_tokens == ids.index(end[0]) - 1
    off = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    plain = chat(qwen3_released, "It is 4.", **off)
    assert qwen3_released.prompt_text().endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert plain.choices[0].message.content == "It is 4."
    assert plain.choices[0].message.model_dump().get("reasoning_content") is None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    assert stream_usage(qwen3_released, "It is 4.", **off).completion_tokens_details.reasoning_tokens == 0
