"""`infermesh profile`'s arithmetic, exactly, apart from any mesh: the budget's
coarse-to-fine order and estimates, the held-out points and their log-log
prediction, the figures one wave of streamed results gives, and a vision round's
figures off the balancer's series."""

import math

import pytest

from tools.bench.openai_stream import RequestResult
from tools.planner.grid import Budget, coarse_to_fine, estimate_s, grid_order
from tools.planner.holdout import Check, checks, grid_predictor, held_out_points, log_interpolate
from tools.planner.points import RoundFailed, decode_figures, prefill_figures
from tools.planner.vision_round import BUSY_SECONDS, ENCODE_SECONDS, IMAGES, image_url, vision_figures


def test_coarse_to_fine_keeps_the_ends_then_halves():
    assert coarse_to_fine([16, 1, 4, 2, 8]) == [1, 16, 4, 2, 8]
    assert coarse_to_fine([64, 128, 256, 512, 1024, 2048]) == [64, 2048, 256, 128, 512, 1024]
    assert coarse_to_fine([3, 3, 1]) == [1, 3]


def test_grid_order_puts_the_corners_first_and_covers_the_grid():
    order = grid_order([64, 512, 4096], [1, 4])
    assert order[:4] == [(64, 1), (64, 4), (4096, 1), (4096, 4)]
    assert sorted(order) == sorted((x, y) for x in (64, 512, 4096) for y in (1, 4))


def test_estimate_takes_the_most_pessimistic_rate_and_counts_the_warm_up():
    assert estimate_s(100, [], 3) == 0.0
    # 10 work in 1 s and 100 work in 2 s: 0.1 s per work is the worse rate.
    assert estimate_s(1000, [(10, 1.0), (100, 2.0)], 3) == pytest.approx(4 * 100.0)


def test_budget_gives_each_part_its_share_and_passes_on_what_is_unused():
    b = Budget(100.0, ("prefill", "decode"), start=0.0)
    assert b.deadline("prefill") == pytest.approx(50.0) and b.deadline("decode") == pytest.approx(100.0)
    assert b.fits("prefill", 10.0, now=39.0) and not b.fits("prefill", 10.0, now=41.0)
    assert b.fits("decode", 10.0, now=41.0)  # what prefill left is decode's
    assert not b.fits("decode", 0.0, now=101.0)
    assert Budget(100.0, ("decode",), start=0.0).deadline("decode") == pytest.approx(100.0)


def test_held_out_points_lie_off_the_grid_between_neighbours():
    assert held_out_points([64, 256, 1024], [1, 4]) == [(128, 1), (512, 1), (64, 2)]
    # 1 and 2 have no integer geometric midpoint off the grid: the other lines are used.
    assert held_out_points([1, 2, 4, 8], [128, 1024]) == [(6, 128), (3, 128), (1, 362)]
    for p in held_out_points([1, 2, 4, 8], [128, 1024]):
        assert p[0] not in (1, 2, 4, 8) or p[1] not in (128, 1024)


def test_log_interpolation_is_exact_on_a_power_law():
    # y = 3 x^1.5: a straight line in log-log space.
    assert log_interpolate(200, 100, 3 * 100**1.5, 400, 3 * 400**1.5) == pytest.approx(3 * 200**1.5)
    grid = {(64, 1): {"ttft_ms": 10.0}, (256, 1): {"ttft_ms": 40.0}, (64, 4): {"ttft_ms": 30.0}}
    predict = grid_predictor(grid)
    assert predict((128, 1), "ttft_ms") == pytest.approx(20.0)  # along the lengths, concurrency 1
    assert predict((64, 2), "ttft_ms") == pytest.approx(math.sqrt(10.0 * 30.0))  # along the concurrency
    assert predict((512, 1), "ttft_ms") is None  # outside the measured span
    assert predict((128, 4), "ttft_ms") is None  # no measured neighbour on its line
    [c] = checks({(128, 1): {"ttft_ms": 25.0}}, predict)
    assert c == Check((128, 1), "ttft_ms", 25.0, pytest.approx(20.0)) and c.error == pytest.approx(-0.2)


