"""bench-mesh's schedule and arithmetic (tools/bench/rounds.py), exactly, without
timing anything: each test fails if one rule that keeps the figures honest breaks
(rotation, warm-up per level, the dropped first round, >= 3 timed rounds, the
spread, the headline's denominator)."""

import pytest

from tools.bench.rounds import (
    DROPPED_ROUNDS,
    MIN_TIMED_ROUNDS,
    Run,
    headline,
    level_figures,
    plan,
    rotation,
    spread,
)

TARGETS = ("engine", "http", "mesh")
CONCURRENCY, NUM_REQUESTS = [1, 8], [4, 16]


def _rounds(runs: list[Run], level: int) -> dict[int, list[Run]]:
    out: dict[int, list[Run]] = {}
    for r in runs:
        if r.level == level and r.round is not None:
            out.setdefault(r.round, []).append(r)
    return out


def test_round_r_starts_at_target_r_mod_n_and_runs_every_target_once():
    assert [rotation(TARGETS, r) for r in range(4)] == [
        ["engine", "http", "mesh"], ["http", "mesh", "engine"], ["mesh", "engine", "http"], ["engine", "http", "mesh"],
    ]  # fmt: skip
    runs = plan(TARGETS, CONCURRENCY, NUM_REQUESTS, timed_rounds=4)
    for level in range(len(CONCURRENCY)):
        rounds = _rounds(runs, level)
        assert sorted(rounds) == list(range(DROPPED_ROUNDS + 4))
        for r, in_round in rounds.items():
            assert [x.target for x in in_round] == [TARGETS[(r + i) % 3] for i in range(3)]
        # Over the timed rounds no target always goes first (or last).
        firsts = {rounds[r][0].target for r in rounds if rounds[r][0].timed}
        assert firsts == set(TARGETS)


def test_every_target_is_warmed_at_every_level_before_it_is_timed_there():
    runs = plan(TARGETS, CONCURRENCY, NUM_REQUESTS, timed_rounds=3)
    for level, conc in enumerate(CONCURRENCY):
        for target in TARGETS:
            mine = [(i, r) for i, r in enumerate(runs) if r.level == level and r.target == target]
            warmups = [(i, r) for i, r in mine if r.round is None]
            assert len(warmups) == 1, (level, target)
            i, warm = warmups[0]
            assert not warm.timed and warm.concurrency == conc and warm.num_requests >= max(conc, 2)
            # Before this target's first round at this level, and after the last run of the level before.
            assert i < min(j for j, r in mine if r.round is not None)
            assert all(j < i for j, r in enumerate(runs) if r.level < level)
            # Its prompts are none of the measured ones.
            assert warm.seed not in {r.seed for r in runs if r.round is not None}


def test_the_first_round_is_run_but_not_counted_and_at_least_three_are():
    runs = plan(TARGETS, CONCURRENCY, NUM_REQUESTS, timed_rounds=3)
    for level, num in enumerate(NUM_REQUESTS):
        rounds = _rounds(runs, level)
        assert all(not x.timed for x in rounds[0]) and DROPPED_ROUNDS == 1
        assert [r for r in rounds if all(x.timed for x in rounds[r])] == [1, 2, 3]
        # Within a round every target gets the same prompts; rounds and levels differ.
        assert all(len({x.seed for x in in_round}) == 1 for in_round in rounds.values())
        assert all(x.num_requests == num for in_round in rounds.values() for x in in_round)
    assert len({r.seed for r in runs if r.round is not None}) == len(CONCURRENCY) * 4
    assert MIN_TIMED_ROUNDS == 3
    with pytest.raises(ValueError, match="at least 3 timed rounds"):
        plan(TARGETS, CONCURRENCY, NUM_REQUESTS, timed_rounds=2)


