"""Reasoning read out of a model's reply, whole or streamed, one splitter per format.

  base.py     a piece of reasoning and content, the splitter's interface;
  think.py    `<think>...</think>` (Qwen3, DeepSeek-R1, V3.1 and V4);
  harmony.py  GPT-OSS's analysis channel;
  count.py    how many of a reply's tokens are reasoning (usage's reasoning_tokens).

The balancer setting reasoning_parser picks the format by vLLM's
--reasoning-parser names; "auto" (the default) reads it off the chat template,
"none" leaves replies whole. Chat completions return the reasoning as
message.reasoning_content (streamed as delta.reasoning_content); /v1/responses
as reasoning items; both split through choices.split_whole and split_delta.
"""

from collections.abc import Callable

from services.balancer.frontend.reasoning_parsers.base import ReasoningPiece, ReasoningSplitter
from services.balancer.frontend.reasoning_parsers.count import ReasoningTokenCount
from services.balancer.frontend.reasoning_parsers.harmony import HarmonySplitter
from services.balancer.frontend.reasoning_parsers.think import (
    THINK_END,
    THINK_START,
    ThinkSplitter,
    prompt_opens_thinking,
)


def _think(prompt_tail: str, raw: bool) -> ReasoningSplitter:
    return ThinkSplitter(inside=prompt_opens_thinking(prompt_tail))


def _r1(prompt_tail: str, raw: bool) -> ReasoningSplitter:
    # DeepSeek-R1's first templates opened no block in the prompt, yet the model
    # writes its thinking straight away and only closes it: no tag in the prompt means inside.
    no_tag = THINK_START not in prompt_tail and THINK_END not in prompt_tail
    return ThinkSplitter(inside=no_tag or prompt_opens_thinking(prompt_tail))


def _harmony(prompt_tail: str, raw: bool) -> ReasoningSplitter:
    return HarmonySplitter(raw=raw)


REASONING_PARSERS: dict[str, Callable[[str, bool], ReasoningSplitter]] = {
    "qwen3": _think, "deepseek_r1": _r1, "deepseek_v3": _think, "deepseek_v4": _think, "openai_gptoss": _harmony,
}  # fmt: skip
"""Splitter factories (prompt_tail, raw) by vLLM's --reasoning-parser names."""
REASONING_PARSER_SETTINGS = ("auto", "none", *REASONING_PARSERS)
PROMPT_TAIL_TOKENS = 16
"""The prompt's last tokens decoded to see whether it opened a thinking block."""


def choose_reasoning_parser(setting: str, template_source: str | None) -> str | None:
    """The format for a model: the setting, or with "auto" the one its chat template
    writes; None: replies are not split ("none", or a template with no reasoning)."""
    if setting not in REASONING_PARSER_SETTINGS:
        raise ValueError(f"balancer.reasoning_parser must be one of {REASONING_PARSER_SETTINGS}, got {setting!r}")
    if setting != "auto":
        return None if setting == "none" else setting
    if template_source is None:
        return None
    if "<|channel|>" in template_source and "analysis" in template_source:
        return "openai_gptoss"
    if "｜DSML｜" in template_source:
        return "deepseek_v4"
    if THINK_END in template_source:
        return "qwen3"
    return None


def new_splitter(parser: str, prompt_tail: str = "", raw: bool = False) -> ReasoningSplitter:
    """A splitter for one reply. prompt_tail: the prompt's last text (does it open a
    thinking block?); raw: harmony content kept as written, for a tool parser."""
    return REASONING_PARSERS[parser](prompt_tail, raw)


def split_reasoning(text: str, parser: str, prompt_tail: str = "") -> tuple[str | None, str]:
    """A whole reply as (reasoning, content); reasoning None when the reply has none."""
    splitter = new_splitter(parser, prompt_tail)
    piece = splitter.feed(text)
    piece.add(splitter.finish())
    return (piece.reasoning if splitter.saw_reasoning else None), piece.content


__all__ = [
    "PROMPT_TAIL_TOKENS", "REASONING_PARSERS", "REASONING_PARSER_SETTINGS", "ReasoningPiece", "ReasoningSplitter",
    "ReasoningTokenCount", "choose_reasoning_parser", "new_splitter", "split_reasoning",
]  # fmt: skip
