"""The planner's decision, one interval at a time: what the live planner service
(services/planner/service.py) runs against the mesh's metrics and the replay
simulator (tools/planner/) runs against a trace, the same code in both.

Each interval (Dynamo's SLA planner, with our profile):
1. forecast the load at the interval a new instance would be ready in (Holt's
   trend on requests/s and mean lengths, sized for the most of the next
   `lookahead` intervals at the forecast's upper band: adding an instance takes
   that long, removing one is at once);
2. correct the profile by measured over predicted latency per stage, the
   prediction taken at the concurrency and batch the instances ran at, so the
   ratio is the model's error and not the load's; an interval with a backlog
   measures the queue, not the model, and is left out;
3. plan each stage for the forecast, plus any backlog as extra load drained
   over one interval on the stage that holds it. A target no allocation meets
   keeps the stage's allocation and is counted (`infeasible`), never relaxed.

The vision stage is planned where the profile has vision points and the deployment
has the stage (its allocation names it): for the forecast requests/s times the
last interval's images per request (the images the balancer routed to be encoded,
over the requests), planned with prefill by plan()'s rule (the encoder's latency
comes out of the TTFT budget). The encoder is not corrected (the balancer's TTFT
does not separate it); the prefill correction takes the fastest encoder point's
latency out of the measured TTFT when the interval had images.
"""

from dataclasses import dataclass, field
from statistics import NormalDist

from services.planner.correction import Correction, corrected
from services.planner.forecast import Load, LoadForecaster
from services.planner.plan import InfeasibleTarget, Lengths, Targets, Workload, plan
from services.planner.profile import Profile
from services.planner.stage_model import StageModels

PLANNED_STAGES = ("prefill", "decode")
"""Planned always; vision too where the profile and the deployment have it (Planner.stages)."""


@dataclass(frozen=True, slots=True)
class IntervalView:
    """What the planner knows of the interval just ended."""

    interval_s: float
    requests_per_s: float
    input_mean: float
    input_p90: float
    output_mean: float
    output_p90: float
    input_at_target: float
    """Input tokens at the targets' percentile (what the TTFT target is measured on)."""
    output_at_target: float
    ttft_ms: float | None
    """Measured at the targets' percentile; None: no request finished."""
    itl_ms: float | None
    prefill_concurrency: float
    """Prompts in flight per prefill instance, on average."""
    decode_batch: float
    """Requests decoding per decode instance, on average."""
    prefill_backlog_tokens: float = 0.0
    decode_backlog_tokens: float = 0.0
    backlog_before: tuple[float, float] = (0.0, 0.0)
    """Prefill and decode backlog at the interval's start."""
    images_per_s: float = 0.0
    """Images sent to be encoded (observe.VISION_DEMAND_SITES) per second."""


@dataclass
class Decision:
    replicas: dict[str, int]
    forecast: Load
    factors: dict[str, float]
    infeasible: dict[str, str] = field(default_factory=dict)
    """Per stage whose target no allocation meets: why (the allocation was held)."""


