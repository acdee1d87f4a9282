"""What a drafter proposes, and the drafter that needs no weights: prompt lookup.

A draft is up to γ tokens for one request, each with a confidence c_k: the
drafter's estimate that position k is accepted given that positions 1..k-1 were.
Survival a_j = c_1 · ... · c_j is the chance the first j all are, which is what
the verification scheduler (schedule.py) weighs against the cost of verifying.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Draft:
    tokens: tuple[int, ...]
    confidences: tuple[float, ...]
    """c_k in [0, 1], one per token."""
    draft_probs: tuple[float, ...] | None = None
    """The drafter's probability of each proposed token (rejection sampling needs
    the whole distribution only where it samples; a deterministic drafter such as
    prompt lookup proposes with probability 1)."""

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.confidences):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.confidences)} confidences")
        if any(not 0.0 <= c <= 1.0 for c in self.confidences):
            raise ValueError(f"confidences must lie in [0, 1], got {self.confidences}")

    def survival(self) -> list[float]:
        """a_j = ∏_{i<=j} c_i for j = 1..len."""
        out, a = [], 1.0
        for c in self.confidences:
            a *= c
            out.append(a)
        return out


EMPTY = Draft((), ())


class Drafter(Protocol):
    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        """Up to max_tokens tokens to follow `context` (the prompt and output so far)."""
        ...


@dataclass
class PromptLookupDrafter:
    """Drafts by finding the context's last n tokens earlier in the context and
    proposing what followed them there (longest n first, most recent match first).
    Code and chat repeat themselves, so this often drafts well at no cost.

    The raw confidence of position k is the calibrator's estimate for that
    position (calibration.py); before any observation it is `prior`."""

    max_ngram: int = 3
    min_ngram: int = 1
    prior: float = 0.5
    position_confidence: list[float] = field(default_factory=list)
    """Calibrated acceptance per position (index k-1), set from observations; missing
    positions use `prior`."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or len(context) < 2:
            return EMPTY
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            tail = list(context[-n:])
            # The most recent earlier occurrence: scan right to left, excluding the tail itself.
            for start in range(len(context) - n - 1, -1, -1):
                if list(context[start : start + n]) == tail:
                    follow = list(context[start + n : start + n + max_tokens])
                    if follow:
                        confidences = tuple(self._confidence(k) for k in range(len(follow)))
                        return Draft(tuple(follow), confidences, tuple(1.0 for _ in follow))
        return EMPTY

    def _confidence(self, k: int) -> float:
        return self.position_confidence[k] if k < len(self.position_confidence) else self.prior
