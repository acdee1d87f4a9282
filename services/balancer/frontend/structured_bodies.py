"""Structured outputs in the request bodies: OpenAI's response_format (json_object,
json_schema), vLLM's structured_outputs {json, regex, choice, grammar, json_object,
structural_tag} and its older guided_* fields, resolved to one StructuredSpec.

A request names at most one constraint; an unknown key, two constraints at once, or a
schema, regex or grammar xgrammar cannot enforce is a 400 naming the field, never an
unconstrained answer (structured_outputs.py resolves and checks them).
"""

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from services.balancer.frontend.body_fields import StrictBody, Text


class JsonSchemaFormat(StrictBody):
    """OpenAI's response_format.json_schema."""

    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    """Accepted either way: the grammar always enforces the schema in full (xgrammar's
    strict mode: no properties beyond those declared)."""


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _only_for_json_schema(cls, value: JsonSchemaFormat | None, info: ValidationInfo) -> JsonSchemaFormat | None:
        if value is not None and info.data.get("type") != "json_schema":
            raise ValueError("is only allowed with type: json_schema")
        return value


class StructuredOutputs(StrictBody):
    """vLLM's structured_outputs (StructuredOutputsParams): exactly one constraint."""

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    """A JSON schema (an object, or its JSON text)."""
    regex: Text | None = None
    choice: list[Text] | None = Field(None, min_length=1)
    grammar: Text | None = None
    """EBNF (xgrammar's dialect of GBNF; the start rule is root)."""
    json_object: bool | None = None
    structural_tag: dict[str, Any] | Text | None = None
    disable_any_whitespace: bool = False
    """Compact JSON: no whitespace between tokens."""
