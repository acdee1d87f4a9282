"""A worker's vLLM-compatible series (see shared/runtime/vllm_metrics.py for which
process exports what): its engine's running and waiting requests, KV cache
usage, prefix cache queries and hits, preemptions and, on prefill, each
request's time in the engine's queue."""

from prometheus_client import CollectorRegistry

from shared.engine.outputs import EngineLoad
from shared.runtime.vllm_metrics import REQUEST_LATENCY_BUCKETS, counter, gauge, histogram


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
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
        self._last: EngineLoad | None = None

    def update(self, load: EngineLoad) -> None:
        """Gauges to the load's figures; counters by what its running totals grew since the last load."""
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.kv_usage.set(1 - load.num_free_kv_blocks / max(load.num_total_kv_blocks, 1))
        last = self._last
        self.prefix_queries.inc(load.num_prefix_query_tokens - (last.num_prefix_query_tokens if last else 0))
        self.prefix_hits.inc(load.num_prefix_hit_tokens - (last.num_prefix_hit_tokens if last else 0))
        self.preemptions.inc(load.num_preemptions - (last.num_preemptions if last else 0))
        self._last = load
