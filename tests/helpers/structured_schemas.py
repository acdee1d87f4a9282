"""Seeded random JSON schemas for the structured-output tests: nested objects, arrays
with min/max items, enums, string patterns and lengths, bounded integers and numbers,
booleans, required and optional properties.

Every schema describes a finite language (strings, numbers and arrays bounded), so a
random model constrained by it must finish within MAX_TOKENS: an output that does not
parse or validate is the grammar's fault, never the length limit's.
"""

import random
import string
from typing import Any

NUM_SCHEMAS = 50
MAX_TOKENS = 1200
"""Enough for the largest schema here with free whitespace (at most 16 characters
between two JSON tokens, grammar.MAX_WHITESPACE) and one character per token."""
_PATTERNS = (r"^[a-z]{1,6}$", r"^[A-Z][0-9]{2}$", r"^(ab|cd)+x?$", r"^[0-9]{3}-[0-9]{2}$", r"^id_[a-f0-9]{1,4}$")
_PATTERN_BOUNDED = {r"^(ab|cd)+x?$": r"^(ab|cd){1,3}x?$"}


def random_schema(seed: int) -> dict[str, Any]:
    """The seed's schema: an object at the top (what response_format json_schema expects)."""
    rng = random.Random(seed)
    return _object(rng, depth=0, budget=[9])


def _object(rng: random.Random, depth: int, budget: list[int]) -> dict[str, Any]:
    names = rng.sample([f"{w}_{i}" for i, w in enumerate(("name", "kind", "size", "tags", "meta", "ok", "when", "code"))],
                       rng.randint(1, 4))  # fmt: skip
    properties = {}
    for name in names:
        if budget[0] <= 0:
            break
        budget[0] -= 1
        properties[name] = _value(rng, depth + 1, budget)
    required = [n for n in properties if rng.random() < 0.6]
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def _value(rng: random.Random, depth: int, budget: list[int]) -> dict[str, Any]:
    kinds = ["string_len", "pattern", "enum", "integer", "number", "boolean", "array"]
    if depth < 3:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "string_len":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 6)}
    if kind == "pattern":
        pattern = rng.choice(_PATTERNS)
        return {"type": "string", "pattern": _PATTERN_BOUNDED.get(pattern, pattern)}
    if kind == "enum":
        if rng.random() < 0.5:
            return {"enum": rng.sample(["red", "green", "blue", "a b", 'q"uote', "ünï"], rng.randint(1, 4))}
        return {"type": "integer", "enum": rng.sample(range(-50, 50), rng.randint(1, 4))}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":
        low = round(rng.uniform(-100, 100), 2)
        return {"type": "number", "minimum": low, "maximum": round(low + rng.uniform(0.5, 500), 2)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        low = rng.randint(0, 2)
        items = _value(rng, depth + 1, budget) if depth < 3 and budget[0] > 0 else {"type": "boolean"}
        budget[0] -= 1
        return {"type": "array", "items": items, "minItems": low, "maxItems": low + rng.randint(0, 2)}
    return _object(rng, depth, budget)


def random_prompt(seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_letters + " ") for _ in range(rng.randint(3, 30)))
