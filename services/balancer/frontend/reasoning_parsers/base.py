"""A reply's text split into reasoning and content, whole or as it streams.

A splitter is fed the reply's text in pieces (tokens' text, however the tags fall
across them) and gives back what is now known to be reasoning and what content;
a possible tag's start is held back until the next piece decides it, so the split
is exact wherever the stream cuts. finish() gives back what was held.

The splitter also records where in the reply the reasoning lies (reasoning_spans,
character offsets), so its tokens can be counted exactly (count.py).
"""

from dataclasses import dataclass


@dataclass(slots=True)
class ReasoningPiece:
    reasoning: str = ""
    content: str = ""

    def add(self, other: "ReasoningPiece") -> None:
        self.reasoning += other.reasoning
        self.content += other.content


class ReasoningSplitter:
    """One reply's splitter (a new one per choice). Subclasses keep text that may be a
    tag's start in _held (fed again with the next piece: _take) and set _opened when
    the reply opens a reasoning part."""

    keeps_special_tokens = False
    """Whether the format is made of special tokens (the detokenizer must keep them)."""

    def __init__(self) -> None:
        self._held = ""
        self._opened = False
        self._num_fed = 0
        """Characters of the reply fed so far."""
        self._at = 0
        """Where in the reply the text being split starts (what _take returned, less
        what _advance has passed over since)."""
        self.reasoning_spans: list[tuple[int, int]] = []
        """The reasoning's [start, end) character ranges in the reply, in order, disjoint."""

    def feed(self, text: str) -> ReasoningPiece:
        raise NotImplementedError

    def finish(self) -> ReasoningPiece:
        raise NotImplementedError

    @property
    def saw_reasoning(self) -> bool:
        """Whether the reply opened a reasoning part (its reasoning is then "" rather than absent)."""
        return self._opened

    @property
    def num_decided(self) -> int:
        """The reply's first characters split for good (all but what is held back)."""
        return self._num_fed - len(self._held)

    def _take(self, text: str) -> str:
        """What was held back, then text; nothing is held any more."""
        self._at = self.num_decided
        self._num_fed += len(text)
        buf, self._held = self._held + text, ""
        return buf

    def _advance(self, buf: str, num_chars: int) -> str:
        """buf past its first num_chars (split already, or a tag)."""
        self._at += num_chars
        return buf[num_chars:]

    def _reason(self, piece: ReasoningPiece, text: str) -> None:
        """text, which starts the text being split, is reasoning."""
        piece.reasoning += text
        if not text:
            return
        end = self._at + len(text)
        if self.reasoning_spans and self.reasoning_spans[-1][1] == self._at:
            self.reasoning_spans[-1] = (self.reasoning_spans[-1][0], end)
        else:
            self.reasoning_spans.append((self._at, end))
