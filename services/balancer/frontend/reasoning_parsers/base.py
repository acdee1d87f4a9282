"""A reply's text split into reasoning and content, whole or as it streams.

A splitter is fed the reply's text in pieces (tokens' text, however the tags fall
across them) and gives back what is now known to be reasoning and what content;
a possible tag's start is held back until the next piece decides it, so the split
is exact wherever the stream cuts. finish() gives back what was held.
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

    def feed(self, text: str) -> ReasoningPiece:
        raise NotImplementedError

    def finish(self) -> ReasoningPiece:
        raise NotImplementedError

    @property
    def saw_reasoning(self) -> bool:
        """Whether the reply opened a reasoning part (its reasoning is then "" rather than absent)."""
        return self._opened

    def _take(self, text: str) -> str:
        """What was held back, then text; nothing is held any more."""
        buf, self._held = self._held + text, ""
        return buf
