"""Correction factors: measured over predicted latency per stage, smoothed and clamped,
and a profile with them applied. A profile is measured once, on one mesh; the running
mesh drifts from it (other prompts, other hardware, contention). Dynamo's planner
multiplies its profile's predictions by measured / predicted each interval; we do the
same, and apply the factor to the profile itself (latencies x f, throughputs / f), so
plan() and the stage models need no second code path.

Smoothing keeps one noisy interval from resizing the mesh; the clamp keeps a broken
measurement (a stalled instance, an empty interval) from sizing it to nothing or to
everything.
"""

import dataclasses
from dataclasses import dataclass

from services.planner.profile import Profile

STAGES = ("prefill", "decode", "vision")


@dataclass(slots=True)
class Correction:
    """One stage's factor: an exponentially weighted mean of measured / predicted."""

    smoothing: float = 0.3
    """Weight of a new interval's ratio."""
    low: float = 0.5
    high: float = 3.0
    factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"Correction.smoothing must be in (0, 1], got {self.smoothing}")
        if not 0.0 < self.low <= 1.0 <= self.high:
            raise ValueError(f"Correction needs 0 < low <= 1 <= high, got {self.low}, {self.high}")

    def observe(self, measured_ms: float, predicted_ms: float) -> float:
        """Fold in one interval; an interval with nothing measured (<= 0) changes nothing."""
        if measured_ms > 0 and predicted_ms > 0:
            ratio = min(max(measured_ms / predicted_ms, self.low), self.high)
            self.factor = min(max((1 - self.smoothing) * self.factor + self.smoothing * ratio, self.low), self.high)
        return self.factor


def corrected(profile: Profile, factors: dict[str, float]) -> Profile:
    """The profile as the corrected model sees it: each stage's latencies times its
    factor and its throughputs divided by it (a stage f times slower does 1/f the work)."""
    unknown = set(factors) - set(STAGES)
    if unknown:
        raise ValueError(f"correction factors for unknown stages {sorted(unknown)}; stages are {STAGES}")
    p, d, v = (factors.get(s, 1.0) for s in STAGES)
    return dataclasses.replace(
        profile,
        prefill=[dataclasses.replace(x, ttft_ms=x.ttft_ms * p, tokens_per_s=x.tokens_per_s / p) for x in profile.prefill],
        decode=[dataclasses.replace(x, itl_ms=x.itl_ms * d, tokens_per_s=x.tokens_per_s / d) for x in profile.decode],
        vision=[dataclasses.replace(x, latency_ms=x.latency_ms * v, images_per_s=x.images_per_s / v)
                for x in profile.vision],
    )
