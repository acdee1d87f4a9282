"""Tool calls written as bare JSON objects one after another: Llama 3.1/3.2/3.3's
format, and the array that tool_choice "required" constrains the output to.

Llama 3 (vLLM's llama3_json): the reply is the calls, optionally after the
<|python_tag|> token, separated by ";" —

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

A reply that does not start with a JSON object is content. "required"
(tool_schema.py): `[{"name": ..., "arguments": {...}}, ...]`. In both, the
calls end at the first text that is not a call, which is content from there on.
"""

import json

from services.balancer.frontend.tool_parsers.base import CallStream, StreamingParser, StreamPiece

_DECODER = json.JSONDecoder()
PYTHON_TAG = "<|python_tag|>"


class JsonCallsParser(StreamingParser):
    def __init__(self, opener: str, opener_required: bool, separators: str, closer: str | None) -> None:
        super().__init__()
        self.opener = opener
        self.opener_required = opener_required
        self.separators = separators
        self.closer = closer
        self._mode = "start"
        """start: before the opener; calls: reading objects; content: the rest is content."""
        self._pos = 0
        self._call = CallStream(0)

    def advance(self, final: bool) -> StreamPiece:
        out = StreamPiece()
        text = self.text
        if self._mode == "start":
            start = len(text) - len(text.lstrip())
            head = text[start:]
            if not final and len(head) < len(self.opener) and self.opener.startswith(head):
                return out  # may still become the opener: hold it
            if head.startswith(self.opener):
                self._mode, self._pos = "calls", start + len(self.opener)
            else:
                self._mode, self._pos = ("content" if self.opener_required else "calls"), start
        if self._mode == "calls":
            self._read_calls(out, final)
        if self._mode == "content":
            out.content += self.strip.feed(text[self._pos :])
            self._pos = len(text)
        return out

    def _read_calls(self, out: StreamPiece, final: bool) -> None:
        text = self.text
        while True:
            at = self._pos
            while at < len(text) and text[at] in self.separators:
                at += 1
            if at == len(text):
                return  # nothing but separators yet (at the end: no content either)
            if self.closer is not None and text.startswith(self.closer, at):
                self._mode, self._pos = "content", at + len(self.closer)
                return
            if text[at] != "{":
                self._mode, self._pos = "content", at
                return
            try:
                _, end = _DECODER.raw_decode(text, at)
            except ValueError:  # not whole yet, or broken
                if not final:
                    out.calls += self._call.update(text[at:])
                    return
                end = len(text)
            deltas, is_call = self._call.finish(text[at:end])
            if not is_call:
                self._mode, self._pos = "content", at
                return
            out.calls += deltas
            self.num_calls += 1
            self._call = CallStream(self.num_calls)
            self._pos = end


def llama3_json() -> JsonCallsParser:
    return JsonCallsParser(PYTHON_TAG, opener_required=False, separators=" \t\r\n;", closer=None)


def json_array() -> JsonCallsParser:
    """tool_choice "required": the output is an array of {"name", "arguments"} objects."""
    return JsonCallsParser("[", opener_required=True, separators=" \t\r\n,", closer="]")
