"""How many drafted tokens of each request to verify this step (DSpark).

A step verifying ℓ_r drafted tokens of request r computes B = Σ_r (1 + ℓ_r)
tokens and yields, in expectation, τ = Σ_r (1 + Σ_{j<=ℓ_r} a_{r,j}) tokens
(the bonus or correction token, plus each drafted token that survives). The
engine makes SPS(B) steps per second at B tokens per step, measured when it
starts (`SpsTable`), so it yields Θ = τ · SPS(B) tokens per second.

`schedule_greedy` is DSpark's Algorithm 1: start from ℓ = 0 (B = R, τ = R), pool
every (request, position) by survival, highest first, admit while Θ improves and
stop at the first candidate that does not improve it. Stopping there (rather
than skipping it and trying later ones) is what keeps verification lossless:
c_k depends on the token sampled at k-1, so the choice must not depend on the
outcome of a later, cheaper-looking position (DSpark, Appendix A).

`schedule_with_capacity` is the production variant: CUDA graphs need the step's
size before the newest confidences exist, so the number of tokens to verify, K,
is chosen from survivals two steps old (the greedy above, rounded up to a graph
bucket when that still improves Θ), and then the K best candidates of the
current step are taken. K comes only from old information, so no early stop
is needed there. `CapacitySchedule` keeps those old survivals: until two steps
have passed there are none, and it runs the greedy (Algorithm 1, early stop and all).

A drafter that costs time (a draft model, an MTP head run apart from the
target's forward) breaks DSpark's assumption that drafting is free. Two things
follow, both reducing to DSpark's rule when that cost is zero. `choose_depth`
decides, before drafting and from observed survivals, how deep to draft: Θ per
depth counts the drafting passes, and depth 0 (no drafting) wins whenever drafts
do not pay for themselves. Then the greedy weighs each candidate with the step's
fixed cost in the denominator, Θ = τ / (fixed + 1 / SPS(B)): the drafting time
already spent, and the engine's per-step bookkeeping measured as it runs.
"""

import bisect
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpsTable:
    """Steps per second against tokens per step, interpolated linearly between the
    measured points and held flat beyond them."""

    tokens: tuple[int, ...]
    steps_per_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.steps_per_s) or not self.tokens:
            raise ValueError("SpsTable needs as many rates as token counts, at least one")
        if list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError(f"token counts must increase strictly, got {self.tokens}")
        if any(s <= 0 for s in self.steps_per_s):
            raise ValueError("steps per second must be positive")

    def __call__(self, num_tokens: int) -> float:
        i = bisect.bisect_left(self.tokens, num_tokens)
        if i < len(self.tokens) and self.tokens[i] == num_tokens:
            return self.steps_per_s[i]
        if i == 0:
            return self.steps_per_s[0]
        if i == len(self.tokens):
            return self.steps_per_s[-1]
        t0, t1 = self.tokens[i - 1], self.tokens[i]
        s0, s1 = self.steps_per_s[i - 1], self.steps_per_s[i]
        return s0 + (s1 - s0) * (num_tokens - t0) / (t1 - t0)


def _candidates(survivals: Sequence[Sequence[float]]) -> list[tuple[float, int, int]]:
    """(survival, request, position) of every drafted token, best first; on ties the
    earlier position, then the earlier request (so a request's positions come in order)."""
    for r, row in enumerate(survivals):
        if any(not 0.0 <= a <= 1.0 for a in row) or any(b > a for a, b in zip(row, row[1:])):
            raise ValueError(f"request {r}: survivals must lie in [0, 1] and not increase, got {list(row)}")
    pool = [(a, r, j) for r, row in enumerate(survivals) for j, a in enumerate(row)]
    pool.sort(key=lambda c: (-c[0], c[2], c[1]))
    return pool


def step_rate(sps: SpsTable, num_tokens: int, fixed_seconds: float = 0.0) -> float:
    """Steps per second of a step of num_tokens tokens that also costs fixed_seconds
    the forward does not (drafting already done, the engine's own bookkeeping)."""
    return 1.0 / (1.0 / sps(num_tokens) + fixed_seconds)


def schedule_greedy(survivals: Sequence[Sequence[float]], sps: SpsTable, fixed_seconds: float = 0.0) -> list[int]:
    """ℓ_r per request (survivals[r][j] = a_{r,j+1}, non-increasing in j). fixed_seconds:
    the step's cost besides the forward (0: DSpark's Θ = τ · SPS(B) exactly)."""
    lengths = [0] * len(survivals)
    if not survivals:
        return lengths
    batch, tau = len(survivals), float(len(survivals))
    theta = tau * step_rate(sps, batch, fixed_seconds)
    for a, r, j in _candidates(survivals):
        trial = (tau + a) * step_rate(sps, batch + 1, fixed_seconds)
        if trial <= theta:
            break  # the first non-improvement ends the schedule
        batch, tau, theta = batch + 1, tau + a, trial
        lengths[r] += 1
    return lengths


