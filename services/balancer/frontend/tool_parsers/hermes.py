"""Hermes' tool calls, which Qwen 2.5/3 and Hermes 2/3 templates ask for and the
balancer's own tool prompt (tool_prompt.py) asks for too:

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": ..., "arguments": ...}
    </tool_call>

Any number of calls, text around them is content. A last call whose closing tag
never came (the model stopped right after its JSON) still counts when its JSON is
whole; a block whose JSON is not a call is given back as content, tags and all.
"""

from services.balancer.frontend.tool_parsers.base import CallStream, StreamingParser, StreamPiece, partial_suffix

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesParser(StreamingParser):
    def __init__(self) -> None:
        super().__init__()
        self._pos = 0
        """Text before this went out (as content or as a call)."""
        self._call: CallStream | None = None
        """The call being read; its body starts after the open tag at _pos."""

    def advance(self, final: bool) -> StreamPiece:
        out = StreamPiece()
        text = self.text
        while True:
            if self._call is None:
                start = text.find(OPEN, self._pos)
                if start < 0:
                    # Hold back what may be the start of a tag, so the tag never leaks as content.
                    end = len(text) - (0 if final else partial_suffix(text[self._pos :], OPEN))
                    out.content += self.strip.feed(text[self._pos : end])
                    self._pos = end
                    return out
                out.content += self.strip.feed(text[self._pos : start])
                self._pos = start
                self._call = CallStream(self.num_calls)
            body_start = self._pos + len(OPEN)
            close = text.find(CLOSE, body_start)
            if close < 0 and not final:
                body = text[body_start:]  # less what may be the start of the closing tag
                out.calls += self._call.update(body[: len(body) - partial_suffix(body, CLOSE)])
                return out
            body_end = close if close >= 0 else len(text)
            after = close + len(CLOSE) if close >= 0 else len(text)
            deltas, is_call = self._call.finish(text[body_start:body_end])
            if is_call:
                out.calls += deltas
                self.num_calls += 1
            else:
                out.content += self.strip.feed(text[self._pos : after])
            self._call = None
            self._pos = after
            if close < 0:
                return out