class Planner:
    def __init__(self, profile: Profile, targets: Targets, prefix_hit: float, lookahead: int,
                 gpu_hour_usd: float = 1.0, share: float = 0.99, headroom: float = 1.0) -> None:
        """share: the fraction of intervals the targets must hold in; the forecast's
        band is planned at the same coverage (at a 90 % band one interval in ten is
        under-forecast). headroom: capacity planned for this many times the forecast's
        request rate, for bursts no forecast sees coming within an instance's start
        (the trade is measured by the simulator: intervals met against GPU-hours)."""
        if headroom < 1.0:
            raise ValueError(f"headroom {headroom} below 1 plans for less than the forecast")
        self.headroom = headroom
        self.profile, self.targets, self.prefix_hit = profile, targets, prefix_hit
        self.lookahead, self.gpu_hour_usd = lookahead, gpu_hour_usd
        self.model = StageModels.from_profile(profile)
        self.forecaster = LoadForecaster(z=NormalDist().inv_cdf(share))
        self.corrections = {s: Correction() for s in PLANNED_STAGES}
        rates = profile.transfer
        self.kv_s_per_token = (rates.kv_bytes_per_token / (rates.kvcache_gb_s * 1e9)
                               if rates.kvcache_gb_s and rates.kv_bytes_per_token else 0.0)
        self.handoff_s_per_token = (rates.kv_bytes_per_token / (rates.handoff_gb_s * 1e9)
                                    if rates.handoff_gb_s and rates.kv_bytes_per_token else 0.0)
        self.infeasible = 0
        """Stage decisions whose plan was infeasible so far."""
        encoders = self.model.vision.operating_points()
        self.encoder_ms = min((e.latency_ms for e in encoders), default=0.0)
        """The fastest encoder point's latency: what an image adds to TTFT at the least."""

    def stages(self, allocated: dict[str, int]) -> tuple[str, ...]:
        """The stages planned against this allocation: vision where the profile has
        points for it and the deployment has the stage."""
        return PLANNED_STAGES + (("vision",) if self.profile.vision and "vision" in allocated else ())

    def factors(self) -> dict[str, float]:
        return {s: c.factor for s, c in self.corrections.items()}

    def _correct(self, v: IntervalView) -> None:
        if v.ttft_ms is not None and v.prefill_backlog_tokens == 0 and v.backlog_before[0] == 0:
            kv_ms = v.input_at_target * (self.prefix_hit * self.kv_s_per_token + self.handoff_s_per_token) * 1000
            kv_ms += self.encoder_ms if v.images_per_s > 0 else 0.0
            try:
                predicted = self.model.prefill.ttft_ms(v.input_at_target * (1.0 - self.prefix_hit),
                                                       max(v.prefill_concurrency, 1.0))
            except ValueError:  # ran at a concurrency the profile did not measure: no reading
                predicted = 0.0
            self.corrections["prefill"].observe(v.ttft_ms - kv_ms, predicted)
        if v.itl_ms is not None and v.decode_backlog_tokens == 0 and v.backlog_before[1] == 0:
            try:
                predicted = self.model.decode.itl_ms(max(v.decode_batch, 1.0),
                                                     v.input_at_target + v.output_at_target / 2)
            except ValueError:
                predicted = 0.0
            self.corrections["decode"].observe(v.itl_ms, predicted)

    def decide(self, v: IntervalView, allocated: dict[str, int]) -> Decision:
        self.forecaster.observe(Load(v.requests_per_s, v.input_mean, v.output_mean))
        self._correct(v)
        f = self.forecaster.peak(self.lookahead)
        # p90/mean of the last interval carries the lengths' shape onto the forecast means.
        isl_ratio = v.input_p90 / v.input_mean if v.input_mean else 1.0
        osl_ratio = v.output_p90 / v.output_mean if v.output_mean else 1.0
        miss = 1.0 - self.prefix_hit
        extra = {"prefill": v.prefill_backlog_tokens / (v.interval_s * max(f.input_tokens_mean * miss, 1.0)),
                 "decode": v.decode_backlog_tokens / (v.interval_s * f.output_tokens_mean)}
        profile = corrected(self.profile, self.factors())
        decision = Decision({}, f, self.factors())
        stages = self.stages(allocated)
        extra["vision"] = 0.0  # the balancer does not queue images: no backlog to drain
        images = v.images_per_s / v.requests_per_s if "vision" in stages and v.requests_per_s > 0 else 0.0
        for stage in stages:
            workload = Workload(max(f.requests_per_s * self.headroom + extra[stage], 1e-6),
                                Lengths(f.input_tokens_mean, f.input_tokens_mean * isl_ratio),
                                Lengths(f.output_tokens_mean, f.output_tokens_mean * osl_ratio), self.prefix_hit,
                                images_per_request=images)
            try:
                decision.replicas[stage] = plan(profile, workload, self.targets, self.gpu_hour_usd).replicas[stage]
            except InfeasibleTarget as exc:
                self.infeasible += 1
                decision.infeasible[stage] = str(exc)
                decision.replicas[stage] = allocated[stage]
        return decision
