"""Speculative decoding's engine side: which requests draft, how many drafted
tokens each step verifies, and what verification taught (calibration, metrics).

Before each step the engine hands the running requests to `propose`: each one
that decodes with its last token on the host gets a draft from the drafter (prompt
lookup, the draft model or the target's MTP head, behind one interface; the MTP head
also reads the target's hidden states, `observe_hidden`), its confidences calibrated from
the acceptance observed so far, and a verification length: all of it ("fixed"),
or DSpark's Algorithm 1 over the batch ("dspark", schedule.py, with the SPS
profile measured at start; all of it too while the first observations come in),
or its production variant ("capacity": how many to verify from survivals two
steps old, then the best of this step's). The scheduled modes also choose how
deep to draft before drafting, from the acceptance and the costs measured so far
(`StepCosts`): a drafter that costs more than it saves drafts nothing, bar a probe
now and then, and a depth not measured yet is tried, both within a small share of the
decoding time (PROBE_BUDGET). Requests with min_tokens or bad words (their sampling
reads the output history) decode normally that step, and each such fallback is
counted by reason. Requests with logprobs or penalties draft: each emitted token's
logprobs come from the target's verify row at its position, and each row's penalties
count the drafted tokens before it (verify.py).
"""

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from shared.engine.request import Request
from shared.engine.spec.calibration import AcceptanceByPosition, SequentialTemperatureScaling
from shared.engine.spec.drafter import Draft, PromptLookupDrafter
from shared.engine.spec.schedule import CapacitySchedule, SpsTable, choose_depth, schedule_greedy

if TYPE_CHECKING:  # the speculator itself runs no tensor code
    import torch

REFIT_EVERY = 32
"""Verified drafts between two calibration fits (a fit costs a grid search)."""
WARMUP_VERIFICATIONS = REFIT_EVERY
"""The dspark schedule verifies every drafted token until this many verifications
were observed and the confidences fitted once: uncalibrated scores (a draft model's
raw probabilities may be far from its acceptance) would otherwise verify nothing,
and nothing would ever be learnt."""
PROBE_EVERY = 64
"""When the schedule chose not to draft at all, draft anyway (a probe: every request
to full depth, all of it verified) at most once in this many steps, so that
acceptance and drafting cost keep being measured as traffic changes."""
PROBE_BUDGET = 0.01
"""...and only once the plain steps since the last exploring step took 1 / PROBE_BUDGET
times what that step cost. Exploring: a probe, or a trial (a depth the cost model favours
but no step has measured at this batch size yet). Where speculation does not pay,
exploring costs at most this share of the decoding time. (A probe is a whole drafting
step: on the H200 7-10 ms against 0.5-2 ms for a plain step of the trained pair; one
probe in every 64 steps cost 4-11 %.)"""
EMA = 0.1
"""Weight of the newest measurement in the running costs (drafting, step overhead)."""
PLAIN_STEP_CLIP = 1.5
"""A plain step's time counts at most this many times the running estimate (StepCosts)."""
SCHEDULED = ("dspark", "capacity")


class BatchDrafter(Protocol):
    has_scores: bool
    """Whether drafts carry the drafter's own probabilities (draft_probs) to calibrate."""

    def propose(self, contexts: dict[str, Sequence[int]], max_tokens: int) -> dict[str, Draft]: ...

    def forget(self, request_id: str) -> None: ...


