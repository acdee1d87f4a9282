"""A body's structured-output fields (structured_bodies.py) as the one StructuredSpec
the engine enforces, checked before the request enters the mesh: two constraints at
once, a malformed one, or a schema, regex or grammar xgrammar cannot enforce is a 400
naming the field."""

import asyncio
import json
from typing import Any, NoReturn

from services.balancer.frontend.errors import APIError
from services.balancer.frontend.structured_bodies import ResponseFormat, StructuredOutputs
from shared.engine.structured.grammar import build_grammar
from shared.engine.structured.spec import StructuredSpec

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_spec(body: Any) -> StructuredSpec | None:
    """The one constraint the body asks for (None: free output); APIError 400 naming
    the field when it asks for several or one is malformed. Reads the body's
    structured_outputs, guided_* and (chat) response_format."""
    resolved = _resolve(body)
    return resolved[1] if resolved is not None else None


async def check_structured(body: Any) -> StructuredSpec | None:
    """structured_spec, and its grammar built (off the event loop: the first use imports
    xgrammar), so that an invalid schema, regex or grammar is a 400 here, before the mesh."""
    resolved = _resolve(body)
    if resolved is None:
        return None
    param, spec = resolved
    try:
        await asyncio.to_thread(build_grammar, spec)
    except ValueError as exc:
        _refuse(param, str(exc))
    return spec


def _resolve(body: Any) -> tuple[str, StructuredSpec] | None:
    found = _named_specs(body)
    if len(found) > 1:
        names = ", ".join(param for param, _ in found)
        _refuse(found[1][0], f"only one structured output constraint per request, got {names}")
    return found[0] if found else None


def _named_specs(body: Any) -> list[tuple[str, StructuredSpec]]:
    out: list[tuple[str, StructuredSpec]] = []
    so: StructuredOutputs | None = getattr(body, "structured_outputs", None)
    if so is not None:
        given = [name for name in _CONSTRAINTS if _value(so, name) not in (None, False)]
        if not given:
            _refuse("structured_outputs", f"name one of {', '.join(_CONSTRAINTS)}")
        for name in given:
            param = f"structured_outputs.{name}"
            out.append((param, _spec(param, name, _value(so, name), not so.disable_any_whitespace)))
    for field, kind in _GUIDED.items():
        value = getattr(body, field, None)
        if value is not None:
            out.append((field, _spec(field, kind, value, True)))
    fmt: ResponseFormat | None = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        out.append(("response_format", StructuredSpec("json_object")))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            param = "response_format.json_schema" + ("" if fmt.json_schema is None else ".schema")
            _refuse(param, "is required with type: json_schema")
        schema = fmt.json_schema.schema_
        out.append(("response_format.json_schema.schema", _spec("response_format.json_schema.schema", "json", schema, True)))
    return out


def _value(so: StructuredOutputs, name: str) -> Any:
    return so.json_ if name == "json" else getattr(so, name)


def _spec(param: str, kind: str, value: Any, any_whitespace: bool) -> StructuredSpec:
    try:
        if kind == "json_object":
            return StructuredSpec("json_object", any_whitespace=any_whitespace)
        if kind == "choice":
            return StructuredSpec.choice(list(value))
        if kind in ("json", "structural_tag"):
            source = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            return StructuredSpec(kind, source, any_whitespace=any_whitespace)  # type: ignore[arg-type]
        return StructuredSpec(kind, value)  # type: ignore[arg-type]
    except ValueError as exc:
        _refuse(param, str(exc))


def _refuse(param: str, message: str) -> NoReturn:
    raise APIError(400, f"{param}: {message}", param=param)
