"""The live planner's reading of an interval off the balancer's /metrics: deltas of
real prometheus_client series, rendered and parsed as a scrape returns them."""

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from services.planner.observe import CACHED_TOKENS, ITL, OUTPUT_TOKENS, PROMPT_TOKENS, TTFT, observe, parse, quantile
from shared.runtime.vllm_metrics import TOKEN_LATENCY_BUCKETS, TTFT_BUCKETS


class Balancer:
    """The series the planner reads, named and bucketed as the balancer's."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.success = Counter("vllm:request_success", "", ("finished_reason",), registry=r)
        self.prompt = Counter(PROMPT_TOKENS.removesuffix("_total"), "", registry=r)
        self.output = Counter(OUTPUT_TOKENS.removesuffix("_total"), "", registry=r)
        self.cached = Counter(CACHED_TOKENS.removesuffix("_total"), "", registry=r)
        self.ttft = Histogram(TTFT, "", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(ITL, "", buckets=TOKEN_LATENCY_BUCKETS, registry=r)

    def scrape(self):  # noqa: ANN201
        return parse(generate_latest(self.registry).decode())

    def finish(self, prompt: int, output: int, cached: int, ttft_s: float, reason: str = "length") -> None:
        self.success.labels(reason).inc()
        self.prompt.inc(prompt)
        self.output.inc(output)
        self.cached.inc(cached)
        self.ttft.observe(ttft_s)


def test_an_interval_is_the_difference_of_two_scrapes() -> None:
    b = Balancer()
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
    b = Balancer()
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
