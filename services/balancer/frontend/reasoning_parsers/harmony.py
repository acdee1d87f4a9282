"""GPT-OSS's reasoning: harmony's analysis channel (tool_parsers/harmony.py has the format).

The reply is messages, `<|channel|>NAME<|message|>BODY<|end|>` and the next
`<|start|>assistant<|channel|>...`: analysis bodies are the reasoning, the other
messages' bodies (final, and commentary to no one) the content. With tools, the
content is the other messages as written (markers and headers kept), for the harmony
tool parser to read their calls; without, their bodies alone. Output that is not
harmony (no header where one must be) is content, its markers removed.
"""

from services.balancer.frontend.reasoning_parsers.base import ReasoningPiece, ReasoningSplitter
from services.balancer.frontend.tool_parsers.base import partial_suffix
from services.balancer.frontend.tool_parsers.harmony import (
    ENDS,
    HEADER,
    MARKERS,
    MESSAGE,
    could_be_header,
    without_markers,
)

ANALYSIS = "analysis"


class HarmonySplitter(ReasoningSplitter):
    keeps_special_tokens = True

    def __init__(self, raw: bool = False) -> None:
        super().__init__()
        self.raw = raw
        """Keep the content's messages as written (for the tool parser)."""
        self._state = "header"
        """header, body (of self._channel's message) or plain (not harmony)."""
        self._channel = ""

    def feed(self, text: str) -> ReasoningPiece:
        piece = ReasoningPiece()
        buf = self._take(text)
        while buf:
            if self._state == "plain":
                # A marker split across pieces is held until it can be removed whole.
                keep = 0 if self.raw else max(partial_suffix(buf, marker) for marker in MARKERS)
                piece.content += buf if self.raw else without_markers(buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                break
            if self._state == "header":
                at = buf.find(MESSAGE)
                header = HEADER.match(buf[:at]) if at >= 0 else None
                if at >= 0 and header is not None and header.end() == at:
                    self._channel = header.group("channel")
                    self._opened = self._opened or self._channel == ANALYSIS
                    if self.raw and self._channel != ANALYSIS:
                        piece.content += buf[: at + len(MESSAGE)]
                    buf, self._state = self._advance(buf, at + len(MESSAGE)), "body"
                elif at < 0 and could_be_header(buf):
                    self._held = buf
                    break
                else:
                    self._state = "plain"
                continue
            ends = [(buf.find(end), end) for end in ENDS if end in buf]
            if not ends:
                keep = max(partial_suffix(buf, end) for end in ENDS)
                self._body(piece, buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                break
            at, end = min(ends)
            self._body(piece, buf[:at])
            if self.raw and self._channel != ANALYSIS:
                piece.content += end
            buf, self._state = self._advance(buf, at + len(end)), "header"
        return piece

    def finish(self) -> ReasoningPiece:
        piece = ReasoningPiece()
        held = self._take("")
        if self._state == "body":
            self._body(piece, held)
        else:
            piece.content += held if self.raw else without_markers(held)
        return piece

    def _body(self, piece: ReasoningPiece, text: str) -> None:
        if self._channel == ANALYSIS:
            self._reason(piece, text)
        else:
            piece.content += text
