"""vLLM-compatible metrics, scraped off a real mesh (nats-server, kvcache,
prefill, decode and the balancer as processes): the vllm:* series with the
model_name label each process exports, and values that move by exactly what
the requests sent did."""

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import openai
import promql_parser
import pytest

from shared.runtime.vllm_metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, one_two_five_buckets
from tests.helpers.metrics import Samples, sample as value, scrape

MESH = dict(
    num_prefill=1,
    num_decode=1,
    extra_env={"INFERMESH_ENGINE__BLOCK_SIZE": "16", "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.2"},
)
BLOCK_SIZE = 16

BALANCER_SERIES = {
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket", "vllm:request_success_total",
    "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket",
    "vllm:request_inference_time_seconds_bucket",
}  # fmt: skip
WORKER_SERIES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:iteration_tokens_total_bucket", "vllm:cache_config_info",
}  # fmt: skip

def wait_for(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the metrics did not move in time"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def urls(mesh) -> dict[str, str]:
    ports = mesh.metrics_ports
    return {
        "balancer": mesh.api_url.removesuffix("/v1") + "/metrics",
        **{name: f"http://127.0.0.1:{ports[name]}/metrics" for name in ("prefill-0", "decode-0")},
    }


def test_buckets_are_vllms_and_reach_past_ten_minutes():
    assert TTFT_BUCKETS[-1] >= 600 and REQUEST_LATENCY_BUCKETS[-1] >= 600
    assert one_two_five_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five_buckets(4096)[-3:] == (500, 1000, 2000)


def test_every_process_exports_its_vllm_series_with_model_name(mesh, urls):
    model = openai.OpenAI(base_url=mesh.api_url, api_key="x").models.list().data[0].id
    for process, expected in (("balancer", BALANCER_SERIES), ("prefill-0", WORKER_SERIES), ("decode-0", WORKER_SERIES)):
        samples = scrape(urls[process])
        vllm = {(n, ls) for n, ls in samples if n.startswith("vllm:")}
        assert expected <= {n for n, _ in vllm}, f"{process} lacks {expected - {n for n, _ in vllm}}"
        assert all(dict(ls).get("model_name") == model for _, ls in vllm), process
    # Each series comes from one kind of process: summed over the mesh, nothing counts twice.
    balancer = {n for n, _ in scrape(urls["balancer"])}
    assert not balancer & WORKER_SERIES
    assert not {n for n, _ in scrape(urls["decode-0"])} & BALANCER_SERIES
    assert "vllm:request_queue_time_seconds_count" in {n for n, _ in scrape(urls["prefill-0"])}
    # The mesh's own series stay beside them (the dashboard and the HPAs read these).
    assert {"infermesh_balancer_time_to_first_token_seconds_count", "infermesh_balancer_requests_total"} <= balancer
    assert "infermesh_decode_running_requests" in {n for n, _ in scrape(urls["decode-0"])}
    reasons = {dict(ls)["finished_reason"] for n, ls in scrape(urls["balancer"]) if n == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort", "error"}


def test_values_move_with_the_requests_sent(mesh, urls):
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    before = {p: scrape(u) for p, u in urls.items()}
    prompt = "def quicksort(xs):\n    " * 6
    usages = [
        client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}).usage
        for _ in range(3)
    ]
    num_prompt = usages[0].prompt_tokens
    assert all(u.prompt_tokens == num_prompt and u.completion_tokens == 6 for u in usages)

    b0, b1 = before["balancer"], scrape(urls["balancer"])

    def grew(name: str, samples0: Samples = b0, samples1: Samples | None = None, **labels: str) -> float:
        return value(samples1 or b1, name, **labels) - value(samples0, name, **labels)

    assert grew("vllm:request_success_total", finished_reason="length") == 3
    assert grew("vllm:request_success_total", finished_reason="stop") == 0
    assert grew("vllm:prompt_tokens_total") == 3 * num_prompt
    assert grew("vllm:generation_tokens_total") == 18
    assert grew("vllm:request_prompt_tokens_sum") == 3 * num_prompt
    assert grew("vllm:request_generation_tokens_sum") == 18
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_time_per_output_token_seconds"):
        assert grew(f"vllm:{histogram}_count") == 3, histogram
        assert grew(f"vllm:{histogram}_sum") > 0, histogram
    # One gap per token event after the first: at most 5 per request of 6 tokens.
    assert 3 <= grew("vllm:inter_token_latency_seconds_count") <= 15
    # TTFT and TPOT fit inside end-to-end latency.
    e2e = grew("vllm:e2e_request_latency_seconds_sum")
    assert grew("vllm:time_to_first_token_seconds_sum") < e2e

    # Workers: prefill looked each prompt up in its prefix cache; the 2nd and 3rd hit
    # every full block but the one holding the last token (the step needs its logits).
    p0 = before["prefill-0"]
    full_blocks = (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    wait_for(lambda: grew("vllm:prefix_cache_queries_total", p0, scrape(urls["prefill-0"])) == 3 * num_prompt)
    p1 = scrape(urls["prefill-0"])
    assert grew("vllm:prefix_cache_hits_total", p0, p1) == 2 * full_blocks
    assert grew("vllm:request_queue_time_seconds_count", p0, p1) == 3
    d0 = before["decode-0"]
    wait_for(lambda: grew("vllm:prefix_cache_queries_total", d0, scrape(urls["decode-0"])) > 0)
    for process in ("prefill-0", "decode-0"):
        now = scrape(urls[process])
        assert value(now, "vllm:num_requests_running") == 0 and value(now, "vllm:num_requests_waiting") == 0
        assert 0 <= value(now, "vllm:kv_cache_usage_perc") <= 1
        assert value(now, "vllm:num_preemptions_total") == 0


def test_request_phases_and_engine_steps(mesh, urls):
    """The balancer's phases of each request add up (prefill + decode = inference,
    inside end-to-end latency; prefill inside the time to first token); each
    worker's steps add up to the tokens its engine computed; the cache's
    configuration is the one the mesh was started with."""
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    before = {p: scrape(u) for p, u in urls.items()}
    prompt = "class Stack:\n    def push(self, item):\n        " * 4  # sent by no other test: nothing cached
    num_requests, max_tokens = 3, 5
    usages = [
        client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True}).usage
        for _ in range(num_requests)
    ]
    num_prompt = usages[0].prompt_tokens
    b0, b1 = before["balancer"], scrape(urls["balancer"])

    def grew(name: str, samples0: Samples = b0, samples1: Samples | None = None) -> float:
        return value(samples1 or b1, name) - value(samples0, name)

    for phase in ("prefill", "decode", "inference"):
        assert grew(f"vllm:request_{phase}_time_seconds_count") == num_requests, phase
        assert grew(f"vllm:request_{phase}_time_seconds_sum") > 0, phase
    prefill, decode = grew("vllm:request_prefill_time_seconds_sum"), grew("vllm:request_decode_time_seconds_sum")
    inference = grew("vllm:request_inference_time_seconds_sum")
    assert prefill + decode == pytest.approx(inference, rel=1e-9, abs=1e-9)
    assert inference <= grew("vllm:e2e_request_latency_seconds_sum")
    assert prefill <= grew("vllm:time_to_first_token_seconds_sum")

    # Prefill computes each prompt but the blocks its prefix cache already held
    # (the 2nd and 3rd prompt hit every full block before the last token).
    p0 = before["prefill-0"]
    full_blocks = (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    computed = num_requests * num_prompt - (num_requests - 1) * full_blocks
    wait_for(lambda: grew("vllm:iteration_tokens_total_sum", p0, scrape(urls["prefill-0"])) == computed)
    # The prefix cache counters come from the engine's last published load, which may
    # trail the step counts by a heartbeat: wait for them too.
    hits = (num_requests - 1) * full_blocks
    wait_for(lambda: grew("vllm:prefix_cache_hits_total", p0, scrape(urls["prefill-0"])) == hits)
    p1 = scrape(urls["prefill-0"])
    assert grew("vllm:prefix_cache_hits_total", p0, p1) == hits
    assert grew("vllm:iteration_tokens_total_count", p0, p1) == num_requests  # a prompt fits one step's budget
    # Decode computes what it neither hit nor got handed (the prompt's last partial block
    # and the first token), in the step that samples the 2nd token, then one token per
    # step for each further one (the last sampled token is never computed).
    d0 = before["decode-0"]
    num_steps = num_requests * (max_tokens - 1)
    wait_for(lambda: grew("vllm:iteration_tokens_total_count", d0, scrape(urls["decode-0"])) == num_steps)

    def missed_of(d1: Samples) -> float:
        return grew("vllm:prefix_cache_queries_total", d0, d1) - grew("vllm:prefix_cache_hits_total", d0, d1)

    expected_missed = num_requests * (num_prompt + 1 - full_blocks)
    wait_for(lambda: missed_of(scrape(urls["decode-0"])) == expected_missed)  # the load may trail a heartbeat
    d1 = scrape(urls["decode-0"])
    missed = missed_of(d1)
    assert missed == expected_missed
    assert grew("vllm:iteration_tokens_total_sum", d0, d1) == missed + num_requests * (max_tokens - 2)
    # Each of those steps by how it ran: on the CPU async scheduling is off by default,
    # so every one is synchronous (a GPU's would be overlapped).
    steps = "infermesh_decode_engine_steps_total"

    def steps_grew(d: Samples, how: str) -> float:
        return value(d, steps, how=how) - value(d0, steps, how=how)

    wait_for(lambda: steps_grew(scrape(urls["decode-0"]), "synchronous") == num_steps)
    d2 = scrape(urls["decode-0"])
    assert steps_grew(d2, "overlapped") == steps_grew(d2, "sampled_after_read_back") == 0
    for process in ("prefill-0", "decode-0"):
        now = scrape(urls[process])
        stage = process.split("-")[0]
        (labels,) = [dict(ls) for n, ls in now if n == "vllm:cache_config_info"]
        assert value(now, "vllm:cache_config_info", **labels) == 1
        assert labels["block_size"] == str(BLOCK_SIZE) and labels["enable_prefix_caching"] == "True"
        assert labels["model_name"] == model and labels["cache_dtype"] == "float32"
        assert int(labels["num_gpu_blocks"]) == value(now, f"infermesh_{stage}_kv_total_blocks") > 0


def test_requests_that_end_without_finishing_count_as_abort_or_error():
    """The balancer's clock around a request's generation: the client leaving (the
    generator closed, or its task cancelled) is "abort"; a failure is "error"; a
    finish counts its reason, and only finished requests reach the mesh's own E2E."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from services.balancer.generation import Usage
    from services.balancer.frontend.http_metrics import HttpMetrics
    from shared.runtime.metrics import Metrics

    metrics = Metrics("balancer")
    stats = HttpMetrics(metrics, "tiny", max_model_len=64)
    registry: CollectorRegistry = metrics.registry

    def count(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {"model_name": "tiny", **labels}) or 0.0

    async def generation(end: str, tokens_sent: asyncio.Event | None = None) -> None:
        async with stats.clock(time.monotonic(), num_prompt_tokens=7) as clock:
            clock.tokens(1)
            clock.tokens(2)
            if end == "error":
                raise RuntimeError("the generator failed")
            if end == "abort":
                tokens_sent.set()
                await asyncio.sleep(10)  # cancelled here, as when the client leaves
            clock.finished("length", Usage(7, 3, 0))

    async def run_all() -> None:
        await generation("finish")
        with pytest.raises(RuntimeError):
            await generation("error")
        tokens_sent = asyncio.Event()
        task = asyncio.create_task(generation("abort", tokens_sent))
        await tokens_sent.wait()  # 0.05 s after its tokens, however late a loaded machine ran the task
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run_all())
    reasons = {r: count("vllm:request_success_total", finished_reason=r) for r in ("stop", "length", "abort", "error")}
    assert reasons == {"stop": 0, "length": 1, "abort": 1, "error": 1}
    assert count("vllm:e2e_request_latency_seconds_count") == 3
    assert count("vllm:prompt_tokens_total") == 21 and count("vllm:generation_tokens_total") == 9
    assert count("vllm:time_to_first_token_seconds_count") == 3 and count("vllm:inter_token_latency_seconds_count") == 3
    assert count("vllm:request_time_per_output_token_seconds_count") == 3  # three tokens each
    # Every request reached its first token: each has its three phases, which add up.
    for phase in ("prefill", "decode", "inference"):
        assert count(f"vllm:request_{phase}_time_seconds_count") == 3, phase
    phases = count("vllm:request_prefill_time_seconds_sum") + count("vllm:request_decode_time_seconds_sum")
    assert phases == pytest.approx(count("vllm:request_inference_time_seconds_sum"), abs=1e-9)
    assert count("vllm:request_decode_time_seconds_sum") >= 0.05  # the aborted one waited 0.05 s after its tokens
    assert registry.get_sample_value("infermesh_balancer_e2e_request_latency_seconds_count") == 1
    assert registry.get_sample_value("infermesh_balancer_completion_tokens_total") == 3


DASHBOARD = Path(__file__).parents[2] / "deploy" / "helm" / "infermesh" / "files" / "grafana-dashboard.json"
VLLM_PANEL_SERIES = {
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total", "vllm:request_success_total",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket", "vllm:request_inference_time_seconds_bucket",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:iteration_tokens_total_bucket", "vllm:cache_config_info",
}  # fmt: skip
"""What vLLM's own dashboards plot, and the phases, step sizes and cache config beside them."""


def promql_names(expr: str) -> set[str]:
    """The metric names a panel's PromQL selects (Grafana's $__ intervals as a duration)."""
    names: set[str] = set()

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(re.sub(r"\$__\w+", "1m", expr)), visit)
    return names


