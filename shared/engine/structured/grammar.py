"""Structured-output specs as xgrammar grammars: checked (a ValueError that says what
is wrong, for the HTTP layer's 400) and compiled over the model's vocabulary, with
the compiled grammars cached by the spec's content hash.

xgrammar is imported on first use: importing it costs ~3 s (it imports transformers),
which a process that never sees a structured request should not pay.
"""

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.engine.structured.spec import StructuredSpec

if TYPE_CHECKING:
    import xgrammar
    from tokenizers import Tokenizer

MAX_WHITESPACE = 16
"""Whitespace characters allowed between two JSON tokens when whitespace is free: enough
for pretty-printed nesting, and a bound, so that a model that likes spaces cannot
spend its whole max_tokens between a comma and the next key."""
UNSUPPORTED_KEYWORDS = frozenset(
    {"not", "if", "then", "else", "dependentSchemas", "dependentRequired", "contains", "minContains",
     "maxContains", "uniqueItems"}
)  # fmt: skip
"""JSON-schema keywords xgrammar 0.2.9 ignores (checked: the grammar is the same
without them): refused, since ignoring them would let invalid output through."""
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "propertyNames", "additionalItems")
_LOOSE_CHARACTER = r'[^\"\\\r\n]'
_JSON_CHARACTER = r'[^\0-\x1f\"\\]'
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(slots=True)
class CacheStats:
    num_hits: int = 0
    num_misses: int = 0


def build_grammar(spec: StructuredSpec) -> "xgrammar.Grammar":
    """The spec as an xgrammar Grammar; ValueError (naming the kind and the problem) when
    it is invalid or uses what we cannot enforce. Needs no vocabulary: the balancer
    checks requests with it before they enter the mesh."""
    import xgrammar as xgr

    kind, source = spec.kind, spec.source
    whitespace = {"any_whitespace": spec.any_whitespace, "max_whitespace_cnt": MAX_WHITESPACE if spec.any_whitespace else None}
    try:
        if kind == "json":
            schema = _parse_json(source, "json schema")
            if not isinstance(schema, dict):
                raise ValueError(f"json schema must be a JSON object, got {type(schema).__name__}")
            check_schema_keywords(schema)
            return _json_safe(xgr.Grammar.from_json_schema(source, strict_mode=True, **whitespace))
        if kind == "json_object":
            return _json_safe(xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **whitespace))
        if kind == "regex":
            return xgr.Grammar.from_regex(source)
        if kind == "choice":
            options = _parse_json(source, "choice")
            if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
                raise ValueError("choice must be a non-empty list of strings")
            # Each option as an EBNF string literal; a JSON string's escapes are xgrammar's too.
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(o) for o in options))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(source)
        _parse_json(source, "structural_tag")
        return xgr.Grammar.from_structural_tag(source)
    except RuntimeError as exc:  # xgrammar's parse errors (InvalidStructuralTagError is one too)
        raise ValueError(f"invalid {_what(kind)}: {native_message(exc)}") from None


def _json_safe(grammar: "xgrammar.Grammar") -> "xgrammar.Grammar":
    r"""xgrammar 0.2.9 writes a string with minLength/maxLength as characters
    [^"\\\r\n], which lets control characters through that JSON (RFC 8259) forbids
    unescaped (json.loads refuses them): the class is narrowed to [^\0-\x1f"\\], the
    one its unbounded strings use, and the grammar re-read from its EBNF."""
    import xgrammar as xgr

    text = str(grammar)
    if _LOOSE_CHARACTER not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARACTER, _JSON_CHARACTER))


def check_schema_keywords(schema: Any, path: str = "#") -> None:
    """ValueError at the first keyword of UNSUPPORTED_KEYWORDS (or an allOf of several
    schemas, which xgrammar only approximates), with its JSON pointer."""
    if not isinstance(schema, dict):
        return
    for word in UNSUPPORTED_KEYWORDS.intersection(schema):
        raise ValueError(f"json schema keyword {word!r} at {path} is not supported by structured outputs")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise ValueError(f"json schema keyword 'allOf' with several schemas at {path} is not supported")
    for sub_path, sub in _subschemas(schema, path):
        check_schema_keywords(sub, sub_path)


