"""A worker's vLLM-compatible series (see shared/runtime/vllm_metrics.py for which
process exports what): its engine's running and waiting requests, KV cache
usage, prefix cache queries and hits, preemptions, tokens per engine step, the
cache's configuration and, on prefill, each request's time in the engine's queue."""

from collections import deque

from prometheus_client import CollectorRegistry, Gauge

from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import EngineLoad
from shared.runtime.vllm_metrics import MODEL_NAME, REQUEST_LATENCY_BUCKETS, counter, gauge, histogram

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""vLLM v1's buckets of vllm:iteration_tokens_total."""


def cache_config_info(engine: LLMEngine) -> dict[str, str]:
    """The labels of vllm:cache_config_info: those of vLLM's CacheConfig that this
    engine has, as strings the way vLLM writes them (str(value): "True", "None").
    num_gpu_blocks is the paged cache's blocks on whatever device the engine runs."""
    config = engine.config
    return {
        "block_size": str(engine.kv.block_size),
        "cache_dtype": config.dtype,
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "num_gpu_blocks": str(engine.kv.pool.num_blocks),
        "engine": "0",
    }


class EngineMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        step_tokens: deque[int] | None = None,
        cache_info: dict[str, str] | None = None,
    ) -> None:
        """step_tokens: the scheduler's tokens per step, drained at each update.
        cache_info: the labels of vllm:cache_config_info (cache_config_info())."""
        r, m = registry, model_name
        self.running = gauge(r, "vllm:num_requests_running", "Number of requests in model execution batches.", m)
        self.waiting = gauge(r, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", m)
        self.kv_usage = gauge(r, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m)
        self.prefix_queries = counter(
            r, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", m
        )
        self.prefix_hits = counter(r, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", m)
        self.preemptions = counter(r, "vllm:num_preemptions", "Cumulative number of preemption from the engine.", m)
        self.queue_time = histogram(r, "vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", m, REQUEST_LATENCY_BUCKETS)
        # vLLM observes prompt plus generated tokens of each iteration; a step's scheduled
        # tokens are what it computed (prompt chunks, decodes, drafts verified).
        self.iteration_tokens = histogram(r, "vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", m, ITERATION_TOKEN_BUCKETS)
        self._step_tokens = step_tokens
        if cache_info is not None:
            # An info series: a gauge held at 1 whose labels say the configuration (as vLLM's).
            info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                         (MODEL_NAME, *cache_info), registry=r)  # fmt: skip
            info.labels(m, *cache_info.values()).set(1)
        self._last: EngineLoad | None = None

    def update(self, load: EngineLoad) -> None:
        """Gauges to the load's figures; counters by what its running totals grew since
        the last load; each step since then into the iteration histogram."""
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.kv_usage.set(1 - load.num_free_kv_blocks / max(load.num_total_kv_blocks, 1))
        last = self._last
        self.prefix_queries.inc(load.num_prefix_query_tokens - (last.num_prefix_query_tokens if last else 0))
        self.prefix_hits.inc(load.num_prefix_hit_tokens - (last.num_prefix_hit_tokens if last else 0))
        self.preemptions.inc(load.num_preemptions - (last.num_preemptions if last else 0))
        self._last = load
        steps = self._step_tokens
        while steps:
            self.iteration_tokens.observe(steps.popleft())
