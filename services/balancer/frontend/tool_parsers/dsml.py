"""DeepSeek-V4's tool calls: a DSML block (DeepSeek's markup; V4's
encoding/encoding_dsv4.py writes and reads it), after any content:

    Let me look.

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

string="true" values are raw text, the others JSON. The arguments are rebuilt as
DeepSeek's decoder does, `{"city": "Paris", "days": 2}` (keys and strings by
json.dumps without ASCII escapes, other values as written), and must be a JSON object.
V3.2 named the block `function_calls`, V3/V3.1 used `<｜tool▁calls▁begin｜>` tokens
with JSON bodies: neither is read here (V4 is the family this mesh serves).

The DSML markers are plain text (several tokens each) in DeepSeek's tokenizer, so a
marker arrives in pieces: text that may start one is held back. A block read whole
(a whole parse, or a stream that got it at once) that does not parse is given back
as content, tags and all; a stream that already sent a call keeps it and reads the
rest of a broken block as content.
"""

import json
import re

from services.balancer.frontend.tool_parsers.base import (
    StreamingParser,
    StreamPiece,
    ToolCallDelta,
    new_call_id,
    partial_suffix,
)

DSML = "｜DSML｜"
OPEN = f"<{DSML}tool_calls>"
CLOSE = f"</{DSML}tool_calls>"
CLOSE_INVOKE = f"</{DSML}invoke>"
CLOSE_PARAMETER = f"</{DSML}parameter>"
_INVOKE = re.compile(rf'<{DSML}invoke\s+name="([^"<>]+)"\s*>')
_PARAMETER = re.compile(rf'<{DSML}parameter\s+name="([^"<>]+)"\s+string="(true|false)"\s*>')
_OPENINGS = (f"<{DSML}invoke", f"<{DSML}parameter")
MAX_TAG_CHARS = 512
"""An opening tag still unclosed past this many characters is broken, not slow."""


def _value_text(value: str, is_string: bool, done: bool) -> str:
    """One parameter's value in the arguments; a string's closing quote only when done."""
    if not is_string:
        return value
    quoted = json.dumps(value, ensure_ascii=False)
    return quoted if done else quoted[:-1]


def _pair_text(first: bool, key: str) -> str:
    return ("{" if first else ", ") + json.dumps(key, ensure_ascii=False) + ": "


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def parse_block(text: str, start: int) -> tuple[list[tuple[str, str]], int] | None:
    """The calls (name, arguments) of the whole block opening at start and where it
    ends, or None when it is not a well-formed block of calls."""
    at = start + len(OPEN)
    calls: list[tuple[str, str]] = []
    while True:
        at = _skip_space(text, at)
        if text.startswith(CLOSE, at):
            return calls, at + len(CLOSE)
        invoke = _INVOKE.match(text, at)
        if invoke is None:
            return None
        at, arguments, seen = invoke.end(), "", set()
        while True:
            at = _skip_space(text, at)
            if text.startswith(CLOSE_INVOKE, at):
                at += len(CLOSE_INVOKE)
                break
            parameter = _PARAMETER.match(text, at)
            if parameter is None or parameter.group(1) in seen:
                return None
            end = text.find(CLOSE_PARAMETER, parameter.end())
            if end < 0:
                return None
            seen.add(parameter.group(1))
            value = _value_text(text[parameter.end() : end], parameter.group(2) == "true", done=True)
            arguments += _pair_text(not arguments, parameter.group(1)) + value
            at = end + len(CLOSE_PARAMETER)
        arguments = arguments + "}" if arguments else "{}"
        if not _is_object(arguments):
            return None
        calls.append((invoke.group(1), arguments))


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _may_become_tag(head: str) -> bool:
    """Whether text that starts no whole tag yet may still become one."""
    if any(tag.startswith(head) for tag in (CLOSE, CLOSE_INVOKE, *_OPENINGS)):
        return True
    return head.startswith(_OPENINGS) and ">" not in head and len(head) < MAX_TAG_CHARS