def test_every_dashboard_panel_reads_series_the_mesh_exports(mesh, urls):
    """The Grafana dashboard, loaded as Grafana would: every panel's every query names
    only series a scrape of the running mesh (balancer, prefill, decode, kvcache)
    finds, and the vLLM panels cover vLLM's series."""
    client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    client.completions.create(model=model, prompt="import os\n", max_tokens=3, temperature=0)
    targets = {**urls, "kvcache": f"http://127.0.0.1:{mesh.metrics_ports['kvcache']}/metrics"}
    wait_for(lambda: "infermesh_decode_requests_total" in {n for n, _ in scrape(targets["decode-0"])})
    exported = {name for url in targets.values() for name, _ in scrape(url)}

    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "model_name"} <= variables
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    used: set[str] = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = promql_names(target["expr"])
            assert names, target["expr"]
            assert names <= exported, f"panel {panel['title']!r} reads {names - exported}, which the mesh does not export"
            if any(n.startswith("vllm:") for n in names):
                assert 'model_name=~"$model_name"' in target["expr"], target["expr"]  # the Model selector applies
            used |= names
    assert VLLM_PANEL_SERIES <= used, VLLM_PANEL_SERIES - used
    # The check is not vacuous: a misspelt series is not exported.
    assert not promql_names("rate(vllm:time_to_first_token_second_bucket[$__rate_interval])") <= exported
