"""A conversation with tools as the chat template's input.

A template that renders `tools` (Qwen, Hermes, Llama 3.1, ...) gets the tools
and the messages as they are, as transformers' apply_chat_template(..., tools=)
hands them over: the model is asked for calls in the format it was trained on.

A template that does not (the project's own, many base models') would drop the
tools silently and refuse tool messages. The balancer then writes the tools into
the conversation itself, in Hermes' format (which the hermes parser reads back):

  * a system message, first (the request's own system message follows in it,
    after a blank line), with this text and one JSON line per tool:

        # Tools

        You may call one or more functions to assist with the user query.

        You are provided with function signatures within <tools></tools> XML tags:
        <tools>
        {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
        </tools>

        For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
        <tool_call>
        {"name": <function-name>, "arguments": <args-json-object>}
        </tool_call>

  * an assistant message's calls appended to its content, each as
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` on lines of their own;
  * tool messages as one user message per run of them, each result as
    `<tool_response>\\n...\\n</tool_response>`.
"""

import json
from typing import Any

from services.balancer.frontend.tool_parsers import template_takes_tools

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_PREAMBLE + lines + TOOLS_INSTRUCTIONS


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def _calls_text(calls: list[dict[str, Any]]) -> str:
    return "\n".join(
        "<tool_call>\n"
        + json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]}, ensure_ascii=False)
        + "\n</tool_call>"
        for call in calls
    )


def inline_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The messages with the tools, the calls and their results written in as text
    (the format above), for a template that knows only system, user and assistant."""
    out: list[dict[str, Any]] = []
    if tools:
        system = tools_system_text(tools)
        if messages and messages[0]["role"] == "system":
            system = _text(messages[0].get("content")) + "\n\n" + system
            messages = messages[1:]
        out.append({"role": "system", "content": system})
    for message in messages:
        role = message["role"]
        if role == "tool":
            response = "<tool_response>\n" + _text(message.get("content")) + "\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            text = _text(message.get("content"))
            calls = _calls_text(message["tool_calls"])
            rest = {k: v for k, v in message.items() if k not in ("tool_calls", "content")}
            out.append({**rest, "content": (text + "\n" if text else "") + calls})
            continue
        out.append(message)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def template_inputs(
    template_source: str | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to render: as they are for a template that takes tools,
    written in (inline_tools) for one that does not, when the conversation has any."""
    has_tool_turns = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if (tools or has_tool_turns) and template_source is not None and not template_takes_tools(template_source):
        return inline_tools(messages, tools), None
    return messages, tools
