"""bench-spec's replayed rows (tools/bench/spec_replay.py): the profile's survival has
the mean accepted length asked for, and the scheduler's choices on it follow the costs:
all γ verified where a step's size is free, nothing where tokens cost in proportion or
drafting costs more than it brings."""

import pytest

from shared.engine.spec.schedule import SpsTable
from tools.bench.spec_replay import geometric_survival, replay

FLAT = SpsTable((1, 64), (100.0, 100.0))
"""A step of 64 tokens as fast as one of 1 (memory-bound decode, in the limit)."""
PROPORTIONAL = SpsTable(tuple(range(1, 65)), tuple(100.0 / b for b in range(1, 65)))
"""Every token costs the same (compute-bound): verifying never pays."""


@pytest.mark.parametrize("tau", [1.0, 3.5, 4.5, 5.5, 6.0])
def test_the_geometric_profile_has_the_mean_accepted_length_asked_for(tau: float) -> None:
    p, survival = geometric_survival(tau, 5)
    assert len(survival) == 5 and survival == pytest.approx([p**j for j in range(1, 6)])
    assert 1 + sum(survival) == pytest.approx(tau, abs=1e-9)
    with pytest.raises(ValueError, match=r"lies in \[1, 6\]"):
        geometric_survival(6.5, 5)


def test_free_steps_verify_every_drafted_token_and_yield_tau_per_step() -> None:
    rows = replay(FLAT, [3.5, 5.5], 5, batch=4, draft_seconds=0.001)
    for row in rows:
        drafting_cost = 5 * 0.001 if row.drafting == "measured" else 0.0
        assert (row.depth, row.verified_per_request) == (5, 5.0)
        assert row.tokens_per_step == pytest.approx(row.profile)
        assert row.tokens_per_s == pytest.approx(4 * row.profile / (0.01 + drafting_cost))
        assert row.vs_none == pytest.approx(row.tokens_per_s / 400.0)


def test_costs_that_outweigh_acceptance_give_no_speculation() -> None:
    for row in replay(PROPORTIONAL, [5.5], 5, batch=1, draft_seconds=0.0):
        assert (row.depth, row.verified_per_request, row.vs_none) == (0, 0.0, pytest.approx(1.0))
    measured, free = replay(FLAT, [3.5], 5, batch=1, draft_seconds=1.0)  # a drafting pass of 100 steps
    assert (measured.drafting, measured.depth, measured.vs_none) == ("measured", 0, pytest.approx(1.0))
    assert (free.drafting, free.depth) == ("free", 5)
