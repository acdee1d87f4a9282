"""The scaling policies the replay simulator compares, each deciding the next
allocation from what the mesh's metrics showed in the interval just ended:

- PlannerPolicy: the planner in the loop (services/planner): forecast the load at the
  interval a new instance would be ready in, correct the profile by measured over
  predicted latency, plan.
- ThresholdPolicy: an HPA-like autoscaler: a stage whose utilisation is above `up`
  gets one more instance; below `down` for `down_after` intervals in a row (the HPA's
  scale-down stabilisation), one fewer.
- FixedPolicy: one allocation throughout (the best one is searched in hindsight).
"""

from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from services.planner.correction import Correction, corrected
from services.planner.forecast import Load, LoadForecaster
from services.planner.plan import InfeasibleTarget, Lengths, Targets, Workload, plan
from services.planner.profile import Profile
from services.planner.stage_model import StageModels
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
    def __init__(self, profile: Profile, targets: Targets, prefix_hit: float, lookahead: int,
                 gpu_hour_usd: float = 1.0, share: float = 0.99) -> None:
        self.profile, self.targets, self.prefix_hit = profile, targets, prefix_hit
        self.lookahead, self.gpu_hour_usd = lookahead, gpu_hour_usd
        self.model = StageModels.from_profile(profile)
        # Plan for the forecast's band of the same coverage as the share of intervals the
        # target must hold in: at a 90 % band one interval in ten is under-forecast.
        self.forecaster = LoadForecaster(z=NormalDist().inv_cdf(share))
        self.corrections = {s: Correction() for s in SIM_STAGES}
        rates = profile.transfer
        self.kv_s_per_token = (rates.kv_bytes_per_token / (rates.kvcache_gb_s * 1e9)
                               if rates.kvcache_gb_s and rates.kv_bytes_per_token else 0.0)
        self.infeasible = 0
        """Intervals whose plan was infeasible (the allocation was held)."""

    def _correct(self, seen: Seen) -> None:
        """measured / predicted, the prediction at the concurrency and batch each
        instance ran at (gauges the mesh exports; Dynamo predicts ITL at the observed
        KV load the same way), so the ratio is the model's error, not the load's. An
        interval with a backlog measures the queue, not the model, and is left out."""
        o, a, pct = seen.outcome, seen.arrivals, self.targets.percentile
        isl_p = float(np.percentile(a.input_tokens, pct))
        osl_p = float(np.percentile(a.output_tokens, pct))
        if o.prefill_backlog == 0 and seen.backlog_before[0] == 0:
            kv_ms = isl_p * self.prefix_hit * self.kv_s_per_token * 1000
            predicted = self.model.prefill.ttft_ms(isl_p * (1.0 - self.prefix_hit), o.prefill_concurrency)
            self.corrections["prefill"].observe(o.ttft_ms - kv_ms, predicted)
        if o.decode_backlog == 0 and seen.backlog_before[1] == 0:
            self.corrections["decode"].observe(o.itl_ms, self.model.decode.itl_ms(o.decode_batch, isl_p + osl_p / 2))

    def factors(self) -> dict[str, float]:
        return {s: c.factor for s, c in self.corrections.items()}

    def decide(self, seen: Seen) -> dict[str, int]:
        a = seen.arrivals
        isl_mean, osl_mean = float(a.input_tokens.mean()), float(a.output_tokens.mean())
        self.forecaster.observe(Load(a.requests / seen.interval_s, isl_mean, osl_mean))
        self._correct(seen)
        f = self.forecaster.peak(self.lookahead)
        # p90/mean of the last interval carries the lengths' shape onto the forecast means.
        isl_ratio = float(np.percentile(a.input_tokens, 90)) / isl_mean
        osl_ratio = float(np.percentile(a.output_tokens, 90)) / osl_mean
        # A backlog is load too (the mesh exports queued tokens): drained over one interval
        # once new instances are ready, on the stage that holds it, as extra requests/s.
        o, miss = seen.outcome, 1.0 - self.prefix_hit
        extra = {"prefill": o.prefill_backlog / (seen.interval_s * max(f.input_tokens_mean * miss, 1.0)),
                 "decode": o.decode_backlog / (seen.interval_s * f.output_tokens_mean)}
        profile = corrected(self.profile, self.factors())
        out = {}
        for stage in SIM_STAGES:
            workload = Workload(f.requests_per_s + extra[stage],
                                Lengths(f.input_tokens_mean, f.input_tokens_mean * isl_ratio),
                                Lengths(f.output_tokens_mean, f.output_tokens_mean * osl_ratio), self.prefix_hit)
            try:
                out[stage] = plan(profile, workload, self.targets, self.gpu_hour_usd).replicas[stage]
            except InfeasibleTarget:
                self.infeasible += 1
                out[stage] = seen.allocated[stage]
        return out
