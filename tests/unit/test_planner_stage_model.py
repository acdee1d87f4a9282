"""The stage models read a profile as services/planner/stage_model.py documents:
log-log between measured points, linear in tokens beyond them, never beyond the
measured concurrency or batch."""

import math

import pytest

from services.planner.profile import DecodePoint, PrefillPoint
from services.planner.stage_model import DecodeModel, PrefillModel, interpolate


def test_interpolation_is_exact_on_a_power_law_and_linear_outside():
    xs = [100.0, 400.0, 1600.0]
    ys = [3 * x ** 0.7 for x in xs]
    for x in (150.0, 400.0, 999.0):
        assert interpolate(xs, ys, x) == pytest.approx(3 * x ** 0.7, rel=1e-12)
    # Past the last point: the straight line through the last two, in x (tokens).
    slope = (ys[2] - ys[1]) / (xs[2] - xs[1])
    assert interpolate(xs, ys, 3200.0) == pytest.approx(ys[2] + slope * 1600.0)
    # Below the first: the first segment's line, unless it would reach zero (then proportional).
    slope0 = (ys[1] - ys[0]) / (xs[1] - xs[0])
    assert interpolate(xs, ys, 50.0) == pytest.approx(ys[0] - slope0 * 50.0)
    steep = [1.0, 100.0]
    assert interpolate([10.0, 20.0], steep, 5.0) == pytest.approx(1.0 * 5.0 / 10.0)


def _prefill(ttft_scale: float = 1.0) -> PrefillModel:
    points = []
    for c in (1, 4):
        for n in (512, 2048):
            seconds = (0.01 + n * c / 20_000) * ttft_scale
            points.append(PrefillPoint(n, c, seconds * 1000, n * c / seconds))
    return PrefillModel(points)


def test_prefill_max_load_takes_the_best_throughput_within_the_budget():
    model = _prefill()
    budget = model.ttft_ms(2048, 2) + 1e-6  # concurrency 2 fits, 3 does not (TTFT rises with concurrency)
    op = model.max_load(2048, 1024, budget)
    assert op is not None and op.concurrency == 2
    assert op.tokens_per_s == pytest.approx(model.tokens_per_s(1024, 2))
    assert model.max_load(2048, 1024, model.best_ttft_ms(2048) - 1.0) is None


def test_concurrency_and_batch_are_not_extrapolated():
    with pytest.raises(ValueError, match="outside the profile's measured 1..4"):
        _prefill().ttft_ms(1024, 8)
    decode = DecodeModel([DecodePoint(b, ctx, 5 + b * ctx / 1e4, b / (5 + b * ctx / 1e4) * 1000)
                          for b in (1, 8) for ctx in (1000, 4000)])
    with pytest.raises(ValueError, match="decode batch 9"):
        decode.itl_ms(9, 1000)


def test_decode_max_load_meets_the_itl_target_and_at_load_settles_below_it():
    decode = DecodeModel([DecodePoint(b, ctx, 5 + b * ctx / 1e4, b / (5 + b * ctx / 1e4) * 1000)
                          for b in (1, 8, 64) for ctx in (1000, 4000)])
    op = decode.max_load(4000, 2000, itl_target_ms=20.0)
    assert op is not None and op.itl_ms <= 20.0 < decode.itl_ms(op.batch + 1, 4000)
    half = decode.at_load(4000, 2000, op.tokens_per_s / 2)
    assert half is not None and half.batch < op.batch and half.tokens_per_s == pytest.approx(op.tokens_per_s / 2)
    assert decode.at_load(4000, 2000, decode.tokens_per_s(64, 2000) * 1.01) is None
    assert math.isclose(decode.best_itl_ms(4000), decode.itl_ms(1, 4000))