class DsmlParser(StreamingParser):
    def __init__(self) -> None:
        super().__init__()
        self._pos = 0
        self._mode = "content"
        """content; block (between invokes); invoke (between parameters); value (inside one)."""
        self._arguments = ""
        """The streamed call's arguments so far (complete parameters only)."""
        self._sent = 0
        self._key = ""
        self._is_string = True
        self._block_start: int | None = None
        """Where the open block starts while none of it went out (a break gives it back as content)."""

    def advance(self, final: bool) -> StreamPiece:
        out = StreamPiece()
        while self._step(out, final):
            pass
        return out

    def _step(self, out: StreamPiece, final: bool) -> bool:
        """Read what the text allows in the current mode; whether to go on."""
        text = self.text
        if self._mode == "content":
            start = text.find(OPEN, self._pos)
            if start < 0:
                end = len(text) - (0 if final else partial_suffix(text[self._pos :], OPEN))
                out.content += self.strip.feed(text[self._pos : end])
                self._pos = end
                return False
            out.content += self.strip.feed(text[self._pos : start])
            self._pos = start
            if final or text.find(CLOSE, start) >= 0:  # the whole block is here: read it whole
                return self._whole_block(out, start)
            self._mode, self._pos, self._block_start = "block", start + len(OPEN), start
            return True
        if self._mode == "value":
            return self._read_value(out, final)
        at = _skip_space(text, self._pos)
        closer = CLOSE if self._mode == "block" else CLOSE_INVOKE
        if text.startswith(closer, at):
            if self._mode == "invoke":
                self._end_call(out)
            self._mode, self._pos = ("content" if self._mode == "block" else "block"), at + len(closer)
            return True
        tag = (_INVOKE if self._mode == "block" else _PARAMETER).match(text, at)
        if tag is None:
            if not final and _may_become_tag(text[at:]):
                return False
            if self._mode == "invoke":
                self._end_call(out)  # sent already: it keeps the arguments it has
            elif self._block_start is not None:  # nothing of the block went out: all of it is content
                out.content += self.strip.feed(text[self._block_start : at])
            self._mode, self._pos, self._block_start = "content", at, None  # broken: what is left is content
            return True
        self._pos = tag.end()
        if self._mode == "block":
            self._mode, self._arguments, self._sent, self._block_start = "invoke", "", 0, None
            out.calls.append(ToolCallDelta(self.num_calls, "", id=new_call_id(), name=tag.group(1)))
        else:
            self._mode, self._key, self._is_string = "value", tag.group(1), tag.group(2) == "true"
        return True

    def _read_value(self, out: StreamPiece, final: bool) -> bool:
        text = self.text
        end = text.find(CLOSE_PARAMETER, self._pos)
        done = end >= 0
        if not done:
            end = len(text) - (0 if final else partial_suffix(text[self._pos :], CLOSE_PARAMETER))
        value = _pair_text(not self._arguments, self._key) + _value_text(text[self._pos : end], self._is_string, done or final)
        self._send(out, self._arguments + value)
        if not done:
            if final:  # cut off inside a value: the call ends with what it has
                self._arguments += value
                self._end_call(out)
                self._mode, self._pos = "content", len(text)
            return False
        self._arguments += value
        self._mode, self._pos = "invoke", end + len(CLOSE_PARAMETER)
        return True

    def _send(self, out: StreamPiece, arguments: str) -> None:
        if len(arguments) > self._sent:
            out.calls.append(ToolCallDelta(self.num_calls, arguments[self._sent :]))
            self._sent = len(arguments)

    def _end_call(self, out: StreamPiece) -> None:
        self._send(out, self._arguments + "}" if self._arguments else "{}")
        self.num_calls += 1
        self._arguments, self._sent = "", 0

    def _whole_block(self, out: StreamPiece, start: int) -> bool:
        parsed = parse_block(self.text, start)
        if parsed is None:
            close = self.text.find(CLOSE, start)
            end = close + len(CLOSE) if close >= 0 else len(self.text)
            out.content += self.strip.feed(self.text[start:end])
            self._pos = end
            return end < len(self.text)
        calls, self._pos = parsed
        for name, arguments in calls:
            out.calls += [ToolCallDelta(self.num_calls, "", id=new_call_id(), name=name),
                          ToolCallDelta(self.num_calls, arguments)]  # fmt: skip
            self.num_calls += 1
        return True
