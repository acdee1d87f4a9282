"""Tool calls read from a model's output, whole or streamed, one parser per template family.

  base.py        the calls, the stream's deltas, one call's JSON read as it arrives;
  hermes.py      <tool_call>{...}</tool_call> (Qwen 2.5/3, Hermes, the balancer's own tool prompt);
  json_calls.py  bare JSON objects: Llama 3's (after <|python_tag|>), and "required"'s array;
  harmony.py     GPT-OSS's harmony messages (`to=functions.NAME ... <|call|>`);
  dsml.py        DeepSeek-V4's DSML block (`<｜DSML｜tool_calls>`);
  named.py       a named tool_choice: the whole output is the arguments.

The balancer setting tool_call_parser picks the family; "auto" (the default)
reads it off the chat template's text, as vLLM's --tool-call-parser is chosen by hand.
"""

import re
from collections.abc import Callable

from services.balancer.frontend.tool_parsers.base import (
    ParsedOutput,
    StreamingParser,
    StreamPiece,
    ToolCall,
    ToolCallDelta,
    parse_whole,
)
from services.balancer.frontend.tool_parsers.dsml import DsmlParser
from services.balancer.frontend.tool_parsers.harmony import HarmonyParser
from services.balancer.frontend.tool_parsers.hermes import HermesParser
from services.balancer.frontend.tool_parsers.json_calls import json_array, llama3_json
from services.balancer.frontend.tool_parsers.named import NamedCallParser

PARSERS: dict[str, Callable[[], StreamingParser]] = {
    "hermes": HermesParser, "llama3_json": llama3_json, "openai": HarmonyParser, "deepseek_v4": DsmlParser,
}  # fmt: skip
"""The auto tool-call parsers by the names balancer.tool_call_parser takes (vLLM's names;
"openai" is vLLM's name for GPT-OSS's harmony format)."""
TOOL_CALL_PARSER_SETTINGS = ("auto", *PARSERS)

_TAKES_TOOLS = re.compile(r"\btools\b")


def template_takes_tools(source: str) -> bool:
    """Whether a chat template renders the `tools` variable (else the balancer's own prompt does)."""
    return bool(_TAKES_TOOLS.search(source))


def choose_parser(setting: str, template_source: str | None) -> str | None:
    """The parser family for a model: the setting, or with "auto" the one its chat
    template asks for; None when the template takes tools in a format we do not know."""
    if setting != "auto":
        if setting not in PARSERS:
            raise ValueError(f"balancer.tool_call_parser must be one of {TOOL_CALL_PARSER_SETTINGS}, got {setting!r}")
        return setting
    if template_source is None or not template_takes_tools(template_source):
        return "hermes"  # tool_prompt.py's format, which the balancer renders itself
    # The formats' own markers, most specific first: GPT-OSS's template writes a call's
    # end token, DeepSeek-V4's encoding (shared/recipe/deepseek_v4_chat.py) its DSML block.
    if "<|call|>" in template_source and "to=" in template_source:
        return "openai"
    if "｜DSML｜tool_calls" in template_source:
        return "deepseek_v4"
    if "<tool_call>" in template_source:
        return "hermes"
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return "llama3_json"
    return None


__all__ = [
    "PARSERS", "TOOL_CALL_PARSER_SETTINGS", "NamedCallParser", "ParsedOutput", "StreamPiece", "StreamingParser",
    "ToolCall", "ToolCallDelta", "choose_parser", "json_array", "llama3_json", "parse_whole", "template_takes_tools",
]  # fmt: skip
