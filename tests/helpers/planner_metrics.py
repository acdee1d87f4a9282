"""The balancer's /metrics series the planner reads, named and bucketed as the
balancer's, fed by hand: what the planner's observe and live tests scrape."""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from services.planner.observe import (
    CACHED_TOKENS,
    ITL,
    OUTPUT_LENGTHS,
    OUTPUT_TOKENS,
    PROMPT_LENGTHS,
    PROMPT_TOKENS,
    TTFT,
    VISION_IMAGES,
    parse,
)
from shared.runtime.vllm_metrics import TOKEN_LATENCY_BUCKETS, TTFT_BUCKETS


class BalancerSeries:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.success = Counter("vllm:request_success", "", ("finished_reason",), registry=r)
        self.prompt = Counter(PROMPT_TOKENS.removesuffix("_total"), "", registry=r)
        self.output = Counter(OUTPUT_TOKENS.removesuffix("_total"), "", registry=r)
        self.cached = Counter(CACHED_TOKENS.removesuffix("_total"), "", registry=r)
        self.ttft = Histogram(TTFT, "", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(ITL, "", buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.prompt_len = Histogram(PROMPT_LENGTHS, "", buckets=(100, 1000, 2000, 4000), registry=r)
        self.output_len = Histogram(OUTPUT_LENGTHS, "", buckets=(10, 100, 200, 400), registry=r)
        self.images = Counter(VISION_IMAGES.removesuffix("_total"), "", ("site",), registry=r)

    def scrape(self):  # noqa: ANN201
        return parse(generate_latest(self.registry).decode())

    def finish(self, prompt: int, output: int, cached: int, ttft_s: float, reason: str = "length") -> None:
        """One request finished (its token counts and TTFT; no lengths histograms)."""
        self.success.labels(reason).inc()
        self.prompt.inc(prompt)
        self.output.inc(output)
        self.cached.inc(cached)
        self.ttft.observe(ttft_s)

    def interval(self, requests: int, images: dict[str, int]) -> None:
        """An interval of like requests (1000 prompt, 100 output tokens) and images by site."""
        for _ in range(requests):
            self.success.labels("length").inc()
            self.prompt.inc(1000)
            self.output.inc(100)
            self.prompt_len.observe(1000)
            self.output_len.observe(100)
            self.ttft.observe(0.2)
            for _ in range(99):
                self.itl.observe(0.01)
        for site, n in images.items():
            self.images.labels(site).inc(n)
