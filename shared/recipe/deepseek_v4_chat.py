"""DeepSeek-V4's chat format, which DeepSeek ships as Python (encoding/encoding_dsv4.py
beside the weights) rather than as a Jinja template: written here from that format,
so a V4 folder without a template chats as DeepSeek's own encoder would render it.

    <｜begin▁of▁sentence｜>{system}\\n\\n## Tools ... {one JSON line per function} ...
    <｜User｜>{user}<｜Assistant｜></think>{reply}\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="f">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>{result}</tool_result><｜Assistant｜></think>

  * tools go on the first (system) message; without one an empty system message
    carries them, as vLLM's DeepSeek-V3.2 tokenizer does;
  * tool messages become tool_result blocks of a user turn, ordered as the calls
    they answer, with a user message that follows them merged in ("\\n\\n" between);
  * chat mode closes the thinking block at once (`</think>`); chat_template_kwargs
    `thinking: true` (vLLM's name) opens it (`<think>`) and keeps earlier reasoning
    as DeepSeek's encoder does (dropped before the last user turn unless tools are given);
  * add_generation_prompt false leaves the assistant prefix off the end (DeepSeek's
    encoder always writes it).

Refused (ValueError, a 400 at the API): roles V4 has no turn for here, and
reasoning_effort, whose prompts are the reasoning API issue's.
"""

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

from shared.recipe.chat_template import require_messages

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
SPECIAL_TOKENS = (BOS, EOS)
"""Special in DeepSeek's tokenizer (skipped when decoding)."""
ADDED_TOKENS = (USER, ASSISTANT, THINK_START, THINK_END)
"""Single tokens that decode as text (not special), as in DeepSeek's tokenizer; DSML is plain text."""

# The prompt text V4 was trained on (encoding_dsv4.py's tools section): data, kept byte for byte.
TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside {think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

SOURCE = (
    "DeepSeek-V4 chat encoding (encoding/encoding_dsv4.py as released; shared/recipe/deepseek_v4_chat.py): "
    f"tools are listed in the system turn, calls come back in a <{DSML}tool_calls> block; "
    f"chat_template_kwargs thinking: true opens a {THINK_START}...{THINK_END} block of reasoning."
)
"""What stands for the template's text: tool-call and reasoning parsers are chosen by it
(tool_parsers.choose_parser, reasoning_parsers.choose_reasoning_parser), and the thinking
switch it reads is named in it (chat_template.template_switches)."""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text of OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def _arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    """A call's arguments as an object; the API hands them over parsed, DeepSeek's encoder takes text."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return {"arguments": arguments}  # what DeepSeek's encoder does with text that is not JSON
    return arguments if isinstance(arguments, dict) else {"arguments": arguments}


def _calls_text(calls: Sequence[Mapping[str, Any]]) -> str:
    invokes = []
    for call in calls:
        parameters = "\n".join(
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f"{value if isinstance(value, str) else _json(value)}</{DSML}parameter>"
            for key, value in _arguments(call).items()
        )
        name = call.get("function", call)["name"]
        invokes.append(f'<{DSML}invoke name="{name}">\n{parameters}\n</{DSML}invoke>')
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    schemas = "\n".join(_json(tool.get("function", tool)) for tool in tools)
    return TOOLS_TEMPLATE.format(dsml=DSML, think_start=THINK_START, think_end=THINK_END, schemas=schemas)


def _turns(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """User turns as DeepSeek builds them: tool results and the user text after them in
    one turn of blocks, each run of results ordered as the calls they answer."""
    turns: list[dict[str, Any]] = []
    order: dict[str, int] = {}
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            order = {call.get("id", ""): i for i, call in enumerate(message["tool_calls"])}
        if role == "tool":
            block = ("result", message.get("tool_call_id", ""), _text(message.get("content")))
            if turns and turns[-1]["role"] == "user":
                turns[-1]["blocks"].append(block)
            else:
                turns.append({"role": "user", "blocks": [block]})
        elif role == "user":
            block = ("text", "", _text(message.get("content")))
            if turns and turns[-1]["role"] == "user":
                turns[-1]["blocks"].append(block)
            else:
                turns.append({"role": "user", "blocks": [block]})
        elif role in ("system", "assistant"):
            turns.append(copy.deepcopy(dict(message)))
        else:
            raise ValueError(f"DeepSeek-V4's chat format has no turn for role {role!r}: use system, user, assistant or tool.")
        if role in ("tool", "user") and len(turns[-1]["blocks"]) > 1:
            blocks = turns[-1]["blocks"]
            results = sorted((b for b in blocks if b[0] == "result"), key=lambda b: order.get(b[1], 0))
            it = iter(results)
            turns[-1]["blocks"] = [next(it) if b[0] == "result" else b for b in blocks]
    return turns


class DeepseekV4Chat:
    """Renders conversations in DeepSeek-V4's format (the Recipe's chat template for V4 folders)."""

    source = SOURCE

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> str:
        require_messages(messages)
        if kwargs.get("reasoning_effort") is not None:
            raise ValueError("reasoning_effort: DeepSeek-V4's reasoning prompts are not served yet (the reasoning API's)")
        thinking = bool(kwargs.get("thinking", False))
        turns = _turns(messages)
        if tools:
            if turns[0]["role"] != "system":
                turns.insert(0, {"role": "system", "content": ""})
            turns[0]["tools"] = list(tools)
        drop_thinking = not tools
        last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=-1)
        if thinking and drop_thinking:
            for turn in turns[:last_user]:
                turn.pop("reasoning_content", None)
        prompt = BOS
        for index, turn in enumerate(turns):
            prompt += self._turn(turn, index, last_user, thinking, drop_thinking)
            is_last = index + 1 == len(turns)
            if turn["role"] != "user" or (not is_last and turns[index + 1]["role"] != "assistant"):
                continue
            if is_last and not add_generation_prompt:
                continue
            opens = thinking and (not drop_thinking or index >= last_user)
            prompt += ASSISTANT + (THINK_START if opens else THINK_END)
        return prompt

    @staticmethod
    def _turn(turn: Mapping[str, Any], index: int, last_user: int, thinking: bool, drop_thinking: bool) -> str:
        role = turn["role"]
        if role == "system":
            text = _text(turn.get("content"))
            return text + ("\n\n" + _tools_text(turn["tools"]) if turn.get("tools") else "")
        if role == "user":
            parts = [f"<tool_result>{text}</tool_result>" if kind == "result" else text for kind, _, text in turn["blocks"]]
            return USER + "\n\n".join(parts)
        reasoning = ""
        if thinking and (not drop_thinking or index > last_user):
            reasoning = (turn.get("reasoning_content") or "") + THINK_END
        calls = _calls_text(turn["tool_calls"]) if turn.get("tool_calls") else ""
        return reasoning + _text(turn.get("content")) + calls + EOS
