"""Reasoning through the balancer's HTTP API (the real app and openai client,
tests/helpers/tool_api.py's scripted generator) on make_model's seeded folders:
message.reasoning_content and delta.reasoning_content split exactly at each
family's tags, whole and streamed token by token; the format chosen by the chat
template (GPT-OSS's harmony, DeepSeek-V4's <think>) or the setting (qwen3 on the
project's ChatML model); reasoning before tool calls; reasoning_effort and the
thinking switch passed where the template reads them, a 400 naming them elsewhere."""

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

