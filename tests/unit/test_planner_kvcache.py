"""The profile's kvcache round and the vision round's size axis, off the mesh: the
round's figures from the prefill workers' counters (path="kvcache" only), the sweep's
kvcache_gb_s over every timed round, plan() pricing a cache hit at it; vision figures
read at the workload's image size between the profiled sizes, and profiles written
before either (one image size, no kvcache points) still load and plan as before."""

import dataclasses
import json

import pytest

from services.planner.plan import Lengths, Targets, Workload, plan
from services.planner.profile import KVCachePoint, Profile, TransferRates, VisionPoint
from services.planner.stage_model import VisionModel
from tools.planner.kvcache_round import BYTES, SECONDS, TOKENS, kvcache_figures
from tools.planner.points import RoundFailed
from tools.planner.report import Measured
from tools.planner.sweep import SweepConfig, _kvcache_gb_s
from tools.planner.synthetic_profile import synthetic_profile


def prefill_scrape(kvcache_bytes: float, seconds: float, tokens: float, host_bytes: float = 0.0) -> dict:
    def key(name: str, label: str, value: str) -> tuple[str, frozenset[tuple[str, str]]]:
        return name, frozenset({(label, value)})

    return {key(BYTES, "path", "kvcache"): kvcache_bytes, key(BYTES, "path", "host"): host_bytes,
            key(SECONDS, "path", "kvcache"): seconds, key(SECONDS, "path", "host"): host_bytes / 1e9,
            key(TOKENS, "source", "kvcache"): tokens, key(TOKENS, "source", "local"): 999.0}


def test_a_rounds_rate_is_the_kvcache_bytes_over_their_seconds() -> None:
    before = [prefill_scrape(1e9, 1.0, 100), prefill_scrape(0, 0, 0)]
    after = [prefill_scrape(1e9 + 4096 * 192, 1.002, 292, host_bytes=5e9), prefill_scrape(0, 0, 0)]
    r = kvcache_figures(0.030, 0.050, 192, before, after, wall_s=0.2)
    assert r.loaded_bytes == 4096 * 192 and r.load_s == pytest.approx(0.002)
    assert r.gb_s == pytest.approx(4096 * 192 / 0.002 / 1e9)  # the host tier's bytes are not kvcache's
    assert r.bytes_per_token == 4096 and (r.ttft_hit_ms, r.ttft_uncached_ms) == pytest.approx((30.0, 50.0))


def test_a_round_that_loaded_nothing_from_kvcache_fails_naming_why() -> None:
    same = [prefill_scrape(1e9, 1.0, 100)]
    with pytest.raises(RoundFailed, match="not loaded from kvcache"):
        kvcache_figures(0.03, 0.05, 0, same, same, 0.1)


def test_the_profiles_kvcache_rate_is_every_timed_rounds_bytes_over_their_seconds() -> None:
    def rounds(*pairs: tuple[float, float]) -> list[dict[str, float]]:
        return [{"loaded_bytes": b, "load_s": s} for b, s in pairs]

    measured = [Measured("kvcache", (512, 1), rounds((1e9, 1.0), (1e9, 1.0))),
                Measured("kvcache", (2048, 1), rounds((4e9, 1.0))), Measured("prefill", (512, 1), rounds((9e9, 1.0)))]
    assert _kvcache_gb_s(measured) == pytest.approx(2.0)  # 6 GB in 3 s; prefill's rounds are not kvcache's
    assert _kvcache_gb_s(measured[2:]) is None


def test_plan_charges_a_cache_hit_at_the_profiles_kvcache_rate() -> None:
    base = synthetic_profile()
    workload = Workload(10.0, Lengths(4000), Lengths(100), prefix_hit_rate=0.5)
    targets = Targets(ttft_ms=2000, itl_ms=50)
    slow, fast = (dataclasses.replace(base, transfer=TransferRates(kvcache_gb_s=rate, kv_bytes_per_token=131072))
                  for rate in (1.0, 4.0))  # fmt: skip
    unmeasured = dataclasses.replace(base, transfer=TransferRates(kv_bytes_per_token=131072))
    p_slow, p_fast = plan(slow, workload, targets, 2.0), plan(fast, workload, targets, 2.0)
    assert p_slow.kv_load_ms == pytest.approx(2000 * 131072 / 1e9 * 1e3)  # 2000 hit tokens at 1 GB/s
    assert p_fast.kv_load_ms == pytest.approx(p_slow.kv_load_ms / 4)
    assert not any("cache-hit load time not in the profile" in n for n in p_fast.notes)
    assert any("cache-hit load time not in the profile" in n for n in plan(unmeasured, workload, targets, 2.0).notes)