def _stream(start: float, ttft: float, gaps: list[float]) -> RequestResult:
    n = len(gaps) + 1
    return RequestResult(True, start, ttft_s=ttft, e2e_s=ttft + sum(gaps), itl_s=gaps, num_output_tokens=n)


def test_prefill_figures_count_tokens_to_the_last_first_token():
    results = [_stream(0.0, 0.1, []), _stream(0.0, 0.3, []), _stream(0.0, 0.2, [])]
    r = prefill_figures(results, 100, wall_s=0.4)
    assert r.ttft_ms == pytest.approx(200.0) and r.tokens_per_s == pytest.approx(300 / 0.3)


def test_decode_figures_take_the_window_where_every_stream_decodes():
    # Two streams, 10 ms a token; the second starts 20 ms late. Common window (0.12, 0.20].
    a = _stream(0.0, 0.10, [0.01] * 10)  # tokens at 0.10 .. 0.20
    b = _stream(0.0, 0.12, [0.01] * 10)  # tokens at 0.12 .. 0.22
    r = decode_figures([a, b], prompt=128, max_tokens=11, wall_s=0.3)
    assert r.itl_ms == pytest.approx(10.0) and r.tokens_per_s == pytest.approx(200.0)
    assert r.mean_context == pytest.approx(128 + 5.5) and r.overlapped


def test_decode_figures_fall_back_to_each_stream_when_they_barely_overlap():
    a = _stream(0.0, 0.10, [0.01] * 10)  # 0.10 .. 0.20
    b = _stream(0.0, 0.19, [0.02] * 10)  # 0.19 .. 0.39: overlap 0.01 s, under a quarter of a stream's decode
    r = decode_figures([a, b], prompt=16, max_tokens=11, wall_s=0.4)
    assert r.itl_ms == pytest.approx(15.0)  # the median of 10 and 20 ms
    assert r.tokens_per_s == pytest.approx(20 / 0.29) and not r.overlapped
    with pytest.raises(RoundFailed):
        decode_figures([_stream(0.0, 0.1, [])], prompt=16, max_tokens=4, wall_s=0.2)


def _vision_samples(images: dict[str, float], busy_s: float, asks: int, ask_s: float) -> dict:
    """The balancer's vision series as tools/planner/mesh_facts.parse_samples reads them."""
    out = {(IMAGES, frozenset({("site", site)})): n for site, n in images.items()}
    out[(BUSY_SECONDS, frozenset())] = busy_s
    out[(f"{ENCODE_SECONDS}_count", frozenset())] = asks
    out[(f"{ENCODE_SECONDS}_sum", frozenset())] = ask_s
    return out


def test_vision_figures_are_images_over_busy_time_and_the_mean_ask():
    before = _vision_samples({"vision": 10, "prefill": 3}, busy_s=5.0, asks=10, ask_s=4.0)
    # 8 images in 4 asks, 0.3 s each (1.2 s summed), the stage busy 0.5 s (the asks overlapped).
    after = _vision_samples({"vision": 18, "prefill": 3}, busy_s=5.5, asks=14, ask_s=5.2)
    r = vision_figures(before, after, wall_s=2.0)
    assert r.images_per_s == pytest.approx(16.0) and r.latency_ms == pytest.approx(300.0) and r.wall_s == 2.0


def test_a_vision_round_prefill_encoded_fails_naming_why():
    before = _vision_samples({"vision": 0, "prefill": 0}, 0.0, 0, 0.0)
    after = _vision_samples({"vision": 0, "prefill": 4}, 0.0, 0, 0.0)
    with pytest.raises(RoundFailed, match="4 by prefill"):
        vision_figures(before, after, wall_s=1.0)


def test_profiled_images_are_new_to_every_cache_and_of_the_size_asked():
    import base64
    import io

    from PIL import Image

    a, b = image_url(32, 1, "s-1"), image_url(32, 1, "s-2")
    assert a != b and a == image_url(32, 1, "s-1")  # the salt (a new one each run) makes it new; the seed repeats
    image = Image.open(io.BytesIO(base64.b64decode(a.split(",", 1)[1])))
    assert image.size == (32, 32) and image.format == "PNG"
