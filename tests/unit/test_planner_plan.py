"""plan(): replicas follow from the profile by the documented formula, targets are
never relaxed, and cost is allocated by GPU time per token class."""

import dataclasses
import math

import pytest

from services.planner.plan import InfeasibleTarget, Lengths, Targets, Workload, plan
from services.planner.profile import Profile
from services.planner.stage_model import StageModels
from tools.cli import main as cli_main
from tools.planner.synthetic_profile import synthetic_profile

WORKLOAD = Workload(40.0, Lengths(2000, 4000), Lengths(200, 400), prefix_hit_rate=0.5)
TARGETS = Targets(ttft_ms=600, itl_ms=30)


def _expected(profile: Profile, workload: Workload, targets: Targets) -> dict[str, int]:
    """The module docstring's formula, computed here from the stage models."""
    models, miss = StageModels.from_profile(profile), 1 - workload.prefix_hit_rate
    t = profile.transfer
    load_ms = workload.input_tokens.p90 * workload.prefix_hit_rate * t.kv_bytes_per_token / (t.kvcache_gb_s * 1e9) * 1e3
    p = models.prefill.max_load(workload.input_tokens.p90 * miss, workload.input_tokens.mean * miss,
                                targets.ttft_ms - load_ms)
    ctx_p = workload.input_tokens.p90 + workload.output_tokens.p90 / 2
    d = models.decode.max_load(ctx_p, workload.input_tokens.mean + workload.output_tokens.mean / 2, targets.itl_ms)
    return {"prefill": math.ceil(workload.requests_per_s * workload.input_tokens.mean * miss / p.tokens_per_s),
            "decode": math.ceil(workload.requests_per_s * workload.output_tokens.mean / d.tokens_per_s), "vision": 0}


def test_replicas_follow_the_formula_and_a_faster_prefill_changes_them_as_it_says():
    profile = synthetic_profile()
    planned = plan(profile, WORKLOAD, TARGETS, 2.0)
    assert planned.replicas == _expected(profile, WORKLOAD, TARGETS)
    assert planned.predicted_ttft_ms <= TARGETS.ttft_ms and planned.predicted_itl_ms <= TARGETS.itl_ms

    doubled = dataclasses.replace(profile, prefill=[dataclasses.replace(p, tokens_per_s=p.tokens_per_s * 2)
                                                    for p in profile.prefill])
    faster = plan(doubled, WORKLOAD, TARGETS, 2.0)
    per_instance = planned.replicas["prefill"]
    demand = WORKLOAD.requests_per_s * WORKLOAD.input_tokens.mean * (1 - WORKLOAD.prefix_hit_rate)
    chosen = StageModels.from_profile(profile).prefill.max_load(2000, 1000, TARGETS.ttft_ms - planned.kv_load_ms)
    assert faster.replicas["prefill"] == math.ceil(demand / (2 * chosen.tokens_per_s)) < per_instance
    assert faster.replicas["decode"] == planned.replicas["decode"]

    busier = plan(profile, dataclasses.replace(WORKLOAD, requests_per_s=WORKLOAD.requests_per_s * 3), TARGETS, 2.0)
    assert busier.replicas == _expected(profile, dataclasses.replace(WORKLOAD, requests_per_s=120.0), TARGETS)
    assert busier.replicas["decode"] > planned.replicas["decode"]


def test_an_unmeetable_ttft_is_reported_with_the_best_achievable_not_relaxed():
    profile = synthetic_profile()
    models = StageModels.from_profile(profile)
    best = models.prefill.best_ttft_ms(4000 * 0.5) + plan(profile, WORKLOAD, TARGETS, 2.0).kv_load_ms
    with pytest.raises(InfeasibleTarget) as caught:
        plan(profile, WORKLOAD, dataclasses.replace(TARGETS, ttft_ms=best - 0.5), 2.0)
    assert caught.value.target == "TTFT" and caught.value.best_ms == pytest.approx(best)
    ok = plan(profile, WORKLOAD, dataclasses.replace(TARGETS, ttft_ms=best + 0.5), 2.0)
    assert ok.predicted_ttft_ms <= best + 0.5


