"""tools/bench/routing_bench.py: the figures' arithmetic, then a real run of both
meshes (always disaggregated, conditional) on the seeded default model, checking
what the balancers did against what the bench reports."""

import json

import pytest

from tools.bench.openai_stream import RequestResult
from tools.bench.routing_bench import compare, figures, run_routing_bench


def test_the_cache_share_and_the_ratios():
    ok = RequestResult(True, 0.0, ttft_s=0.1, e2e_s=0.2, num_prompt_tokens=100, num_output_tokens=4,
                       num_cached_tokens=64)  # fmt: skip
    failed = RequestResult(False, 0.0, num_prompt_tokens=50, num_cached_tokens=50, error="HTTP 503")
    f = figures([ok, ok, failed], 2.0, 2, {"local": 3.0, "remote": 1.0})
    assert f["cached_tokens"] == 128 and f["cached_share"] == 0.64  # failed requests count nowhere
    assert (f["prompts_on_decode"], f["prompts_on_prefill"], f["completed"], f["failed"]) == (3, 1, 2, 1)
    rows = {"disaggregated": {"median_ttft_ms": 100.0, "p90_ttft_ms": 200.0, "output_throughput": 50.0},
            "conditional": {"median_ttft_ms": 60.0, "p90_ttft_ms": 250.0, "output_throughput": 75.0}}  # fmt: skip
    assert compare(rows) == {"ttft_p50": 0.6, "ttft_p90": 1.25, "output_throughput": 1.5}


def test_both_meshes_serve_every_turn_and_only_the_conditional_one_computes_on_decode(mesh_model_dir, tmp_path):
    report = run_routing_bench(mesh_model_dir, num_decode=2, conversations=2, turns=2, concurrency=2, input_len=8,
                               output_len=24, max_local_tokens=4096, rounds=1, json_path=str(tmp_path / "r.json"))  # fmt: skip
    rows = report["rows"]
    for config in ("disaggregated", "conditional"):
        r = rows[config]
        assert (r["completed"], r["failed"]) == (4, 0), r["errors"]
        assert r["prompts_on_decode"] + r["prompts_on_prefill"] == 4  # the balancer's count, this run's requests
        assert 0 <= r["cached_tokens"] <= r["total_input_tokens"]
    assert rows["disaggregated"]["prompts_on_decode"] == 0
    assert rows["conditional"]["prompts_on_decode"] == 4  # every prompt is short of 4096 tokens
    assert json.loads((tmp_path / "r.json").read_text())["compare"] == pytest.approx(report["compare"], nan_ok=True)
