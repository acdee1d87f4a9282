"""What a request's output must match (structured outputs): the kind of grammar and
its source text, as the balancer parsed it from the request and as it crosses the
mesh. Plain data, no xgrammar: the balancer, the wire and the scheduler handle it
without importing the grammar engine."""

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SOURCE_CHARS = 256 << 10
"""A grammar travels in every mesh message of its request (a NATS message is at most 1 MiB)."""


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """One constraint on a request's output.

    kind: json (source: a JSON schema as JSON text), json_object (any JSON object;
    source empty), regex, choice (source: a JSON list of the allowed strings), grammar
    (EBNF, xgrammar's dialect of GBNF) or structural_tag (xgrammar's structural tag, JSON).
    """

    kind: StructuredKind
    source: str = ""
    any_whitespace: bool = True
    """JSON kinds: allow whitespace between tokens (vLLM's default; bounded per gap,
    see grammar.MAX_WHITESPACE); False emits compact JSON (vLLM's disable_any_whitespace)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(self.source) > MAX_SOURCE_CHARS:
            raise ValueError(f"structured output {self.kind} is too long: {len(self.source)} characters "
                             f"(at most {MAX_SOURCE_CHARS})")  # fmt: skip
        if self.kind != "json_object" and not self.source:
            raise ValueError(f"structured output {self.kind} must not be empty")

    @classmethod
    def choice(cls, options: list[str]) -> "StructuredSpec":
        if not options:
            raise ValueError("choice must list at least one string")
        return cls("choice", json.dumps(options, ensure_ascii=False))

    @property
    def key(self) -> str:
        """The content hash the compiled-grammar cache is keyed by (the same on every process)."""
        text = json.dumps([self.kind, self.source, self.any_whitespace], ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()
