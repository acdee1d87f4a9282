"""What the mesh did over one planner interval, read off the balancer's
Prometheus /metrics (the vLLM-named series a client sees, shared/runtime/
vllm_metrics.py, and the balancer's own): the load (requests/s, input and
output tokens per request, the prefix-cache hit rate) and the latencies the
planner answers for (TTFT and inter-token latency at a percentile).

Counters and histograms are cumulative: an interval is the difference of two
scrapes. A percentile comes from the histogram's bucket counts over the
interval, interpolated linearly inside the bucket it falls in (as Prometheus's
histogram_quantile does), so it is as fine as vLLM's buckets are.
"""

import math
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""(sample name, sorted labels) -> value."""

REQUESTS = "vllm:request_success_total"
PROMPT_TOKENS = "infermesh_balancer_prompt_tokens_total"
OUTPUT_TOKENS = "infermesh_balancer_completion_tokens_total"
CACHED_TOKENS = "infermesh_balancer_cached_tokens_total"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
PROMPT_LENGTHS = "vllm:request_prompt_tokens"
OUTPUT_LENGTHS = "vllm:request_generation_tokens"
VISION_IMAGES = "infermesh_balancer_vision_images_total"
VISION_DEMAND_SITES = ("vision", "prefill")
"""The images the vision stage is sized for: those it encoded and those prefill encoded
because no vision instance could (none live, or each failed). A lone small image the
balancer leaves to prefill on purpose (site prefill_small) is no load for the stage."""


def parse(text: str) -> Series:
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def scrape(url: str, timeout_s: float = 5.0) -> Series:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return parse(resp.read().decode())


def total(series: Series, name: str, label: str = "", values: tuple[str, ...] = ()) -> float:
    """A series summed over its labels (e.g. finished requests of every reason); with
    `label`, over the samples whose label is one of `values` only."""
    return sum(v for (n, labels), v in series.items()
               if n == name and (not label or dict(labels).get(label) in values))  # fmt: skip


def buckets(series: Series, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a histogram, summed over its other labels."""
    by_le: dict[float, float] = {}
    for (n, labels), v in series.items():
        if n == f"{name}_bucket":
            le = float(dict(labels)["le"])
            by_le[le] = by_le.get(le, 0.0) + v
    return sorted(by_le.items())


def quantile(before: Series, after: Series, name: str, q: float) -> float | None:
    """The q-quantile (0..1) of what the histogram saw between two scrapes; None
    when it saw nothing."""
    old = dict(buckets(before, name))
    delta = [(le, count - old.get(le, 0.0)) for le, count in buckets(after, name)]
    if not delta or delta[-1][1] <= 0:
        return None
    rank = q * delta[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in delta:
        if count >= rank:
            if math.isinf(le):  # past the last finite bucket: its bound is all we know
                return lower_le
            inside = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_le + (le - lower_le) * inside
        lower_le, lower_count = le, count
    return lower_le


def mean(before: Series, after: Series, name: str) -> float | None:
    """A histogram's mean over the interval (its _sum and _count deltas); None when empty."""
    count = total(after, f"{name}_count") - total(before, f"{name}_count")
    return (total(after, f"{name}_sum") - total(before, f"{name}_sum")) / count if count > 0 else None


@dataclass(slots=True, frozen=True)
class Observation:
    """One interval of the mesh, as its clients saw it."""

    interval_s: float
    requests: int
    requests_per_s: float
    input_tokens: float
    """Mean prompt tokens per finished request."""
    output_tokens: float
    prefix_hit_rate: float
    """Prompt tokens served from the prefix cache, over all prompt tokens."""
    ttft_ms: float | None
    """At the percentile asked; None with no request finished."""
    itl_ms: float | None
    ttft_mean_ms: float | None
    itl_mean_ms: float | None
    input_p90: float
    """Prompt tokens per request at p90 (vllm:request_prompt_tokens' buckets); the mean when empty."""
    output_p90: float
    input_at_percentile: float
    """Prompt tokens per request at the percentile asked."""
    output_at_percentile: float
    images_per_s: float = 0.0
    """Images the vision stage is sized for (VISION_DEMAND_SITES) per second."""


def observe(before: Series, after: Series, interval_s: float, percentile: float) -> Observation:
    def delta(name: str, label: str = "", values: tuple[str, ...] = ()) -> float:
        return max(total(after, name, label, values) - total(before, name, label, values), 0.0)

    requests = delta(REQUESTS)
    prompt = delta(PROMPT_TOKENS)
    ttft = quantile(before, after, TTFT, percentile / 100)
    itl = quantile(before, after, ITL, percentile / 100)
    ttft_mean, itl_mean = mean(before, after, TTFT), mean(before, after, ITL)
    input_mean = prompt / requests if requests else 0.0
    output_mean = delta(OUTPUT_TOKENS) / requests if requests else 0.0

    def length(name: str, q: float, fallback: float) -> float:
        value = quantile(before, after, name, q)
        return fallback if value is None else value

    return Observation(
        interval_s=interval_s,
        requests=int(requests),
        requests_per_s=requests / interval_s if interval_s > 0 else 0.0,
        input_tokens=input_mean,
        output_tokens=output_mean,
        prefix_hit_rate=delta(CACHED_TOKENS) / prompt if prompt else 0.0,
        ttft_ms=None if ttft is None else ttft * 1e3,
        itl_ms=None if itl is None else itl * 1e3,
        ttft_mean_ms=None if ttft_mean is None else ttft_mean * 1e3,
        itl_mean_ms=None if itl_mean is None else itl_mean * 1e3,
        input_p90=length(PROMPT_LENGTHS, 0.9, input_mean),
        output_p90=length(OUTPUT_LENGTHS, 0.9, output_mean),
        input_at_percentile=length(PROMPT_LENGTHS, percentile / 100, input_mean),
        output_at_percentile=length(OUTPUT_LENGTHS, percentile / 100, output_mean),
        images_per_s=delta(VISION_IMAGES, "site", VISION_DEMAND_SITES) / interval_s if interval_s > 0 else 0.0,
    )
