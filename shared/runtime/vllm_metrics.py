"""vLLM-compatible Prometheus series, beside the mesh's own infermesh_* ones, so
that vLLM's Grafana dashboards, inference-perf's server-side report and
autoscalers that read `vllm:num_requests_waiting` or `vllm:kv_cache_usage_perc`
see the mesh as they see a vLLM server: the same names, types, buckets and
`model_name` label as vLLM v1's Prometheus logger.

A vLLM server is one process; the mesh is several, so each series comes from the
one process that sees it, and summing a series over the mesh's pods never counts
a request twice:

  balancer (RequestMetrics)  what a request's client sees: time to first token,
      inter-token latency, time per output token (per request), end-to-end
      latency, prompt and generation tokens (counters and per-request
      histograms), finished requests by reason, and the phases of a request
      (prefill, decode, inference time; see FinishedRequest);
  prefill and decode (shared/stage/engine_metrics.py)  what an engine holds: running and waiting
      requests, KV cache usage, prefix cache queries and hits, preemptions,
      tokens per engine step, the cache's configuration; and prefill the queue
      time (a request waits in prefill's engine, nowhere else).

Counters are created without the `_total` suffix: prometheus_client adds it, as
for vLLM (`vllm:prompt_tokens` is scraped as `vllm:prompt_tokens_total`).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM v1's buckets (vllm/v1/metrics/loggers.py), each reaching past 10 minutes.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""Inter-token latency and time per output token."""
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""End-to-end latency and queue time."""
FINISH_REASONS = ("stop", "length", "abort", "error")
"""vLLM's FinishReason values: the label values of vllm:request_success_total."""
MODEL_NAME = "model_name"


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def served_model_names(model_name: str | None, model_dir: str) -> tuple[str, ...]:
    """The names clients may ask for (vLLM's --served-model-name): balancer.model_name's,
    comma-separated, else the model folder's name. The first is the one responses
    and every series carry."""
    names = tuple(name.strip() for name in (model_name or "").split(",") if name.strip())
    return names or (Path(model_dir).name,)


def served_model_name(model_name: str | None, model_dir: str) -> str:
    """The name every series carries: the first served name."""
    return served_model_names(model_name, model_dir)[0]


def counter(registry: CollectorRegistry, name: str, doc: str, model: str) -> Counter:
    return Counter(name, doc, (MODEL_NAME,), registry=registry).labels(model)


def gauge(registry: CollectorRegistry, name: str, doc: str, model: str) -> Gauge:
    return Gauge(name, doc, (MODEL_NAME,), registry=registry).labels(model)


def histogram(registry: CollectorRegistry, name: str, doc: str, model: str, buckets: Sequence[float]) -> Histogram:
    return Histogram(name, doc, (MODEL_NAME,), registry=registry, buckets=buckets).labels(model)


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """What the balancer knows of a request when it ends."""

    finish_reason: str
    """One of FINISH_REASONS."""
    e2e_s: float
    ttft_s: float | None
    """None: it ended before its first token."""
    num_prompt_tokens: int
    num_generation_tokens: int
    dispatch_s: float = 0.0
    """From arrival to leaving the balancer's queue for the mesh. vLLM's phases start at
    the request's first step; the balancer sees the mesh from outside, so its
    prefill phase starts at the dispatch and holds prefill's engine queue too (which
    prefill exports apart, as vllm:request_queue_time_seconds)."""

    @property
    def prefill_s(self) -> float | None:
        """Dispatch to the first token (vLLM: first step to first token)."""
        return None if self.ttft_s is None else self.ttft_s - self.dispatch_s

    @property
    def decode_s(self) -> float | None:
        """First token to the last (or to the end, for a request that did not finish)."""
        return None if self.ttft_s is None else self.e2e_s - self.ttft_s

    @property
    def inference_s(self) -> float:
        """Dispatch to the end: prefill plus decode."""
        return self.e2e_s - self.dispatch_s


class RequestMetrics:
    """The balancer's vLLM series: request-level latencies and token counts."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        r, m = registry, model_name
        token_buckets = one_two_five_buckets(max_model_len)
        self.ttft = histogram(r, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               m, TTFT_BUCKETS)
        self.itl = histogram(r, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              m, TOKEN_LATENCY_BUCKETS)
        self.tpot_per_token = histogram(
            r, "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (vLLM's older name of vllm:inter_token_latency_seconds).",
            m, TOKEN_LATENCY_BUCKETS,
        )  # fmt: skip
        self.tpot = histogram(
            r, "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request: (e2e - ttft) / (generation tokens - 1).",
            m, TOKEN_LATENCY_BUCKETS,
        )  # fmt: skip
        self.e2e = histogram(r, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                              m, REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram(r, "vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", m, REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram(r, "vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", m, REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram(r, "vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", m, REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = counter(r, "vllm:prompt_tokens", "Number of prefill tokens processed.", m)
        self.generation_tokens = counter(r, "vllm:generation_tokens", "Number of generation tokens processed.", m)
        self.request_prompt_tokens = histogram(
            r, "vllm:request_prompt_tokens", "Number of prefill tokens processed.", m, token_buckets
        )
        self.request_generation_tokens = histogram(
            r, "vllm:request_generation_tokens", "Number of generation tokens processed.", m, token_buckets
        )
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (MODEL_NAME, "finished_reason"), registry=r)  # fmt: skip
        # Every reason from the start, at 0, as vLLM does: rate() sees the first one.
        self.success = {reason: success.labels(m, reason) for reason in FINISH_REASONS}

    def first_token(self, ttft_s: float, num_prompt_tokens: int, num_tokens: int) -> None:
        """The prompt was processed and the first tokens arrived."""
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_tokens)

    def next_tokens(self, gap_s: float, num_tokens: int) -> None:
        self.itl.observe(gap_s)
        self.tpot_per_token.observe(gap_s)
        self.generation_tokens.inc(num_tokens)

    def finished(self, request: FinishedRequest) -> None:
        self.success[request.finish_reason].inc()
        self.e2e.observe(request.e2e_s)
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(request.num_generation_tokens)
        if request.ttft_s is not None and request.num_generation_tokens > 1:
            self.tpot.observe((request.e2e_s - request.ttft_s) / (request.num_generation_tokens - 1))
        self.inference_time.observe(request.inference_s)
        if request.prefill_s is not None and request.decode_s is not None:  # it reached its first token
            self.prefill_time.observe(request.prefill_s)
            self.decode_time.observe(request.decode_s)
