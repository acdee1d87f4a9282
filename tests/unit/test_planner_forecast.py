"""The planner's forecast follows a trend; its correction factors converge to the
factor by which the real stage differs from its profile, within their clamp."""

import random

import pytest

from services.planner.correction import Correction, corrected
from services.planner.forecast import Holt, Load, LoadForecaster
from services.planner.stage_model import StageModels
from tools.planner.synthetic_profile import synthetic_profile


def test_holt_follows_a_linear_trend_steps_ahead():
    holt = Holt()
    for t in range(40):
        holt.observe(20 + 1.5 * t)
    assert holt.forecast(1) == pytest.approx(20 + 1.5 * 40, rel=1e-3)
    assert holt.forecast(3) == pytest.approx(20 + 1.5 * 42, rel=1e-3)
    # On an exact line its errors vanish: the upper band is the forecast.
    assert holt.upper(3) == pytest.approx(holt.forecast(3), rel=1e-3)


def test_the_upper_band_widens_with_noise_and_horizon():
    rng = random.Random(0)
    holt = Holt()
    for _ in range(60):
        holt.observe(50 + rng.gauss(0, 5))
    assert holt.forecast(1) == pytest.approx(50, abs=5)
    assert holt.forecast(1) + 3 < holt.upper(1) < holt.upper(4)


def test_load_forecaster_plans_the_rate_at_its_band_and_lengths_at_their_trend():
    f = LoadForecaster()
    for t in range(30):
        f.observe(Load(10 + t, 1000 + 10 * t, 200))
    ahead = f.forecast(2)
    assert ahead.requests_per_s == pytest.approx(10 + 31, rel=0.02)
    assert ahead.input_tokens_mean == pytest.approx(1000 + 10 * 31, rel=0.01)
    assert ahead.output_tokens_mean == pytest.approx(200)


def test_correction_converges_to_the_hidden_factor_under_noise():
    rng = random.Random(1)
    hidden = 1.37
    c = Correction()
    for _ in range(60):
        predicted = rng.uniform(50, 500)
        c.observe(predicted * hidden * rng.uniform(0.95, 1.05), predicted)
    assert c.factor == pytest.approx(hidden, rel=0.05)


def test_correction_is_clamped_and_ignores_empty_intervals():
    c = Correction(smoothing=0.3, low=0.5, high=2.0)
    c.observe(1e6, 1.0)  # a stalled instance: its ratio counts as `high`, no more
    assert c.factor == pytest.approx(0.7 * 1.0 + 0.3 * 2.0)
    for _ in range(100):
        c.observe(1e6, 1.0)
    assert 1.99 < c.factor <= 2.0
    for _ in range(100):
        c.observe(1e-6, 1.0)
    assert 0.5 <= c.factor < 0.51
    held = c.factor
    c.observe(0.0, 10.0)  # nothing measured
    assert c.factor == held
    with pytest.raises(ValueError):
        Correction(smoothing=0.0)


def test_a_corrected_profile_is_that_much_slower_per_stage():
    profile = synthetic_profile()
    base, slow = StageModels.from_profile(profile), StageModels.from_profile(corrected(profile, {"prefill": 1.5}))
    assert slow.prefill.ttft_ms(3000, 3) == pytest.approx(base.prefill.ttft_ms(3000, 3) * 1.5)
    assert slow.prefill.tokens_per_s(3000, 3) == pytest.approx(base.prefill.tokens_per_s(3000, 3) / 1.5)
    assert slow.decode.itl_ms(10, 3000) == pytest.approx(base.decode.itl_ms(10, 3000))
    with pytest.raises(ValueError, match="unknown stages"):
        corrected(profile, {"prefil": 1.2})