SIZED = [VisionPoint(1, 100.0, 10.0, 224), VisionPoint(1, 25.0, 40.0, 448),
         VisionPoint(4, 200.0, 20.0, 224), VisionPoint(4, 50.0, 80.0, 448)]


def test_vision_figures_are_read_at_the_image_size_by_pixels() -> None:
    model = VisionModel(SIZED)
    at = {op.concurrency: op for op in model.operating_points(224)}
    assert (at[1].latency_ms, at[1].images_per_s, at[4].latency_ms) == pytest.approx((10.0, 100.0, 20.0))
    # 336 px: 2.25x the pixels of 224; between the two sizes log-log (here a straight power of pixels).
    mid = {op.concurrency: op for op in model.operating_points(336)}
    assert mid[1].latency_ms == pytest.approx(22.5) and mid[1].images_per_s == pytest.approx(1 / 0.0225)
    # Beyond the largest, linear in pixels from the end segment: 896 px is 16x 224's pixels.
    big = {op.concurrency: op for op in model.operating_points(896)}
    assert big[1].latency_ms == pytest.approx(10 + 30 * 15 / 3) and big[1].images_per_s == pytest.approx(1 / 0.16)
    # No size asked: the largest profiled.
    flat = [x for o in model.operating_points() for x in (o.latency_ms, o.images_per_s)]
    assert flat == pytest.approx([40.0, 25.0, 80.0, 50.0])


def test_plan_sizes_the_encoders_for_the_workloads_image_size() -> None:
    profile = dataclasses.replace(synthetic_profile(), vision=SIZED)
    targets = Targets(ttft_ms=2000, itl_ms=50)
    small, large = (plan(profile, Workload(40.0, Lengths(500), Lengths(50), images_per_request=2, image_px=px),
                         targets, 2.0) for px in (224, 448))  # fmt: skip
    assert small.vision is not None and large.vision is not None
    assert small.replicas["vision"] < large.replicas["vision"]  # 4x the pixels, a quarter of the images/s


def test_the_sweep_grid_is_concurrency_by_size_and_a_single_size_still_accepted() -> None:
    assert SweepConfig("http://b", out=None).image_sizes == (224, 448)  # type: ignore[arg-type]
    assert SweepConfig("http://b", out=None, vision_image_px=336).image_sizes == (336,)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="image sizes"):
        SweepConfig("http://b", out=None, vision_image_px=())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kvcache lengths"):
        SweepConfig("http://b", out=None, kvcache_lengths=(1,))  # type: ignore[arg-type]


def test_a_profile_from_before_the_size_axis_and_the_kvcache_round_still_loads_and_plans() -> None:
    raw = json.loads(synthetic_profile().to_json())
    for point in raw["vision"]:
        del point["image_px"]  # written when the sweep had one size, said in its settings
    del raw["kvcache"]
    raw["settings"]["sweep.vision_image_px"] = "224"
    old = Profile.from_json(json.dumps(raw))
    assert {p.image_px for p in old.vision} == {224} and old.kvcache == []
    # One size: its figures as measured whatever the workload's size (no curve to read).
    assert VisionModel(old.vision).operating_points(896) == VisionModel(old.vision).operating_points(224)
    workload = Workload(40.0, Lengths(500), Lengths(50), images_per_request=2, image_px=448)
    assert plan(old, workload, Targets(ttft_ms=2000, itl_ms=50), 2.0).replicas["vision"] > 0
    no_size = json.loads(json.dumps(raw))
    del no_size["settings"]["sweep.vision_image_px"]
    assert {p.image_px for p in Profile.from_json(json.dumps(no_size)).vision} == {None}


def test_kvcache_points_survive_the_round_trip() -> None:
    profile = dataclasses.replace(synthetic_profile(), kvcache=[KVCachePoint(512, 12.0, 30.0, 0.8)])
    assert Profile.from_json(profile.to_json()).kvcache == profile.kvcache
