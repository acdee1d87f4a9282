"""`<think>reasoning</think>content`: Qwen3's, DeepSeek-R1's, V3.1's and V4's thinking.

One block at most, at the start of the reply: text before `<think>` is content
(there is normally none), the block's text reasoning, everything after
`</think>` content, even a later `<think>`. Where the prompt already opened the
block (a template that ends the generation prompt with `<think>`, as DeepSeek-R1's
and V4's thinking mode do), the reply starts inside it and holds only the end tag.
A reply cut off inside the block (max_tokens) is all reasoning, streamed or not.
The tags are split exactly: reasoning and content are the text between them, as
written (whitespace kept), never the tags.
"""

from services.balancer.frontend.reasoning_parsers.base import ReasoningPiece, ReasoningSplitter
from services.balancer.frontend.tool_parsers.base import partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether the prompt ends inside a thinking block (its last tag is an open one)."""
    return prompt_tail.rfind(THINK_START) > prompt_tail.rfind(THINK_END)


class ThinkSplitter(ReasoningSplitter):
    def __init__(self, inside: bool = False) -> None:
        super().__init__()
        self._state = "inside" if inside else "before"
        """before: no block yet; inside: in the block; after: the block is closed."""
        self._opened = inside

    def feed(self, text: str) -> ReasoningPiece:
        piece = ReasoningPiece()
        buf = self._take(text)
        while buf:
            if self._state == "after":
                piece.content += buf
                break
            tag = THINK_START if self._state == "before" else THINK_END
            at = buf.find(tag)
            if at < 0:
                keep = partial_suffix(buf, tag)
                self._out(piece, buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                break
            self._out(piece, buf[:at])
            buf = self._advance(buf, at + len(tag))
            self._state = "inside" if self._state == "before" else "after"
            self._opened = True
        return piece

    def finish(self) -> ReasoningPiece:
        piece = ReasoningPiece()
        self._out(piece, self._take(""))
        return piece

    def _out(self, piece: ReasoningPiece, text: str) -> None:
        if self._state == "inside":
            self._reason(piece, text)
        else:
            piece.content += text
