"""Tools in a chat request, in OpenAI's shapes: the functions offered (tools), which
the model must or may call (tool_choice), and the calls and results in the history
(an assistant message's tool_calls, a tool message's tool_call_id).

Checked here, with the field named in the 400: function names (OpenAI's pattern),
parameters that are a JSON schema object, arguments in the history that are JSON
objects, and the checks across fields (ChatCompletionRequest's validators): a
tool_choice without tools, a named choice of a function not offered, strict
where nothing enforces it.
"""

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from services.balancer.frontend.body_fields import StrictBody, Text

MAX_TOOLS = 128
"""OpenAI's own cap on the functions of one request."""

FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
"""OpenAI's rule: letters, digits, underscores and dashes, at most 64. The name is
written into the prompt and into constraining schemas, so it stays that plain."""


def _json_schema_object(schema: dict[str, Any]) -> dict[str, Any]:
    try:  # every string valid Unicode, however deep (it is rendered into the prompt)
        json.dumps(schema, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode: a string in it holds a lone surrogate") from None
    kind = schema.get("type")
    if kind is not None and kind != "object":
        raise ValueError(f'must be a JSON schema of an object (type "object"), got type {kind!r}')
    return schema


class FunctionDefinition(StrictBody):
    name: FunctionName
    description: Text | None = None
    parameters: Annotated[dict[str, Any], AfterValidator(_json_schema_object)] | None = None
    """The arguments' JSON schema (an object); None: the function takes no arguments."""
    strict: bool | None = None
    """OpenAI's: the arguments follow the schema exactly. Honoured where the output is
    constrained (tool_choice required or this function named); refused elsewhere."""

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class ToolDefinition(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionRef(StrictBody):
    name: Text


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: FunctionRef


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _json_object_text(arguments: str) -> str:
    try:
        value = json.loads(arguments)
    except ValueError:
        raise ValueError("must be a JSON object as a string (the arguments the model wrote)") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object as a string (the arguments the model wrote)")
    return arguments


class CalledFunction(StrictBody):
    name: Text
    arguments: Annotated[Text, AfterValidator(_json_object_text)]


class MessageToolCall(StrictBody):
    """A call the assistant made, in an earlier turn."""

    id: Text
    type: Literal["function"]
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        # Templates write the arguments with tojson, so they get the object, not its text
        # (as transformers' and vLLM's servers hand them over).
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": json.loads(self.function.arguments)},
        }
