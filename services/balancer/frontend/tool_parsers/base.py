"""What every tool-call parser shares: the calls it finds, the deltas it streams, one
call's JSON object read as it arrives, and the content that surrounds the calls.

A parser reads a model's whole output (parse) or the same output in pieces
(StreamingParser.feed, then finish). Both go through the same functions, so what
a stream's deltas add up to equals the whole parse whenever the calls are well
formed: a call's arguments are the raw text the model wrote for them (its JSON
value, sliced, not re-serialized), and content is the text outside the calls
with the whitespace at its two ends dropped. A stream cannot take back a call
it has started: one whose name went out and whose JSON then breaks keeps the
arguments it streamed (a whole parse returns that call's text as content).
"""

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import ClassVar

_DECODER = json.JSONDecoder()

# `{"name": "f", "arguments": ` (Hermes, the forced formats) or `"parameters"` (Llama 3):
# the name is known, and the arguments' raw text starts right after this.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*', re.S)


def new_call_id() -> str:
    """OpenAI's shape: call_ and 24 alphanumerics."""
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments' JSON object as text."""
    id: str = field(default_factory=new_call_id)


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    """The text outside the calls, ends stripped; None when nothing is left."""
    tool_calls: list[ToolCall]


@dataclass(slots=True)
class ToolCallDelta:
    """One piece of one call, as OpenAI streams it: id and name in the call's first piece only."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class StreamPiece:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: "StreamPiece") -> None:
        self.content += other.content
        self.calls += other.calls


def read_call(body: str) -> ToolCall | None:
    """One call's JSON object ({"name": ..., "arguments" or "parameters": {...}}), or
    None when it is not one. Missing arguments are {} (Llama 3 omits empty ones)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = "arguments" if "arguments" in value else "parameters"
    arguments = value.get(key, {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], _arguments_text(body) or json.dumps(arguments, ensure_ascii=False))


def _arguments_text(body: str) -> str | None:
    """The arguments' raw text when the object starts with its name (the usual order), else None."""
    header = _HEADER.match(body)
    if header is None or not body.startswith("{", header.end()):
        return None
    try:
        _, end = _DECODER.raw_decode(body, header.end())
    except ValueError:
        return None
    return body[header.end() : end]


class CallStream:
    """One call streamed as its JSON object arrives: the name once `{"name": "...",
    "arguments": ` has been read, then the arguments' raw text piece by piece."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_call_id()
        self.started = False
        """Its name went out: the call exists for the client and cannot be taken back."""
        self._sent = 0

    def update(self, body: str) -> list[ToolCallDelta]:
        """The deltas for the object's text so far (not yet known to be complete)."""
        header = _HEADER.match(body)
        if header is None or not body.startswith("{", header.end()):
            return []  # not enough read yet, or another key order: wait for the whole object
        deltas = self._start(json.loads(f'"{header.group(1)}"'))
        value = body[header.end() :]
        try:  # an object's value is complete exactly when it decodes; until then all of it is arguments
            _, end = _DECODER.raw_decode(value)
            value = value[:end]
        except ValueError:
            pass
        if len(value) > self._sent:
            deltas.append(ToolCallDelta(self.index, value[self._sent :]))
            self._sent = len(value)
        return deltas

    def finish(self, body: str) -> tuple[list[ToolCallDelta], bool]:
        """The deltas that complete the call from its whole object, and whether it is a
        call at all (False: give its text back as content, if nothing went out yet)."""
        call = read_call(body)
        if call is None:
            return [], self.started
        deltas = self._start(call.name)
        # What went out is a prefix of the arguments' raw text (update sent only text of the value).
        rest = call.arguments[self._sent :]
        if rest:
            deltas.append(ToolCallDelta(self.index, rest))
        self._sent = len(call.arguments)
        return deltas, True

    def _start(self, name: str) -> list[ToolCallDelta]:
        if self.started:
            return []
        self.started = True
        return [ToolCallDelta(self.index, "", id=self.id, name=name)]


class ContentStrip:
    """Streams content with the whitespace at both ends dropped, as a whole parse strips it:
    leading whitespace is never sent, trailing whitespace is held until more text follows."""

    def __init__(self) -> None:
        self._held = ""
        self._any = False

    def feed(self, text: str) -> str:
        if not self._any:
            text = text.lstrip()
            if not text:
                return ""
            self._any = True
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body) :]
        return body


def join_content(parts: list[str]) -> str | None:
    return "".join(parts).strip() or None


def partial_suffix(text: str, tag: str) -> int:
    """How many of text's last characters could be the start of tag (held back in a stream)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class StreamingParser:
    """Reads one output in pieces: feed returns what may go out now, finish the rest.
    A whole output is parsed by the same code (parse_whole), never calling the
    incremental path, so a call that breaks is content there."""

    keeps_special_tokens: ClassVar[bool] = False
    """Its markers are special tokens (harmony's): the output must be detokenized with them."""

    def __init__(self) -> None:
        self.text = ""
        self.strip = ContentStrip()
        self.num_calls = 0

    def feed(self, text: str) -> StreamPiece:
        self.text += text
        return self.advance(final=False)

    def finish(self) -> StreamPiece:
        return self.advance(final=True)

    def advance(self, final: bool) -> StreamPiece:
        """What the text so far lets go out; final: the text is all there is."""
        raise NotImplementedError


def parse_whole(parser: StreamingParser, text: str) -> ParsedOutput:
    """A whole output through a fresh streaming parser, its deltas gathered into calls."""
    parser.text = text
    piece = parser.advance(final=True)
    calls: dict[int, ToolCall] = {}
    for delta in piece.calls:
        if delta.index not in calls:
            assert delta.name is not None and delta.id is not None, "a call's first delta names it"
            calls[delta.index] = ToolCall(delta.name, "", delta.id)
        calls[delta.index].arguments += delta.arguments
    return ParsedOutput(piece.content or None, [calls[i] for i in sorted(calls)])
