"""The live planner's reading of an interval off the balancer's /metrics: deltas of
real prometheus_client series, rendered and parsed as a scrape returns them."""

import random

from services.planner.observe import TTFT, observe, quantile
from shared.runtime.vllm_metrics import TTFT_BUCKETS
from tests.helpers.planner_metrics import BalancerSeries


def test_an_interval_is_the_difference_of_two_scrapes() -> None:
    b = BalancerSeries()
    for _ in range(50):  # before the interval: must not count
        b.finish(prompt=1000, output=10, cached=0, ttft_s=5.0)
    before = b.scrape()
    for i in range(30):
        b.finish(prompt=200, output=50, cached=100, ttft_s=0.05, reason="stop" if i % 2 else "length")
        for _ in range(49):
            b.itl.observe(0.02)
    obs = observe(before, b.scrape(), interval_s=10.0, percentile=90)
    assert obs.requests == 30 and obs.requests_per_s == 3.0
    assert obs.input_tokens == 200 and obs.output_tokens == 50
    assert obs.prefix_hit_rate == 0.5
    assert 40 < obs.ttft_ms <= 60  # 0.05 s falls in the (0.04, 0.06] bucket: not the earlier 5 s
    assert 10 < obs.itl_ms <= 25


def test_the_percentile_follows_the_observed_distribution() -> None:
    b = BalancerSeries()
    before = b.scrape()
    rng = random.Random(0)
    values = sorted(rng.uniform(0.1, 1.0) for _ in range(2000))
    for v in values:
        b.ttft.observe(v)
    after = b.scrape()
    for q in (0.5, 0.9, 0.99):
        est = quantile(before, after, TTFT, q)
        true = values[int(q * len(values)) - 1]
        # The buckets around these values are 0.25 s wide: the estimate lies in the true one's bucket.
        edges = [e for e in TTFT_BUCKETS if e >= true]
        lower = max(e for e in (0.0, *TTFT_BUCKETS) if e < true)
        assert lower <= est <= edges[0], (q, est, true)
    assert quantile(after, after, TTFT, 0.9) is None  # nothing seen: no figure, not zero
