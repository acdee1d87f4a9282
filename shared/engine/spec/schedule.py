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
is needed there.
"""

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


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


def schedule_greedy(survivals: Sequence[Sequence[float]], sps: SpsTable) -> list[int]:
    """ℓ_r per request (survivals[r][j] = a_{r,j+1}, non-increasing in j)."""
    lengths = [0] * len(survivals)
    if not survivals:
        return lengths
    batch, tau = len(survivals), float(len(survivals))
    theta = tau * sps(batch)
    for a, r, j in _candidates(survivals):
        trial = (tau + a) * sps(batch + 1)
        if trial <= theta:
            break  # the first non-improvement ends the schedule
        batch, tau, theta = batch + 1, tau + a, trial
        lengths[r] += 1
    return lengths


def expected_throughput(lengths: Sequence[int], survivals: Sequence[Sequence[float]], sps: SpsTable) -> float:
    """Θ of a schedule."""
    tau = sum(1 + sum(row[:n]) for n, row in zip(lengths, survivals))
    return tau * sps(sum(1 + n for n in lengths))


def capacity(old_survivals: Sequence[Sequence[float]], sps: SpsTable, buckets: Sequence[int] = ()) -> int:
    """K, the drafted tokens to verify, from survivals two steps old: the greedy's
    count, or the next graph bucket above R + count when filling it still pays."""
    lengths = schedule_greedy(old_survivals, sps)
    k = sum(lengths)
    r = len(old_survivals)
    bucket = next((b for b in sorted(buckets) if b >= r + k), None)
    if bucket is None or bucket == r + k:
        return k
    # Fill the bucket with the next candidates in order if Θ improves (the step costs
    # the bucket's size anyway once the graph is padded to it).
    pool = _candidates(old_survivals)
    taken = set()
    for n, row in enumerate(lengths):
        taken.update((n, j) for j in range(row))
    extra = [c for c in pool if (c[1], c[2]) not in taken][: bucket - r - k]
    gain = sum(a for a, _, _ in extra)
    tau = sum(1 + sum(row[:n]) for n, row in zip(lengths, old_survivals))
    return k + len(extra) if (tau + gain) * sps(bucket) > tau * sps(r + k) else k


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
