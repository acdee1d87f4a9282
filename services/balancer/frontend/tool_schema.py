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

import asyncio
import json
from dataclasses import fields
from typing import Any

from services.balancer.frontend.errors import APIError
from services.balancer.frontend.tool_bodies import ToolDefinition
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


def structured_outputs_available() -> bool:
    """Whether the engine enforces a JSON schema (SamplingParams.structured, shared/engine/structured/)."""
    return any(f.name == "structured" for f in fields(SamplingParams))


async def checked_constraint(schema: dict[str, Any], param: str) -> Any:
    """schema as the structured-output spec the engine enforces, its grammar built here
    (off the event loop) so that a schema xgrammar cannot enforce is a 400 naming param,
    before the mesh. Until the engine has structured outputs, a forced tool_choice is
    refused: never answered unconstrained."""
    if not structured_outputs_available():
        raise APIError(
            400, "tool_choice: 'required' and a named function need constrained decoding, which this "
            "server's engine does not have yet; use 'auto' or 'none'", param="tool_choice",
        )
    # Imported here: present only with the field checked above.
    from shared.engine.structured.grammar import build_grammar  # noqa: PLC0415
    from shared.engine.structured.spec import StructuredSpec  # noqa: PLC0415

    # Compact JSON: a call's text is the arguments clients read, and a weak model
    # would otherwise spend tokens on whitespace the grammar allows.
    spec = StructuredSpec("json", json.dumps(schema, ensure_ascii=False), any_whitespace=False)
    try:
        await asyncio.to_thread(build_grammar, spec)
    except ValueError as exc:
        raise APIError(400, f"{param}: cannot constrain the output to it: {exc}", param=param) from exc
    return spec


def constrain(params: SamplingParams, spec: Any) -> None:
    """One generation's output held to a forced tool_choice's spec."""
    if getattr(params, "structured", None) is not None:
        raise APIError(
            400, "tool_choice: a forced tool call already constrains the output; it cannot be combined with "
            "response_format, structured_outputs or guided_* (use tool_choice 'auto' or drop the other)",
            param="tool_choice",
        )
    params.structured = spec  # type: ignore[attr-defined]
