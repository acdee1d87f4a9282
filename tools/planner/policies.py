"""The scaling policies the replay simulator compares, each deciding the next
allocation from what the mesh's metrics showed in the interval just ended:

- PlannerPolicy: the planner in the loop: services/planner/planner.py, the live
  planner service's own core (forecast the load at the interval a new instance would
  be ready in, correct the profile by measured over predicted latency, plan).
- ThresholdPolicy: an HPA-like autoscaler: a stage whose utilisation is above `up`
  gets one more instance; below `down` for `down_after` intervals in a row (the HPA's
  scale-down stabilisation), one fewer.
- FixedPolicy: one allocation throughout (the best one is searched in hindsight).
"""

from dataclasses import dataclass, field

import numpy as np

from services.planner.plan import Targets
from services.planner.planner import IntervalView, Planner
from services.planner.profile import Profile
from tools.planner.trace import Interval
from tools.planner.true_system import Outcome

SIM_STAGES = ("prefill", "decode")


@dataclass(frozen=True)
class Seen:
    """What a policy sees at an interval's end."""

    arrivals: Interval
    outcome: Outcome
    allocated: dict[str, int]
    """Ready and starting instances per stage."""
    interval_s: float
    backlog_before: tuple[float, float]
    """Prefill and decode backlog at the interval's start."""


class FixedPolicy:
    def __init__(self, allocation: dict[str, int]) -> None:
        self.allocation = dict(allocation)

    def decide(self, seen: Seen) -> dict[str, int]:
        return dict(self.allocation)


@dataclass
class ThresholdPolicy:
    up: float = 0.8
    down: float = 0.5
    down_after: int = 2
    _low_for: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SIM_STAGES})

    def decide(self, seen: Seen) -> dict[str, int]:
        util = {"prefill": seen.outcome.prefill_utilisation, "decode": seen.outcome.decode_utilisation}
        out = dict(seen.allocated)
        for stage in SIM_STAGES:
            self._low_for[stage] = self._low_for[stage] + 1 if util[stage] < self.down else 0
            if util[stage] > self.up:
                out[stage] += 1
            elif self._low_for[stage] >= self.down_after and out[stage] > 1:
                out[stage] -= 1
                self._low_for[stage] = 0
        return out


class PlannerPolicy:
    """The live planner's core (services/planner/planner.py: forecast, correct, plan),
    fed what the simulated mesh's metrics show: the same code the service runs."""

    def __init__(self, profile: Profile, targets: Targets, prefix_hit: float, lookahead: int,
                 gpu_hour_usd: float = 1.0, share: float = 0.99, headroom: float = 1.0) -> None:
        self.planner = Planner(profile, targets, prefix_hit, lookahead, gpu_hour_usd, share, headroom)
        self.percentile = targets.percentile

    @property
    def infeasible(self) -> int:
        """Stage decisions whose plan was infeasible (the allocation was held)."""
        return self.planner.infeasible

    def factors(self) -> dict[str, float]:
        return self.planner.factors()

    def decide(self, seen: Seen) -> dict[str, int]:
        a, o = seen.arrivals, seen.outcome
        isl, osl = a.input_tokens, a.output_tokens
        view = IntervalView(
            interval_s=seen.interval_s, requests_per_s=a.requests / seen.interval_s,
            input_mean=float(isl.mean()), input_p90=float(np.percentile(isl, 90)),
            output_mean=float(osl.mean()), output_p90=float(np.percentile(osl, 90)),
            input_at_target=float(np.percentile(isl, self.percentile)),
            output_at_target=float(np.percentile(osl, self.percentile)),
            ttft_ms=o.ttft_ms if o.requests else None, itl_ms=o.itl_ms if o.requests else None,
            prefill_concurrency=o.prefill_concurrency, decode_batch=o.decode_batch,
            prefill_backlog_tokens=o.prefill_backlog, decode_backlog_tokens=o.decode_backlog,
            backlog_before=seen.backlog_before)
        return dict(self.planner.decide(view, seen.allocated).replicas)