def _subschemas(schema: dict[str, Any], path: str) -> Iterator[tuple[str, Any]]:
    for name in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(name), dict):
            for key, sub in schema[name].items():
                yield f"{path}/{name}/{key}", sub
    for name in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(name), list):
            for i, sub in enumerate(schema[name]):
                yield f"{path}/{name}/{i}", sub
    for name in _SUBSCHEMA_ONE:
        if name in schema:
            yield f"{path}/{name}", schema[name]


def native_message(exc: BaseException) -> str:
    """xgrammar's message without the C++ file, line and check expression in front."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _NATIVE_PREFIX.sub("", first)


def _what(kind: str) -> str:
    return {"json": "json schema", "json_object": "json_object", "grammar": "grammar (EBNF)"}.get(kind, kind)


def _parse_json(source: str, what: str) -> Any:
    try:
        return json.loads(source)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None


class GrammarCompiler:
    """Compiles specs over one model's vocabulary; an LRU of compiled grammars keyed by
    the spec's content hash (a repeated schema is compiled once). Thread-safe: the
    engine's compile pool (compile_pool.py) compiles on its thread, the runner reads the cache."""

    def __init__(
        self,
        tokenizer: "Tokenizer",
        vocab_size: int,
        stop_token_ids: Iterable[int],
        special_token_ids: Iterable[int],
        max_entries: int = 256,
    ) -> None:
        """vocab_size: the model's (the logits' width), which may exceed the tokenizer's:
        the ids past the tokenizer are never allowed. stop_token_ids: what ends a
        request (the engine's EOS ids), the only tokens allowed once the grammar is
        complete. special_token_ids: never allowed inside the output (the detokenizer
        drops them, so text built of them would not be the text the grammar accepted)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._special = frozenset(special_token_ids)
        self.max_entries = max_entries
        self.stats = CacheStats()
        self._cache: OrderedDict[str, "xgrammar.CompiledGrammar"] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: "xgrammar.GrammarCompiler | None" = None

    def compile(self, spec: StructuredSpec) -> "xgrammar.CompiledGrammar":
        """The compiled grammar of spec (from the cache when seen before); ValueError if invalid."""
        compiled = self.cached(spec)
        return compiled if compiled is not None else self.compile_built(spec, build_grammar(spec))

    def cached(self, spec: StructuredSpec) -> "xgrammar.CompiledGrammar | None":
        """The compiled grammar of spec if the cache holds it (a hit), else None."""
        with self._lock:
            compiled = self._cache.get(spec.key)
            if compiled is not None:
                self._cache.move_to_end(spec.key)
                self.stats.num_hits += 1
            return compiled

    def compile_built(self, spec: StructuredSpec, grammar: "xgrammar.Grammar") -> "xgrammar.CompiledGrammar":
        """Compile spec's already built grammar and cache it. The lock is not held while
        xgrammar compiles (seconds over a large vocabulary): a compile on the pool's
        thread must not stall the engine thread's look-ups of grammars already cached."""
        with self._lock:
            self.stats.num_misses += 1
            xgr_compiler = self._xgrammar_compiler()
        compiled = xgr_compiler.compile_grammar(grammar)
        with self._lock:
            self._cache[spec.key] = compiled
            self._cache.move_to_end(spec.key)
            if len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled

    def _xgrammar_compiler(self) -> "xgrammar.GrammarCompiler":
        if self._compiler is None:
            import xgrammar as xgr

            vocab = self._tokenizer.get_vocab(with_added_tokens=True)
            # The tokenizer's raw strings (byte-level "Ġ" and all); xgrammar decodes them by
            # the vocab type it detects from tokenizer.json. An empty string marks a token
            # xgrammar must never allow as text: the special ones.
            encoded = [""] * max(self.vocab_size, max(vocab.values()) + 1)
            for token, token_id in vocab.items():
                encoded[token_id] = "" if token_id in self._special else token
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(self._tokenizer.to_str())
            info = xgr.TokenizerInfo(
                encoded[: self.vocab_size],
                meta["vocab_type"],
                vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids,
                add_prefix_space=meta["add_prefix_space"],
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler
