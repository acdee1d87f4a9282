"""Speculative decoding's engine side: which requests draft, how many drafted
tokens each step verifies, and what verification taught (calibration, metrics).

Before each step the engine hands the running requests to `propose`: each one
that decodes with its last token on the host gets a draft from the drafter (prompt
lookup or the draft model, behind one interface), its confidences calibrated from
the acceptance observed so far, and a verification length: all of it ("fixed"),
or DSpark's Algorithm 1 over the batch ("dspark", schedule.py, with the SPS
profile measured at start; all of it too while the first observations come in). Requests whose sampling reads the output history
(penalties, min_tokens, bad words) or that ask for logprobs decode normally that
step, and each such fallback is counted by reason.
"""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from shared.engine.request import Request
from shared.engine.spec.calibration import AcceptanceByPosition, SequentialTemperatureScaling
from shared.engine.spec.drafter import Draft, PromptLookupDrafter
from shared.engine.spec.schedule import SpsTable, schedule_greedy

REFIT_EVERY = 32
"""Verified drafts between two calibration fits (a fit costs a grid search)."""
WARMUP_VERIFICATIONS = REFIT_EVERY
"""The dspark schedule verifies every drafted token until this many verifications
were observed and the confidences fitted once: uncalibrated scores (a draft model's
raw probabilities may be far from its acceptance) would otherwise verify nothing,
and nothing would ever be learnt."""


class BatchDrafter(Protocol):
    has_scores: bool
    """Whether drafts carry the drafter's own probabilities (draft_probs) to calibrate."""

    def propose(self, contexts: dict[str, Sequence[int]], max_tokens: int) -> dict[str, Draft]: ...

    def forget(self, request_id: str) -> None: ...


@dataclass
class NgramDrafter:
    """Prompt lookup for a batch (no weights, no state per request)."""

    lookup: PromptLookupDrafter = field(default_factory=PromptLookupDrafter)
    has_scores = False

    def propose(self, contexts: dict[str, Sequence[int]], max_tokens: int) -> dict[str, Draft]:
        drafts = {rid: self.lookup.propose(context, max_tokens) for rid, context in contexts.items()}
        return {rid: d for rid, d in drafts.items() if d.tokens}

    def forget(self, request_id: str) -> None:
        pass


@dataclass
class SpecStats:
    """Counts since start (EngineLoad carries them)."""

    num_drafted_tokens: int = 0
    """Drafted tokens verified."""
    num_accepted_tokens: int = 0
    num_verifications: int = 0
    """(request, step) pairs that verified at least one drafted token."""
    accepted_by_position: list[int] = field(default_factory=list)
    """[k]: verifications whose drafted token k + 1 passed."""
    fallbacks: Counter[str] = field(default_factory=Counter)
    """Requests (or steps, for async_scheduling / cuda_graphs) that decoded without
    speculation, by reason."""

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: accepted drafted tokens plus the bonus or correction."""
        if not self.num_verifications:
            return 0.0
        return (self.num_accepted_tokens + self.num_verifications) / self.num_verifications


class Speculator:
    def __init__(self, drafter: BatchDrafter, num_tokens: int, schedule: str, sps: SpsTable | None = None) -> None:
        if schedule == "dspark" and sps is None:
            raise ValueError("the dspark schedule needs an SPS table")
        self.drafter = drafter
        self.num_tokens = num_tokens
        self.schedule = schedule
        self.sps = sps
        self.stats = SpecStats(accepted_by_position=[0] * num_tokens)
        self.rates = AcceptanceByPosition(num_tokens)
        self.temperature = SequentialTemperatureScaling(num_tokens, max_observations=512)
        self._scores: dict[str, tuple[float, ...]] = {}
        """Per request, the raw scores of the draft proposed for the coming step."""
        self._since_fit = 0

    def propose(self, running: Sequence[Request]) -> None:
        """Set spec_token_ids on the running requests that draft this step."""
        contexts: dict[str, Sequence[int]] = {}
        decoding = [r for r in running if _decoding(r)]
        for request in decoding:
            reason = _fallback_reason(request)
            if reason is not None:
                self.stats.fallbacks[reason] += 1
            elif _room(request) >= 2:
                contexts[request.request_id] = request.all_token_ids
        drafts = self.drafter.propose(contexts, self.num_tokens) if contexts else {}
        confidences = {rid: self._confidences(d) for rid, d in drafts.items()}
        if self.schedule == "dspark" and self.stats.num_verifications >= WARMUP_VERIFICATIONS:
            assert self.sps is not None
            survivals = [_survival(confidences.get(r.request_id, ())) for r in decoding]
            lengths = dict(zip((r.request_id for r in decoding), schedule_greedy(survivals, self.sps)))
        else:
            lengths = {rid: len(d.tokens) for rid, d in drafts.items()}
        self._scores = {}
        for request in decoding:
            draft = drafts.get(request.request_id)
            n = lengths.get(request.request_id, 0)
            request.spec_token_ids = list(draft.tokens[:n]) if draft is not None and n else []
            if draft is not None and n:
                self._scores[request.request_id] = (draft.draft_probs or draft.confidences)[:n]

    def observe(self, request_id: str, num_verified: int, num_accepted: int) -> None:
        """A step verified num_verified drafted tokens of the request; num_accepted passed."""
        self.stats.num_verifications += 1
        self.stats.num_drafted_tokens += num_verified
        self.stats.num_accepted_tokens += num_accepted
        for k in range(num_accepted):
            self.stats.accepted_by_position[k] += 1
        self.rates.observe(num_verified, num_accepted)
        scores = self._scores.get(request_id)
        if self.drafter.has_scores and scores is not None:
            self.temperature.observe(scores[:num_verified], num_accepted)
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self._since_fit = 0
            if self.drafter.has_scores:
                self.temperature.fit()

    def count_fallback(self, reason: str) -> None:
        self.stats.fallbacks[reason] += 1

    def forget(self, request_id: str) -> None:
        self._scores.pop(request_id, None)
        self.drafter.forget(request_id)

    def _confidences(self, draft: Draft) -> tuple[float, ...]:
        """c_k calibrated from observed acceptance: the draft model's probabilities through
        the fitted temperatures; prompt lookup's by the acceptance rate of each position."""
        if self.drafter.has_scores and draft.draft_probs is not None:
            return tuple(self.temperature.confidences(draft.draft_probs))
        rates = self.rates.rates()
        return tuple(rates[k] for k in range(len(draft.tokens)))


def _decoding(request: Request) -> bool:
    """A request whose next step computes just its last token, known on the host."""
    return (
        request.num_output_tokens > 0
        and not request.num_pending_tokens
        and request.num_computed_tokens == request.num_tokens - 1
    )


def _room(request: Request) -> int:
    return request.sampling_params.max_tokens - request.num_output_tokens


def _fallback_reason(request: Request) -> str | None:
    params = request.sampling_params
    if params.needs_output_history:
        return "penalties"
    if params.logprobs is not None:
        return "logprobs"
    return None


def _survival(confidences: Sequence[float]) -> list[float]:
    out, a = [], 1.0
    for c in confidences:
        a *= c
        out.append(a)
    return out
