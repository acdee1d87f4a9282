"""The vision stage in the planner: plan()'s vision replicas follow the images/s of the
workload and of the profile's encoder by the documented formula, an encoder too slow
for the TTFT target is named as such, profiles without vision points still load, and
the live planner sizes vision from the images the balancer's /metrics counts and hands
the count to its scaler (the supervisor's replicas file)."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from services.planner.observe import observe
from services.planner.plan import InfeasibleTarget, Lengths, Targets, Workload, plan
from services.planner.profile import Profile, VisionPoint
from services.planner.scalers import AdvisoryScaler, ReplicasFileScaler
from services.planner.service import LivePlanner
from shared.runtime.metrics import Metrics
from shared.runtime.settings import PlannerSettings
from tests.helpers.planner_metrics import BalancerSeries
from tools.planner.synthetic_profile import synthetic_profile

WORKLOAD = Workload(40.0, Lengths(2000, 4000), Lengths(200, 400), prefix_hit_rate=0.5, images_per_request=2)
TARGETS = Targets(ttft_ms=600, itl_ms=30)


def one_encoder_point(images_per_s: float, latency_ms: float = 40.0) -> Profile:
    """The synthetic profile with a single vision point: the plan has no encoder point to choose."""
    return dataclasses.replace(synthetic_profile(), vision=[VisionPoint(4, images_per_s, latency_ms)])


def test_vision_replicas_follow_the_images_per_second_formula() -> None:
    for rate in (10.0, 25.0, 80.0):
        planned = plan(one_encoder_point(rate), WORKLOAD, TARGETS, 2.0)
        assert planned.replicas["vision"] == math.ceil(40.0 * 2 / rate)
    # A faster encoder (every point 4x the images/s) needs fewer encoders, by the formula at its chosen point.
    profile, many = synthetic_profile(), dataclasses.replace(WORKLOAD, images_per_request=20)
    base = plan(profile, many, TARGETS, 2.0)
    faster = dataclasses.replace(profile, vision=[dataclasses.replace(v, images_per_s=v.images_per_s * 4)
                                                  for v in profile.vision])
    quick = plan(faster, many, TARGETS, 2.0)
    assert base.vision is not None and quick.vision is not None
    assert base.replicas["vision"] == math.ceil(40.0 * 20 / base.vision.images_per_s)
    assert quick.replicas["vision"] == math.ceil(40.0 * 20 / quick.vision.images_per_s)
    assert quick.replicas["vision"] < base.replicas["vision"]
    # Twice the images per request, twice the images/s to encode.
    doubled = plan(one_encoder_point(10.0), dataclasses.replace(WORKLOAD, images_per_request=4), TARGETS, 2.0)
    assert doubled.replicas["vision"] == math.ceil(40.0 * 4 / 10.0)
    assert plan(one_encoder_point(10.0), dataclasses.replace(WORKLOAD, images_per_request=0), TARGETS,
                2.0).replicas["vision"] == 0


def test_an_encoder_slower_than_the_ttft_target_is_named() -> None:
    with pytest.raises(InfeasibleTarget, match="vision encoder alone takes 700.0 ms") as info:
        plan(one_encoder_point(50.0, latency_ms=700.0), WORKLOAD, TARGETS, 2.0)
    assert info.value.stage == "vision" and info.value.target == "TTFT" and info.value.best_ms > 700
    # The same encoder for a text-only load plans: only images pay its latency.
    assert plan(one_encoder_point(50.0, 700.0), dataclasses.replace(WORKLOAD, images_per_request=0), TARGETS, 2.0)


def test_a_profile_without_vision_points_still_loads() -> None:
    raw = json.loads(synthetic_profile().to_json())
    del raw["vision"], raw["transfer"]  # as a profile written before either was measured
    profile = Profile.from_json(json.dumps(raw))
    assert profile.vision == [] and profile.transfer.kvcache_gb_s is None


def test_observe_counts_the_images_the_vision_stage_is_sized_for() -> None:
    b = BalancerSeries()
    before = b.scrape()
    b.interval(100, {"vision": 150, "prefill": 50, "prefill_small": 400})
    obs = observe(before, b.scrape(), interval_s=10.0, percentile=90)
    assert obs.images_per_s == 20.0  # vision + prefill's fallback; the small images prefill takes on purpose are not


def live(tmp_path: Path, profile: Profile, started_with: dict[str, int], b: BalancerSeries) -> tuple[LivePlanner, Path]:
    settings = PlannerSettings(interval_s=10.0, startup_s=10.0, ttft_ms=600, itl_ms=30, backend="up",
                               replicas_file=str(tmp_path / "replicas.json"), max_replicas=64)
    scaler = ReplicasFileScaler(tmp_path / "replicas.json", started_with=started_with)
    return LivePlanner(settings, profile, scaler, Metrics("planner"), read=b.scrape), tmp_path / "replicas.json"


def test_the_live_planner_sizes_vision_from_the_images_routed_and_scales_it(tmp_path: Path) -> None:
    b, profile = BalancerSeries(), one_encoder_point(10.0)
    planner, replicas_file = live(tmp_path, profile, {"prefill": 1, "decode": 1, "vision": 1}, b)
    assert planner.step(10.0) is None  # the first scrape: nothing to difference
    b.interval(200, {"vision": 600})  # 20 req/s, 3 images each (60 images/s)
    decision = planner.step(10.0)
    assert decision is not None and not decision.infeasible
    f = decision.forecast.requests_per_s
    assert decision.replicas["vision"] == math.ceil(f * 3 / 10.0) > 1
    assert json.loads(replicas_file.read_text())["vision"] == decision.replicas["vision"]  # the supervisor's file
    assert planner.metrics.registry.get_sample_value("infermesh_planner_replicas",
                                                     {"stage": "vision"}) == decision.replicas["vision"]
    # An interval without images: vision goes to 0 (prefill encodes any that come, and they count).
    b.interval(200, {})
    assert planner.step(10.0).replicas["vision"] == 0  # type: ignore[union-attr]


def test_vision_is_planned_only_where_deployed_and_profiled(tmp_path: Path) -> None:
    b = BalancerSeries()
    (tmp_path / "x").mkdir()
    text_mesh, _ = live(tmp_path, one_encoder_point(10.0), {"prefill": 1, "decode": 1}, b)
    no_points, _ = live(tmp_path / "x", dataclasses.replace(synthetic_profile(), vision=[]),
                        {"prefill": 1, "decode": 1, "vision": 1}, b)
    for planner in (text_mesh, no_points):
        planner.step(10.0)
    b.interval(200, {"vision": 600})
    for planner in (text_mesh, no_points):
        decision = planner.step(10.0)
        assert decision is not None and "vision" not in decision.replicas


def test_an_encoder_too_slow_for_the_target_holds_vision_and_is_counted(tmp_path: Path) -> None:
    b = BalancerSeries()
    planner, _ = live(tmp_path, one_encoder_point(10.0, latency_ms=700.0), {"prefill": 2, "decode": 1, "vision": 3}, b)
    planner.scaler = AdvisoryScaler({"prefill": 2, "decode": 1, "vision": 3})
    planner.step(10.0)
    b.interval(200, {"vision": 600})
    decision = planner.step(10.0)
    assert decision is not None and decision.replicas["vision"] == 3
    assert "vision encoder alone takes 700.0 ms" in decision.infeasible["vision"]
    assert planner.metrics.registry.get_sample_value("infermesh_planner_infeasible_total", {"stage": "vision"}) == 1
