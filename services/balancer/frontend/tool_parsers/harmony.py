"""GPT-OSS's tool calls, in OpenAI's harmony format (vLLM's parser name: openai).

After the prompt's `<|start|>assistant` the model writes messages, each a header,
`<|message|>`, a body and an end token:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

or, answering, `<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>`.
The header names the channel and, for a call, the recipient `to=functions.NAME`
(before or after the channel: the chat template writes it before, the model after).

  * a message to `functions.NAME` is a call, its body the arguments (a JSON object);
  * final and commentary messages to no one are content;
  * analysis messages are the model's reasoning: not content, dropped here
    (reasoning_parsers/harmony.py returns them, splitting them off first);
  * output that is not harmony at all (a header that cannot be one) is content,
    the harmony tokens removed, as skip_special_tokens would have left it.

The markers are special tokens, so the detokenizer must keep them for this parser
(keeps_special_tokens); a call whose body is not a JSON object is given back as
content in a whole parse (a stream keeps what it sent, as base.py says).
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

START = "<|start|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, MESSAGE, CHANNEL, "<|constrain|>", *ENDS)
FUNCTIONS = "functions."
MAX_HEADER_CHARS = 256
"""A header longer than this is not one: the text is plain content."""

# What a header may start with: the next message's start token, its role, the recipient, the channel.
_HEADER_STARTS = (START, "assistant", " to=", "to=", CHANNEL)
HEADER = re.compile(
    r"(?:<\|start\|>)?(?:assistant)?\s*(?:to=(?P<to1>[^\s<]+)\s*)?<\|channel\|>(?P<channel>[A-Za-z_]+)"
    r"\s*(?:to=(?P<to2>[^\s<]+)\s*)?(?:<\|constrain\|>)?\s*(?:[A-Za-z_]+)?\s*"
)


def _held(text: str, final: bool) -> int:
    """How many of text's last characters could start a marker (held back in a stream)."""
    return 0 if final else max(partial_suffix(text, marker) for marker in MARKERS)


def could_be_header(text: str) -> bool:
    if len(text) > MAX_HEADER_CHARS:
        return False
    return any(text.startswith(s) or s.startswith(text) for s in _HEADER_STARTS)


def without_markers(text: str) -> str:
    for marker in MARKERS:
        text = text.replace(marker, "")
    return text


class HarmonyParser(StreamingParser):
    keeps_special_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self._pos = 0
        """Text before this is read."""
        self._mode = "header"
        """header: reading a message's header; body: its body; plain: not harmony, all content."""
        self._kind = "drop"
        """The body's destination: content, call or drop (reasoning)."""
        self._name = ""
        self._body_start = 0
        self._sent = 0
        """Of the call's arguments (its body, whitespace at both ends dropped): how much went out."""
        self._started = False
        """The call's id and name went out."""

    def advance(self, final: bool) -> StreamPiece:
        out = StreamPiece()
        while True:
            if self._mode == "plain":
                end = len(self.text) - _held(self.text[self._pos :], final)
                out.content += self.strip.feed(without_markers(self.text[self._pos : end]))
                self._pos = end
                return out
            if self._mode == "header" and not self._read_header(final):
                return out
            if self._mode == "body" and not self._read_body(out, final):
                return out

    def _read_header(self, final: bool) -> bool:
        """Whether a header was read (else wait for more, or the mode is plain now)."""
        at = self.text.find(MESSAGE, self._pos)
        head = self.text[self._pos : at if at >= 0 else len(self.text)]
        if at < 0:
            if final and head.strip():
                self._mode = "plain"  # the output ended inside a header: not harmony
                return True
            if not final and not could_be_header(head):
                self._mode = "plain"
                return True
            return False
        match = HEADER.fullmatch(head)
        if match is None:
            self._mode = "plain"
            return True
        recipient = match.group("to1") or match.group("to2")
        if recipient is not None and recipient.startswith(FUNCTIONS) and len(recipient) > len(FUNCTIONS):
            self._kind, self._name = "call", recipient[len(FUNCTIONS) :]
        elif recipient is None and match.group("channel") in ("final", "commentary"):
            self._kind = "content"
        else:
            self._kind = "drop"  # reasoning, or a built-in tool (browser, python) that is not the client's
        self._mode, self._pos = "body", at + len(MESSAGE)
        self._body_start, self._sent, self._started = self._pos, 0, False
        return True

    def _read_body(self, out: StreamPiece, final: bool) -> bool:
        """Whether the body ended (its end token or the output's end)."""
        ends = [(i, marker) for marker in (*ENDS, START) if (i := self.text.find(marker, self._pos)) >= 0]
        if not ends and not final:
            end = len(self.text) - _held(self.text[self._pos :], final)
            self._emit(out, self.text[self._body_start : end], done=False)
            self._pos = end
            return False
        stop, marker = min(ends) if ends else (len(self.text), "")
        self._emit(out, self.text[self._body_start : stop], done=True)
        self._pos = stop + (len(marker) if marker != START else 0)  # a start token opens the next header
        self._mode = "header"
        return stop < len(self.text)

    def _emit(self, out: StreamPiece, body: str, done: bool) -> None:
        if self._kind == "content":
            out.content += self.strip.feed(body[self._sent :])
            self._sent = len(body)
            return
        if self._kind != "call":
            return
        arguments = body.strip() if done else body.lstrip().rstrip()  # trailing space may still be inside
        if done and not self._started and not _is_object(arguments):
            out.content += self.strip.feed(body)  # a broken call, nothing of it sent: its text is content
            return
        if not self._started and (arguments or done):
            self._started = True
            out.calls.append(ToolCallDelta(self.num_calls, "", id=new_call_id(), name=self._name))
        if len(arguments) > self._sent:
            out.calls.append(ToolCallDelta(self.num_calls, arguments[self._sent :]))
            self._sent = len(arguments)
        if done:
            self.num_calls += 1


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