def test_an_unmeetable_itl_is_reported():
    profile = synthetic_profile()
    best = StageModels.from_profile(profile).decode.best_itl_ms(4000 + 200)
    with pytest.raises(InfeasibleTarget, match=r"ITL target .* best this profile achieves is") as caught:
        plan(profile, WORKLOAD, dataclasses.replace(TARGETS, itl_ms=best * 0.99), 2.0)
    assert caught.value.best_ms == pytest.approx(best)


def test_cost_is_allocated_by_gpu_time_per_class():
    profile = synthetic_profile()
    planned = plan(profile, WORKLOAD, TARGETS, 3.0)
    out, hit, miss = (planned.classes[k] for k in ("output", "cache_hit_input", "uncached_input"))
    output_tokens_per_hour = WORKLOAD.requests_per_s * WORKLOAD.output_tokens.mean * 3600
    assert out.usd_per_million == pytest.approx(planned.gpus["decode"] * 3.0 * 1e6 / output_tokens_per_hour)
    assert hit.gpus_charged + miss.gpus_charged == pytest.approx(planned.gpus["prefill"])
    # Loading a cached token costs less prefill time than computing one, so it is cheaper.
    assert 0 < hit.usd_per_million < miss.usd_per_million
    assert sum(c.gpus_charged for c in planned.classes.values()) * 3.0 == pytest.approx(planned.usd_per_hour)
    no_rates = dataclasses.replace(profile, transfer=dataclasses.replace(profile.transfer, kvcache_gb_s=None))
    free = plan(no_rates, WORKLOAD, TARGETS, 3.0)
    assert free.classes["cache_hit_input"].usd_per_million == 0 and "charged nothing" in free.notes[0]


def test_images_add_encoders_and_their_latency():
    profile = synthetic_profile()
    with_images = plan(profile, dataclasses.replace(WORKLOAD, images_per_request=2), TARGETS, 2.0)
    assert with_images.vision is not None and with_images.replicas["vision"] == math.ceil(
        WORKLOAD.requests_per_s * 2 / with_images.vision.images_per_s)
    assert with_images.predicted_ttft_ms <= TARGETS.ttft_ms
    no_vision = dataclasses.replace(profile, vision=[])
    with pytest.raises(ValueError, match="no vision points"):
        plan(no_vision, dataclasses.replace(WORKLOAD, images_per_request=1), TARGETS, 2.0)


def test_profile_json_round_trip(tmp_path):
    profile = synthetic_profile()
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile


def test_lengths_percentiles():
    assert Lengths.of_samples([5, 1, 3, 2, 4, 6, 7, 8, 9, 10]).quantile(90) == 9
    assert Lengths(100).quantile(99) == 100
    with pytest.raises(ValueError, match="give samples to plan for p99"):
        Lengths(100, 300).quantile(99)


def test_cli_plan_prints_the_plan_writes_values_and_fails_when_infeasible(tmp_path, capsys):
    synthetic_profile().save(tmp_path / "p.json")
    args = ["plan", "--profile", str(tmp_path / "p.json"), "--rps", "40", "--isl", "2000", "--isl-p90", "4000",
            "--osl", "200", "--osl-p90", "400", "--prefix-hit", "0.5", "--itl-ms", "30", "--gpu-hour-usd", "2"]
    assert cli_main([*args, "--ttft-ms", "600", "--values-out", str(tmp_path / "v.yaml")]) == 0
    out = capsys.readouterr().out
    expected = plan(synthetic_profile(), WORKLOAD, TARGETS, 2.0)
    assert f"prefill {expected.replicas['prefill']} (" in out and f"decode {expected.replicas['decode']} (" in out
    assert "cache_hit_input" in out and (tmp_path / "v.yaml").is_file()
    assert cli_main([*args, "--ttft-ms", "50"]) == 3
    err = capsys.readouterr().err
    assert "infeasible: TTFT target 50 ms cannot be met" in err
