"""The live planner: every interval, read what the mesh did off the balancer's
/metrics, decide each stage's replicas (services/planner/planner.py, the code the
replay simulator runs too) and hand the decision to a scaler (scalers.py):
Kubernetes, `infermesh up`'s supervisor, or nobody (advisory).

What it cannot read off the balancer it estimates: the prompts in flight per
prefill instance and the batch per decode instance, by Little's law (arrival rate
times mean time in the stage, over the instances). The backlog is not read
(workers export it, the balancer does not): a queue shows as latency above the
prediction, which the correction answers within a few intervals.

Every decision is published, acted on or not: infermesh_planner_replicas{stage}
(wanted), _predicted_* and _correction{stage}, and a log line when it changes.
"""

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from services.planner.observe import Observation, Series, observe, scrape
from services.planner.plan import Targets
from services.planner.planner import Decision, IntervalView, Planner
from services.planner.profile import Profile
from services.planner.scalers import ScaleError, Scaler
from shared.runtime.metrics import Metrics
from shared.runtime.settings import PlannerSettings

log = logging.getLogger(__name__)


def view_of(obs: Observation, allocated: dict[str, int]) -> IntervalView:
    """The planner's view of an interval; per-instance load by Little's law."""
    ttft_s = (obs.ttft_mean_ms or 0.0) / 1e3
    decode_s = obs.output_tokens * (obs.itl_mean_ms or 0.0) / 1e3
    return IntervalView(
        interval_s=obs.interval_s,
        requests_per_s=obs.requests_per_s,
        input_mean=obs.input_tokens, input_p90=obs.input_p90,
        output_mean=obs.output_tokens, output_p90=obs.output_p90,
        input_at_target=obs.input_at_percentile, output_at_target=obs.output_at_percentile,
        ttft_ms=obs.ttft_ms, itl_ms=obs.itl_ms, images_per_s=obs.images_per_s,
        prefill_concurrency=obs.requests_per_s * ttft_s / max(allocated.get("prefill", 1), 1),
        decode_batch=obs.requests_per_s * decode_s / max(allocated.get("decode", 1), 1),
    )


def bounded(replicas: dict[str, int], settings: PlannerSettings, devices: dict[str, int]) -> tuple[dict[str, int], str]:
    """Each stage within [min_replicas, max_replicas]; all within the device budget,
    cut in proportion where over it (never below min_replicas). Vision the plan gives
    none (no images in the load) goes to 0: prefill encodes what images come, and they
    count as the stage's load, so it comes back. Returns the counts and, when the budget
    cut them, why."""
    def least(stage: str, n: int) -> int:
        return 0 if stage == "vision" and n == 0 else settings.min_replicas

    out = {s: min(max(n, least(s, n)), settings.max_replicas) for s, n in replicas.items()}
    used = sum(n * devices.get(s, 1) for s, n in out.items())
    if not settings.gpu_budget or used <= settings.gpu_budget:
        return out, ""
    scale = settings.gpu_budget / used
    cut = {s: max(math.floor(n * scale), least(s, n)) for s, n in out.items()}
    return cut, f"the plan wants {used} devices, over the budget of {settings.gpu_budget}: cut to {cut}"


@dataclass
class LivePlanner:
    settings: PlannerSettings
    profile: Profile
    scaler: Scaler
    metrics: Metrics
    read: Callable[[], Series] | None = None
    """Scrapes the balancer (default: settings.metrics_url)."""

    def __post_init__(self) -> None:
        s = self.settings
        # Size for the interval in which an instance asked for now is ready.
        lookahead = max(1, math.ceil(s.startup_s / s.interval_s))
        self.planner = Planner(self.profile, Targets(s.ttft_ms, s.itl_ms, s.percentile), prefix_hit=0.0,
                               lookahead=lookahead, gpu_hour_usd=s.gpu_hour_usd, headroom=s.headroom)
        self.read = self.read or (lambda: scrape(self.settings.metrics_url))
        self._before: Series | None = None
        m = self.metrics
        self.g_replicas = m.gauge("replicas", "Replicas the planner wants per stage", ("stage",))
        self.g_allocated = m.gauge("allocated_replicas", "Replicas the deployment has per stage", ("stage",))
        self.g_factor = m.gauge("correction", "Measured over predicted latency per stage", ("stage",))
        self.g_rps = m.gauge("forecast_requests_per_second", "The load the planner sized for")
        self.g_seen = m.gauge("observed_requests_per_second", "The load of the last interval")
        self.c_infeasible = m.counter("infeasible_total", "Decisions whose target no allocation meets", ("stage",))
        self.c_errors = m.counter("scale_errors_total", "Scaler calls that failed (retried next interval)")

    def step(self, interval_s: float) -> Decision | None:
        """One interval: read, decide, publish, act. None when there was nothing to decide on."""
        after = self.read()  # type: ignore[misc]
        before, self._before = self._before, after
        if before is None:
            return None
        obs = observe(before, after, interval_s, self.settings.percentile)
        self.g_seen.set(obs.requests_per_s)
        if obs.requests == 0:
            return None  # no load seen: no reading to size on (the last decision stands)
        try:
            allocated = self.scaler.current()
        except ScaleError as exc:
            self.c_errors.inc()
            log.warning("cannot read the replicas: %s", exc)
            return None
        # Vision where the deployment has the stage (the scaler names it) and the profile measured it.
        allocated = {s: allocated.get(s, 1) for s in self.planner.stages(allocated)}
        self.planner.prefix_hit = obs.prefix_hit_rate
        decision = self.planner.decide(view_of(obs, allocated), allocated)
        wanted, cut = bounded(decision.replicas, self.settings, self.profile.devices_per_instance)
        if cut:
            log.warning("%s", cut)
        for stage, why in decision.infeasible.items():
            self.c_infeasible.labels(stage).inc()
            log.warning("%s: %s; holding %d", stage, why, allocated[stage])
        for stage in allocated:
            self.g_replicas.labels(stage).set(wanted[stage])
            self.g_allocated.labels(stage).set(allocated[stage])
            self.g_factor.labels(stage).set(decision.factors.get(stage, 1.0))
        self.g_rps.set(decision.forecast.requests_per_s)
        changed = {s: n for s, n in wanted.items() if n != allocated[s]}
        if changed:
            log.info("load %.2f req/s (forecast %.2f), TTFT p%g %s ms, ITL %s ms: %s %s", obs.requests_per_s,
                     decision.forecast.requests_per_s, self.settings.percentile, _ms(obs.ttft_ms), _ms(obs.itl_ms),
                     "scaling" if self.scaler.acts else "would scale (advisory)", changed)
            try:
                self.scaler.scale(changed)
            except ScaleError as exc:
                self.c_errors.inc()
                log.warning("scaling failed: %s", exc)
        decision.replicas = wanted
        return decision

    async def run(self, stop: asyncio.Event) -> None:
        interval = self.settings.interval_s
        loop = asyncio.get_running_loop()
        last = loop.time()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=max(interval - (loop.time() - last), 0.0))
                return
            except TimeoutError:
                pass
            now = loop.time()
            try:
                await asyncio.to_thread(self.step, now - last if self._before is not None else interval)
            except OSError as exc:  # the balancer did not answer: try again next interval
                log.warning("cannot read %s: %s", self.settings.metrics_url, exc)
            last = now


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