def choose_depth(
    num_requests: int,
    mean_survival: Sequence[float],
    sps: SpsTable,
    draft_seconds: float,
    overhead_seconds: float = 0.0,
    plain_seconds: float | None = None,
    measured: Mapping[int, float] | None = None,
) -> int:
    """How many tokens to draft for each of num_requests requests this step, before
    drafting, from what past steps taught (the production variant's use of old
    information, extended to a drafter that costs time): the depth d in 0..γ
    (γ = len(mean_survival)) of the best expected throughput

        Θ(d) = R · (1 + Σ_{j<=d} ā_j) / (d · draft_seconds + overhead_seconds + 1 / SPS(R · (1 + d)))

    where ā_j is the observed survival of position j and draft_seconds the cost of
    one drafting pass over the batch. d = 0 is plain decoding: no drafting at all,
    which is how speculation never runs slower than none when drafts do not pay.
    plain_seconds, when measured, is what a plain step really costs: the engine runs
    it on its fast path (CUDA graphs, overlapped with the next step's scheduling),
    which verification steps cannot take. measured[d], where given, is the output
    tokens per second steps of depth d really achieved at this batch size: the model
    above is only the prior of a depth not tried yet (it misjudges what it cannot
    see: a verify step's cost with many sequences, acceptance biased by the greedy's
    own choices)."""
    best_depth, best_theta, tau = 0, 0.0, float(num_requests)
    for d in range(len(mean_survival) + 1):
        if d:
            tau += num_requests * mean_survival[d - 1]
        seconds = d * draft_seconds + overhead_seconds + 1.0 / sps(num_requests * (1 + d))
        if d == 0 and plain_seconds is not None:
            seconds = plain_seconds
        theta = measured[d] if measured and d in measured else tau / seconds
        if theta > best_theta * (1 + 1e-9):
            best_depth, best_theta = d, theta
    return best_depth


def expected_throughput(lengths: Sequence[int], survivals: Sequence[Sequence[float]], sps: SpsTable) -> float:
    """Θ of a schedule."""
    tau = sum(1 + sum(row[:n]) for n, row in zip(lengths, survivals))
    return tau * sps(sum(1 + n for n in lengths))


def capacity(
    old_survivals: Sequence[Sequence[float]], sps: SpsTable, buckets: Sequence[int] = (), fixed_seconds: float = 0.0
) -> int:
    """K, the drafted tokens to verify, from survivals two steps old: the greedy's
    count, or the next graph bucket above R + count when filling it still pays
    (a step padded to its bucket costs the bucket's size anyway)."""
    lengths = schedule_greedy(old_survivals, sps, fixed_seconds)
    k, r = sum(lengths), len(old_survivals)
    bucket = next((b for b in sorted(buckets) if b >= r + k), None)
    if bucket is None or bucket == r + k:
        return k
    taken = {(n, j) for n, row in enumerate(lengths) for j in range(row)}
    extra = [a for a, n, j in _candidates(old_survivals) if (n, j) not in taken][: bucket - r - k]
    tau = r + sum(sum(row[:n]) for n, row in zip(lengths, old_survivals))
    filled = (tau + sum(extra)) * step_rate(sps, bucket, fixed_seconds)
    return k + len(extra) if filled > tau * step_rate(sps, r + k, fixed_seconds) else k


def schedule_with_capacity(survivals: Sequence[Sequence[float]], k: int) -> list[int]:
    """The K best drafted tokens of this step, each request's taken as a prefix."""
    lengths = [0] * len(survivals)
    for _, r, j in _candidates(survivals):
        if k <= 0:
            break
        if j == lengths[r]:
            lengths[r] += 1
            k -= 1
    return lengths


@dataclass
class CapacitySchedule:
    """The production variant across steps: each step's K from the survivals of the step
    two before it, rounded up to a CUDA-graph bucket (rows: tokens per step) when that
    pays, then this step's K best candidates."""

    sps: SpsTable
    buckets: Sequence[int] = ()
    """The graph buckets a verify step's rows are padded to (none: eager steps)."""
    _history: deque[list[list[float]]] = field(default_factory=lambda: deque(maxlen=2))
    """The survivals of the last two steps, oldest first."""

    def lengths(self, survivals: Sequence[Sequence[float]], fixed_seconds: float = 0.0) -> list[int]:
        """ℓ_r of this step's requests; remembers survivals for the step after next."""
        if len(self._history) < 2:
            chosen = schedule_greedy(survivals, self.sps, fixed_seconds)
        else:
            k = capacity(self._history[0], self.sps, self.buckets, fixed_seconds)
            chosen = schedule_with_capacity(survivals, k)
        self._history.append([list(row) for row in survivals])
        return chosen