def _row(tok_s: float, ttft: float, tpot: float = 1.0) -> dict[str, float]:
    return {"req_s": tok_s / 10, "out_tok_s": tok_s, "ttft_p50_ms": ttft, "ttft_p90_ms": 2 * ttft,
            "tpot_p50_ms": tpot, "e2e_p50_ms": 10 * ttft}  # fmt: skip


# mesh / http per round: 1.25, 0.9, 0.8333 -> median 0.9 (the ratio of the medians would be 90 / 80 = 1.125);
# against the in-process engine, 2.5, 0.45, 1.0.
TIMED = [
    {"engine": _row(40, 10), "http": _row(80, 20, 2.0), "mesh": _row(100, 30, 2.5)},
    {"engine": _row(200, 10), "http": _row(100, 10, 1.0), "mesh": _row(90, 40, 1.5)},
    {"engine": _row(50, 10), "http": _row(60, 40, 3.0), "mesh": _row(50, 20, 3.0)},
]
OUTLIER = {t: _row(1e6, 1e-3) for t in TARGETS}  # what a cold first round or a warm-up may read


def _results(level: int = 0) -> list[tuple[Run, dict[str, float]]]:
    """The runs of one level with their rows: warm-ups and the dropped round read absurdly."""
    rows = {(r.round, r.target): r for r in plan(TARGETS, [4], [8], timed_rounds=3) if r.level == 0}
    out = [(rows[None, t], OUTLIER[t]) for t in TARGETS] + [(rows[0, t], OUTLIER[t]) for t in rotation(TARGETS, 0)]
    for i, timed in enumerate(TIMED, start=1):
        out += [(rows[i, t], timed[t]) for t in rotation(TARGETS, i)]
    return out


def test_spread_is_the_median_min_and_max():
    assert spread([3.0, 1.0, 10.0]) == {"median": 3.0, "min": 1.0, "max": 10.0}
    assert spread([4.0, 1.0, 2.0, 10.0]) == {"median": 3.0, "min": 1.0, "max": 10.0}


def test_level_figures_leave_out_warm_ups_and_the_dropped_round():
    figures = level_figures(_results())
    assert figures["concurrency"] == 4
    assert figures["rounds"] == TIMED and figures["dropped_rounds"] == [OUTLIER]
    assert figures["rows"]["mesh"]["out_tok_s"] == {"median": 90, "min": 50, "max": 100}
    assert figures["rows"]["engine"]["out_tok_s"] == {"median": 50, "min": 40, "max": 200}
    assert figures["rows"]["http"]["ttft_p50_ms"] == {"median": 20, "min": 10, "max": 40}
    assert figures["rows"]["http"]["tpot_p50_ms"] == {"median": 2.0, "min": 1.0, "max": 3.0}


def test_the_headline_is_mesh_over_http_per_round_never_over_the_engine():
    h = level_figures(_results())["headline"]
    assert [p["tok_s_ratio"] for p in h["per_round"]] == pytest.approx([1.25, 0.9, 50 / 60])
    assert h["tok_s_ratio"]["median"] == pytest.approx(0.9)  # not 90 / 80: ratios are taken per round
    assert h["tok_s_ratio"]["min"] == pytest.approx(50 / 60) and h["tok_s_ratio"]["max"] == pytest.approx(1.25)
    assert h["ttft_ratio"] == pytest.approx({"median": 1.5, "min": 0.5, "max": 4.0})
    assert h["added_ms_per_request"] == pytest.approx({"median": 10.0, "min": -20.0, "max": 30.0})
    assert h["added_ms_per_token"] == pytest.approx({"median": 0.5, "min": 0.0, "max": 0.5})
    # Without the http target there is no headline: the in-process engine does not stand in.
    assert headline([{t: r[t] for t in ("engine", "mesh")} for r in TIMED]) is None
    # The engine appears only as a row and in the OpenAI layer's cost (a difference).
    layer = level_figures(_results())["http_layer"]
    assert layer["added_ms_per_request"] == pytest.approx({"median": 10.0, "min": 0.0, "max": 30.0})
