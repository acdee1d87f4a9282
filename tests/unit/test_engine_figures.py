"""The engine's figures behind the workers' vLLM series, exactly: preemptions,
prefix-cache queried and hit tokens in EngineLoad, each request's queue time,
and EngineMetrics turning the running totals into counters."""

from prometheus_client import CollectorRegistry

from shared.engine.config import EngineConfig
from shared.engine.engine_request import EngineRequest
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from tools.make_model import make_model
from shared.stage.engine_metrics import EngineMetrics
from tests.helpers.engine_helpers import run


def _value(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name, {"model_name": "tiny"})
    assert value is not None, name
    return value


def test_prefix_figures_count_tokens_queried_and_hit(tmp_path):
    make_model(str(tmp_path / "m"))
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "m"), block_size=8, num_kv_blocks=64, max_model_len=64))
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "tiny")
    metrics.update(engine.load())
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    prompt = list(range(10, 30))  # 20 tokens: two full blocks of 8
    first = run(engine, "a", prompt, params)
    assert first.num_cached_tokens == 0 and first.queued_seconds is not None and first.queued_seconds >= 0
    load = engine.load()
    assert (load.num_prefix_query_tokens, load.num_prefix_hit_tokens) == (20, 0)
    run(engine, "b", prompt, params)  # the same prompt: its two full blocks hit
    load = engine.load()
    assert (load.num_prefix_query_tokens, load.num_prefix_hit_tokens) == (40, 16)
    metrics.update(load)
    assert _value(registry, "vllm:prefix_cache_queries_total") == 40
    assert _value(registry, "vllm:prefix_cache_hits_total") == 16
    metrics.update(engine.load())  # no new work: the counters do not move
    assert _value(registry, "vllm:prefix_cache_queries_total") == 40
    assert _value(registry, "vllm:num_requests_running") == 0
    assert _value(registry, "vllm:kv_cache_usage_perc") == 0


def test_preemptions_reach_the_load_and_the_counter(tmp_path):
    make_model(str(tmp_path / "m"))
    # 6 blocks of 4 tokens; two requests of 10 prompt + 8 output need 10: one is preempted.
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "m"), block_size=4, num_kv_blocks=6, max_model_len=24,
                                    enable_prefix_caching=False))
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "tiny")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request(EngineRequest("a", list(range(10, 20)), params))
    engine.add_request(EngineRequest("b", list(range(50, 60)), params))
    queued: dict[str, float | None] = {}
    busy = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                queued[out.request_id] = out.queued_seconds
        load = engine.load()
        busy = busy or load.num_running > 0
        metrics.update(load)
    assert busy and engine.scheduler.num_preemptions >= 1
    assert engine.load().num_preemptions == engine.scheduler.num_preemptions
    assert _value(registry, "vllm:num_preemptions_total") == engine.scheduler.num_preemptions
    assert set(queued) == {"a", "b"} and all(q is not None and q >= 0 for q in queued.values())


def test_each_step_drained_is_observed_once():
    from collections import deque

    from shared.engine.outputs import EngineLoad

    steps: deque[int] = deque([3, 5])
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "tiny", steps)
    idle = EngineLoad(num_running=0, num_waiting=0, num_free_kv_blocks=4, num_total_kv_blocks=4, num_queued_tokens=0)
    metrics.update(idle)
    assert _value(registry, "vllm:iteration_tokens_total_count") == 2 and not steps
    steps.append(7)
    metrics.update(idle)
    metrics.update(idle)  # nothing stepped since: the count stays
    assert _value(registry, "vllm:iteration_tokens_total_count") == 3
    assert _value(registry, "vllm:iteration_tokens_total_sum") == 3 + 5 + 7