@runtime_checkable
class ReadsHidden(Protocol):
    """A drafter that reads the target's final hidden states (the MTP head): the engine
    then has the runner keep them and hands each request's over after every step."""

    def observe_hidden(self, request_id: str, start_pos: int, hidden: "torch.Tensor") -> None: ...


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
    steps_by_depth: Counter[int] = field(default_factory=Counter)
    """Decode steps by the depth they drafted to (0: none, the plain fast path): where
    the schedule settled, and what its trials and probes cost."""

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: accepted drafted tokens plus the bonus or correction."""
        if not self.num_verifications:
            return 0.0
        return (self.num_accepted_tokens + self.num_verifications) / self.num_verifications


@dataclass
class StepCosts:
    """What a step costs besides the target's forward, measured as the engine runs:
    one drafting pass over R requests (by R's power of two; a draft model's pass is a
    batched forward, prompt lookup's nearly nothing) and the engine's own bookkeeping
    per step (scheduling, sampling, outputs: the whole step's time less the SPS
    profile's forward time)."""

    draft_pass_s: dict[int, float] = field(default_factory=dict)
    overhead_s: float = 0.0
    plain_step_s: dict[int, float] = field(default_factory=dict)
    """A whole step that drafts nothing, by R's power of two, on whatever path the
    engine runs it (on CUDA: graphs and overlap, which drafting steps give up)."""
    realized: dict[tuple[int, int], float] = field(default_factory=dict)
    """Output tokens per second that drafting steps really gave, by (R's power of two, depth)."""

    def realized_rates(self, num_requests: int) -> dict[int, float]:
        """Depth -> measured tokens per second of steps at this batch size's power of two."""
        key = _bucket(num_requests)
        return {depth: rate for (bucket, depth), rate in self.realized.items() if bucket == key}

    def observe_realized(self, num_requests: int, depth: int, tokens_per_s: float) -> None:
        key = (_bucket(num_requests), depth)
        old = self.realized.get(key)
        self.realized[key] = tokens_per_s if old is None else old + EMA * (tokens_per_s - old)

    def draft_pass(self, num_requests: int) -> float | None:
        """Seconds of one drafting pass over num_requests requests (the nearest size measured)."""
        return _nearest(self.draft_pass_s, num_requests)

    def plain_step(self, num_requests: int) -> float | None:
        return _nearest(self.plain_step_s, num_requests)

    def observe_drafting(self, num_requests: int, passes: int, seconds: float) -> None:
        if passes > 0 and num_requests > 0:
            _average_in(self.draft_pass_s, num_requests, seconds / passes)

    def observe_plain_step(self, num_requests: int, seconds: float) -> None:
        """A plain step's time, at most PLAIN_STEP_CLIP times the estimate so far: a stall
        (a collector pass, another process on the device) must not make drafting look
        cheap for the next dozens of steps and set off a trial that costs a catch-up."""
        if num_requests > 0:
            old = self.plain_step_s.get(_bucket(num_requests))
            _average_in(self.plain_step_s, num_requests, seconds if old is None else min(seconds, PLAIN_STEP_CLIP * old))

    def observe_overhead(self, seconds: float) -> None:
        self.overhead_s += EMA * (max(seconds, 0.0) - self.overhead_s)


class Speculator:
    def __init__(
        self, drafter: BatchDrafter, num_tokens: int, schedule: str, sps: SpsTable | None = None,
        graph_buckets: Sequence[int] = (),
    ) -> None:
        """graph_buckets: the rows the runner's CUDA graphs are captured for (the capacity
        schedule rounds a step up to one when that pays); none for eager steps."""
        if schedule in SCHEDULED and sps is None:
            raise ValueError(f"the {schedule} schedule needs an SPS table")
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
        self.costs = StepCosts()
        self.depth = num_tokens
        """Tokens drafted per request in the latest step (scheduled: chosen by choose_depth)."""
        self._since_probe = 0
        """Steps since drafting last paid or was probed."""
        self._plain_s_since_probe = 0.0
        """What those steps' plain decode steps took (seconds)."""
        self._explore_cost_s: float | None = None
        """The last measured exploring step (a probe or a trial), drafting and verification."""
        self._exploring = False
        """Whether the coming (or latest) step explores (PROBE_BUDGET)."""
        self._capacity = CapacitySchedule(sps, tuple(graph_buckets)) if sps is not None else None
        """The capacity schedule's state: the survivals of the last two steps (K comes from the older)."""
        self._drafting_s = 0.0
        self._probing = False
        self._planned: int | None = None
        """The coming step's depth, once plan() chose it (propose or skip consume it)."""

    def plan(self, running: Sequence[Request]) -> int:
        """How deep the coming step drafts (0: not at all, and the engine may take its
        fast path). Chosen once per step: until propose() or skip() consumes it."""
        if self._planned is None:
            self._probing = self._exploring = False
            scheduled = self.schedule in SCHEDULED and self.stats.num_verifications >= WARMUP_VERIFICATIONS
            if scheduled:
                # The batch's size decides first: counting the requests that may draft is a
                # pass over the batch (a tenth of a plain step's host time at batch 64), paid
                # only on the steps that would draft, not on every plain one.
                depth = self._choose_depth(len(running)) if running else 0
                if depth and not any(_will_draft(r) for r in running):
                    depth, self._probing, self._exploring = 0, False, False
                self._planned = depth
            else:
                self._planned = self.num_tokens if any(_will_draft(r) for r in running) else 0
        return self._planned

    def skip(self, running: Sequence[Request] = ()) -> None:
        """The coming step runs without drafting (plan() said 0), overlapped: the running
        requests that could not draft are counted as propose() counts them (a min_tokens
        or bad-words request runs overlapped, its masks sampled after the read-back)."""
        for request in running:
            reason = _fallback_reason(request)
            if reason is not None and _decodes_next(request):
                self.stats.fallbacks[reason] += 1
        self._planned = None
        self.depth = 0
        self._drafting_s = 0.0
        self.stats.steps_by_depth[0] += 1

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
        self.depth = self.plan(running)
        self._planned = None
        self.stats.steps_by_depth[self.depth] += 1
        scheduled = self.schedule in SCHEDULED and self.stats.num_verifications >= WARMUP_VERIFICATIONS
        scheduled = scheduled and not self._probing  # a probe verifies all it drafted: it is there to learn
        start = time.perf_counter()
        drafts = self.drafter.propose(contexts, self.depth) if contexts and self.depth else {}
        self._drafting_s = time.perf_counter() - start
        if drafts:
            self.costs.observe_drafting(len(contexts), max(len(d.tokens) for d in drafts.values()), self._drafting_s)
        if scheduled and drafts:
            assert self.sps is not None
            self._refit_if_due()
            confidences = {rid: self._confidences(d) for rid, d in drafts.items()}
            survivals = [_survival(confidences.get(r.request_id, ())) for r in decoding]
            fixed = self._drafting_s + self.costs.overhead_s
            if self.schedule == "capacity":
                assert self._capacity is not None
                chosen = self._capacity.lengths(survivals, fixed)
            else:
                chosen = schedule_greedy(survivals, self.sps, fixed)
            lengths = dict(zip((r.request_id for r in decoding), chosen))
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
        if self.drafter.has_scores and scores is not None and self.schedule in SCHEDULED:
            self.temperature.observe(scores[:num_verified], num_accepted)
        self._since_fit += 1

    def _refit_if_due(self) -> None:
        """Fit the temperatures again once REFIT_EVERY verifications came in since the
        last fit: when the schedule is about to read the confidences, so at most once a
        step (fitted per 32 observations, a batch of 64 paid two fits a step, the first
        overwritten unread). The fixed schedule reads no confidence and never fits."""
        if self._since_fit >= REFIT_EVERY:
            self._since_fit = 0
            if self.drafter.has_scores:
                self.temperature.fit()

    def step_done(self, num_requests: int, num_tokens: int, seconds: float, num_emitted: int | None = None) -> None:
        """A decode step of num_requests requests and num_tokens tokens (drafted ones
        included) took seconds from drafting to its outputs and emitted num_emitted
        tokens. Without drafts, that is what a plain step costs; with them, the tokens
        per second the depth really gave, and what the step cost beyond drafting and the
        profiled forward (the engine's overhead per step, which speculation saves by
        taking fewer steps)."""
        if num_tokens <= num_requests:
            self.costs.observe_plain_step(num_requests, seconds)
            self._plain_s_since_probe += seconds
            return
        if self._exploring:
            self._explore_cost_s = seconds
        if num_emitted and seconds > 0 and self.depth:
            self.costs.observe_realized(num_requests, self.depth, num_emitted / seconds)
        if self.sps is not None:
            self.costs.observe_overhead(seconds - self._drafting_s - 1.0 / self.sps(num_tokens))

    def _choose_depth(self, num_requests: int) -> int:
        """choose_depth from the observed survivals and costs; 0 (no drafting) only until
        the next probe is due."""
        assert self.sps is not None
        draft_pass = self.costs.draft_pass(num_requests)
        if draft_pass is None:
            return self.num_tokens
        if self.costs.plain_step(num_requests) is None:
            return 0  # one plain step first, to measure what not drafting costs at this size
        measured = self.costs.realized_rates(num_requests)
        depth = choose_depth(num_requests, self.mean_survival(), self.sps, draft_pass, self.costs.overhead_s,
                             self.costs.plain_step(num_requests), measured)  # fmt: skip
        if depth and depth in measured:  # measured to pay at this batch size: draft as chosen
            self._since_probe, self._plain_s_since_probe = 0, 0.0
            return depth
        # Otherwise the step would explore, on PROBE_BUDGET: a depth only the model favours
        # (a trial; it has a measured rate after) or, where nothing pays, a probe.
        self._since_probe += 1
        due = self._within_budget() and (depth > 0 or self._since_probe >= PROBE_EVERY)
        if not due:
            return 0
        self._since_probe, self._plain_s_since_probe = 0, 0.0
        self._exploring = True
        if depth:
            return depth
        self._probing = True
        return self.num_tokens

    def _within_budget(self) -> bool:
        """The plain steps since the last exploring step took at least its cost over
        PROBE_BUDGET (always, before the first)."""
        return self._explore_cost_s is None or self._plain_s_since_probe * PROBE_BUDGET >= self._explore_cost_s

    def mean_survival(self) -> list[float]:
        """ā_j: the observed chance that the first j drafted tokens all pass."""
        return _survival(self.rates.rates())

    def count_fallback(self, reason: str) -> None:
        self.stats.fallbacks[reason] += 1

    def forget(self, request_id: str) -> None:
        self._scores.pop(request_id, None)
        self.drafter.forget(request_id)

    @property
    def reads_hidden(self) -> bool:
        """Whether the drafter needs the target's hidden states (ModelRunner.keep_hidden)."""
        return isinstance(self.drafter, ReadsHidden)

    def observe_hidden(self, request_id: str, start_pos: int, hidden: "torch.Tensor") -> None:
        """The target's final hidden states of the request's positions start_pos on, this step."""
        if isinstance(self.drafter, ReadsHidden):
            self.drafter.observe_hidden(request_id, start_pos, hidden)

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


def _will_draft(request: Request) -> bool:
    """A request that will decode next step, once any step in flight is read back (its
    last token may still be on the device), and may draft."""
    return (
        _decodes_next(request)
        and _fallback_reason(request) is None
        and _room(request) - request.num_pending_tokens >= 2
    )


def _decodes_next(request: Request) -> bool:
    """A request that will decode next step, once any step in flight is read back."""
    return (
        request.num_output_tokens + request.num_pending_tokens > 0
        and request.num_computed_tokens + request.num_pending_tokens >= request.num_tokens - 1
    )


def _room(request: Request) -> int:
    return request.sampling_params.max_tokens - request.num_output_tokens


def _fallback_reason(request: Request) -> str | None:
    params = request.sampling_params
    if params.min_tokens > 0:
        return "min_tokens"
    if params.bad_words_token_ids:
        return "bad_words"
    return None


def _nearest(by_bucket: dict[int, float], num_requests: int) -> float | None:
    """The figure measured at the power of two nearest num_requests (None before any)."""
    if not by_bucket:
        return None
    key = _bucket(num_requests)
    return by_bucket[min(by_bucket, key=lambda b: (abs(b.bit_length() - key.bit_length()), b))]


def _average_in(by_bucket: dict[int, float], num_requests: int, seconds: float) -> None:
    key = _bucket(num_requests)
    old = by_bucket.get(key)
    by_bucket[key] = seconds if old is None else old + EMA * (seconds - old)


def _bucket(num_requests: int) -> int:
    """The power of two at or above num_requests."""
    return 1 << max(num_requests - 1, 0).bit_length()


def _survival(confidences: Sequence[float]) -> list[float]:
    out, a = [], 1.0
    for c in confidences:
        a *= c
        out.append(a)
    return out
