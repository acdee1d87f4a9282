"""One request's position in its grammar: an xgrammar GrammarMatcher kept in step with
the request's output tokens, and the token bitmasks it allows next.

The matcher follows the output lazily: before each mask it accepts the tokens the
output gained since the last one. So a matcher made for a request handed over from
prefill, or migrated mid-stream, is rebuilt by the same call that advances it every
step: it replays the output it is given.
"""

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar

log = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row (xgrammar's layout: bit j of word i is token 32 i + j)."""
    return (vocab_size + 31) // 32


@dataclass(slots=True)
class GrammarState:
    matcher: "xgrammar.GrammarMatcher"
    stop_token_ids: list[int]
    num_consumed: int = 0
    """Output tokens the matcher has accepted."""
    broken: bool = field(default=False)
    """A token the grammar refuses reached the output (it cannot, unless the output came
    from a sampler that did not apply this grammar): from then on only stop tokens are
    allowed, so the request ends instead of going on unconstrained."""

    @classmethod
    def create(cls, compiled: "xgrammar.CompiledGrammar", stop_token_ids: list[int]) -> "GrammarState":
        import xgrammar as xgr

        return cls(xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None), stop_token_ids)

    def sync(self, output_token_ids: list[int]) -> None:
        """Accept the output tokens the matcher has not seen yet."""
        while self.num_consumed < len(output_token_ids) and not self.broken:
            token = output_token_ids[self.num_consumed]
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                log.error("structured output: token %d at output position %d breaks the grammar", token, self.num_consumed)
                self.broken = True
            self.num_consumed += 1
        self.num_consumed = max(self.num_consumed, len(output_token_ids))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (int32, on the host)."""
        if self.broken or self.matcher.is_terminated():
            # Complete (the stop token accepted: an engine that ignores EOS goes on): stop tokens only.
            allow_only(bitmask, row, self.stop_token_ids)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_draft(self, draft: list[int], bitmask: torch.Tensor) -> None:
        """Rows 0..len(draft) of bitmask: what the grammar allows after the output and the
        first i drafted tokens, for verification. The matcher walks the draft and is rolled
        back to where it was; past the first drafted token the grammar refuses, the rows
        repeat that refusal's mask (verification stops there: the token cannot pass)."""
        walked = 0
        for i in range(len(draft) + 1):
            self.fill(bitmask, i)
            if i == len(draft):
                break
            if self.broken or self.matcher.is_terminated() or not self.matcher.accept_token(draft[i]):
                bitmask[i + 1 :] = bitmask[i]
                break
            walked += 1
        if walked:
            self.matcher.rollback(walked)


def allow_only(bitmask: torch.Tensor, row: int, token_ids: list[int]) -> None:
    """bitmask[row] allows exactly token_ids."""
    words = [0] * bitmask.shape[1]
    for t in token_ids:
        if t // 32 < len(words):
            words[t // 32] |= 1 << (t % 32)
    # Bit 31 set reads as a negative int32.
    bitmask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
