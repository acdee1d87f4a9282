"""How many of a reply's generated tokens are reasoning: usage's
completion_tokens_details.reasoning_tokens (chat) and
output_tokens_details.reasoning_tokens (/v1/responses).

A token is a reasoning token when any of its text is reasoning: the text the
splitter gives as reasoning_content, between the tags and without them. That is
vLLM's count (BaseThinkingReasoningParser.count_reasoning_tokens: the tokens
strictly between the start and end token ids, neither tag counted) wherever the
tags are single tokens, as in Qwen3's and DeepSeek's tokenizers; where a tag is
split over several tokens (the project's ChatML tokenizer), a token holding both
the tag's last characters and reasoning counts, one holding tag text only does
not. A token whose text is not whole yet (a character's first bytes) belongs to
the character it starts.

Exact whatever the deltas: the count reads each token's own text as the job's one
detokenizer decodes it (IncrementalDetokenizer.add_tokens' token_texts: before stop
strings, so text held back from the client still counts) and the splitter's
character spans, not the deltas the client got, which group tokens and hold text
back. The splitter is the count's own (splitting is a scan of text already decoded);
the detokenizing is not done twice.
"""

from services.balancer.frontend.reasoning_parsers.base import ReasoningSplitter


class ReasoningTokenCount:
    """One reply's reasoning tokens, counted as its tokens arrive (a new one per job)."""

    def __init__(self, splitter: ReasoningSplitter) -> None:
        self._splitter = splitter
        self._pending: list[tuple[int, int]] = []
        """Tokens not decided yet, as [start, end) character ranges of the reply."""
        self._num_chars = 0
        self._span = 0
        """The first of the splitter's spans a pending token may overlap."""
        self.num_tokens = 0
        """Reasoning tokens among those decided (all of them after finish)."""

    def add(self, token_texts: list[str]) -> int:
        """Take newly generated tokens, as the text each adds to the reply; the count so far."""
        self._feed(token_texts)
        self._decide(self._splitter.num_decided)
        return self.num_tokens

    def finish(self, token_texts: list[str], tail: str) -> int:
        """The reply's last tokens, then its end (tail: the text of an unfinished
        character, owned by the tokens that started it); the count."""
        self._feed(token_texts)
        if tail and self._pending:
            start, _ = self._pending[-1]
            self._pending[-1] = (start, self._num_chars + len(tail))
        self._splitter.feed(tail)
        self._num_chars += len(tail)
        self._splitter.finish()
        self._decide(self._num_chars + 1)
        return self.num_tokens

    def _feed(self, token_texts: list[str]) -> None:
        for text in token_texts:  # each token's text is its range in the reply
            self._pending.append((self._num_chars, self._num_chars + len(text)))
            self._num_chars += len(text)
            self._splitter.feed(text)

    def _decide(self, num_decided: int) -> None:
        """Count the pending tokens whose text lies in the reply's decided part."""
        spans = self._splitter.reasoning_spans
        done = 0
        for start, end in self._pending:
            end = max(end, start + 1)  # no text yet: the character it starts
            if end > num_decided:
                break
            while self._span < len(spans) and spans[self._span][1] <= start:
                self._span += 1  # spans are in order: later tokens start later still
            if self._span < len(spans) and spans[self._span][0] < end:
                self.num_tokens += 1
            done += 1
        del self._pending[:done]
