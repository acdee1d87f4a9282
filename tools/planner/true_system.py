"""The replay simulator's "true" mesh: what the instances actually do in an interval,
given how many are ready and what arrives. Built from the same profile as the planner's
model, but each stage slower by a hidden factor (latencies x f, throughputs / f) that
the planner is not told: its correction factors have to find it.

Each stage is a fluid queue on the profile's load curve. An instance asked for D
tokens/s settles where its throughput covers D (the least concurrency or batch that
does: StageModels' at_load), so latency rises with load as the profile's sweep shows.
Demand beyond the stage's capacity (its instances at the most load the profile
measured) is carried over as a backlog, and every request of the interval waits the
mean backlog's drain time: in its TTFT for prefill; for decode, a request waiting for
a batch slot waits between its first token (prefill's) and its second, which its mean
inter-token latency carries. A request is over target when its TTFT or its ITL is;
lengths come from the interval's samples (TTFT is monotone in length: one threshold
length, found by bisection).
"""

from dataclasses import dataclass

import numpy as np

from services.planner.correction import corrected
from services.planner.profile import Profile
from services.planner.stage_model import StageModels
from tools.planner.trace import Interval


@dataclass(frozen=True, slots=True)
class Outcome:
    """One interval as the mesh's metrics would report it."""

    ttft_ms: float
    """At the targets' percentile."""
    itl_ms: float
    over_target: float
    """Requests over either target."""
    requests: int
    prefill_utilisation: float
    """Demand over capacity (capacity: the most load the profile measured per instance)."""
    decode_utilisation: float
    prefill_backlog: float
    """Uncached tokens waiting at the interval's end."""
    decode_backlog: float
    """Output tokens waiting for a batch slot at the interval's end."""
    prefill_demand_per_instance: float
    decode_demand_per_instance: float
    prefill_concurrency: float
    """Prompts in flight per prefill instance (a gauge the mesh exports)."""
    decode_batch: float
    """Running requests per decode instance."""


def _first_over(f, limit: float, hi: float) -> float:
    """The least x in [1, hi] with f(x) > limit (f rising in x); inf when f(hi) <= limit."""
    if f(hi) <= limit:
        return float("inf")
    lo = 1.0
    if f(lo) > limit:
        return 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) <= limit else (lo, mid)
    return hi


class TrueMesh:
    def __init__(self, profile: Profile, hidden: dict[str, float], prefix_hit: float, percentile: float,
                 ttft_ms: float, itl_ms: float, interval_s: float) -> None:
        self.models = StageModels.from_profile(corrected(profile, hidden))
        self.prefix_hit, self.percentile, self.dt = prefix_hit, percentile, interval_s
        self.ttft_target, self.itl_target = ttft_ms, itl_ms
        rates = profile.transfer
        self.kv_s_per_token = (rates.kv_bytes_per_token / (rates.kvcache_gb_s * 1e9)
                               if rates.kvcache_gb_s and rates.kv_bytes_per_token else 0.0)

    def _queue(self, demand: float, backlog: float, capacity: float) -> tuple[float, float]:
        """(backlog at the end, mean wait in ms) of a fluid queue over one interval."""
        end = max(0.0, backlog + (demand - capacity) * self.dt)
        return end, ((backlog + end) / 2 / capacity * 1000 if capacity > 0 else float("inf"))

    def step(self, prefill: int, decode: int, arrivals: Interval, prefill_backlog: float,
             decode_backlog: float) -> Outcome:
        isl, osl = arrivals.input_tokens, arrivals.output_tokens
        miss = 1.0 - self.prefix_hit
        p, d = self.models.prefill, self.models.decode
        isl_p, osl_p = float(np.percentile(isl, self.percentile)), float(np.percentile(osl, self.percentile))
        isl_mean, osl_mean = float(isl.mean()), float(osl.mean())
        ctx_p, ctx_mean = isl_p + osl_p / 2, isl_mean + osl_mean / 2
        rps = arrivals.requests / self.dt

        p_demand = rps * isl_mean * miss + prefill_backlog / self.dt
        p_cap_each = p.tokens_per_s(isl_mean * miss, p.levels[-1])
        p_each = p_demand / max(prefill, 1)
        p_op = p.at_load(isl_p * miss, isl_mean * miss, p_each)
        p_level = p.levels[-1] if p_op is None else p_op.concurrency
        p_end, p_wait = self._queue(rps * isl_mean * miss, prefill_backlog, p_cap_each * prefill)

        d_demand = rps * osl_mean + decode_backlog / self.dt
        d_cap_each = d.tokens_per_s(d.batches[-1], ctx_mean)
        d_each = d_demand / max(decode, 1)
        d_op = d.at_load(ctx_p, ctx_mean, d_each)
        d_batch = d.batches[-1] if d_op is None else d_op.batch
        d_end, d_wait = self._queue(rps * osl_mean, decode_backlog, d_cap_each * decode)

        def ttft(n: float) -> float:
            return p.ttft_ms(n * miss, p_level) + n * self.prefix_hit * self.kv_s_per_token * 1000 + p_wait

        # Per request ITL is its mean gap between tokens (vLLM's TPOT): the batch's step
        # time at its context, plus the wait for a batch slot spread over its tokens
        # (prefill sampled the first token, so decode's queue delays the second).
        ctx = isl + osl / 2
        grid = np.geomspace(1.0, max(float(ctx.max()), 2.0), 24)
        itl = np.interp(np.log(ctx), np.log(grid), [d.itl_ms(d_batch, g) for g in grid]) + d_wait / osl
        isl_star = _first_over(ttft, self.ttft_target, float(isl.max()))
        over = float(np.mean((isl > isl_star) | (itl > self.itl_target)))
        return Outcome(ttft_ms=ttft(isl_p), itl_ms=float(np.percentile(itl, self.percentile)),
                       over_target=over * arrivals.requests,
                       requests=arrivals.requests, prefill_utilisation=p_demand / (p_cap_each * max(prefill, 1)),
                       decode_utilisation=d_demand / (d_cap_each * max(decode, 1)), prefill_backlog=p_end,
                       decode_backlog=d_end, prefill_demand_per_instance=p_each, decode_demand_per_instance=d_each,
                       prefill_concurrency=p_level, decode_batch=d_batch)
