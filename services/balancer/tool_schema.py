"""What a forced tool_choice constrains the output to, as a JSON schema, and the one
place that hands it to structured outputs.

  * a named function: its arguments' schema; the output is the arguments
    (tool_parsers/named.py reads it as that function's one call);
  * "required": an array of at least one call, each {"name": one of the tools,
    "arguments": that tool's schema} (at most one without parallel_tool_calls),
    read by tool_parsers/json_calls.json_array.

These are vLLM's constraints for the two choices ("arguments" where vLLM writes
"parameters", so the array reads as Hermes' calls do). The prompt still carries
the tools through the chat template: the model sees what it is forced to call.
"""

import json
from dataclasses import fields
from typing import Any

from services.balancer.errors import APIError
from services.balancer.tool_bodies import ToolDefinition
from shared.engine.sampling_params import SamplingParams


def named_schema(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.arguments_schema


def required_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "arguments": tool.function.arguments_schema,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _has_structured_outputs() -> bool:
    return any(f.name == "structured" for f in fields(SamplingParams))


def constrain(params: SamplingParams, schema: dict[str, Any]) -> None:
    """Constrain one generation's output to schema: the integration point with
    structured outputs (shared/engine/structured/, SamplingParams.structured). Until
    the engine has it, a forced tool_choice is refused, never answered unconstrained."""
    if not _has_structured_outputs():
        raise APIError(
            400, "tool_choice: 'required' and a named function need constrained decoding, which this "
            "server's engine does not have yet; use 'auto' or 'none'", param="tool_choice",
        )
    from shared.engine.structured.spec import StructuredSpec  # noqa: PLC0415 (present once the field is)

    # Compact JSON: a call's text is the arguments clients read, and a weak model
    # would otherwise spend tokens on whitespace the grammar allows.
    params.structured = StructuredSpec("json", json.dumps(schema, ensure_ascii=False), any_whitespace=False)  # type: ignore[attr-defined]
