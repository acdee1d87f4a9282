"""Rank 0's bookkeeping of EPLB's weight moves (shared/engine/executor/move_schedule.py):
a queued move starts with the next step, steps run beside it until every rank finished,
and the switch is named in exactly one step's order, after the start's; one move at a
time. Blocking moves start and switch with the same step, none beside it."""

import logging

import pytest

from shared.engine.eplb.balancer import ExpertMove
from shared.engine.executor.move_schedule import MoveOrder, MoveSchedule

LAYER0 = ExpertMove(0, (0, 1, 2, 3))
LAYER1 = ExpertMove(1, (3, 2, 1, 0))


def test_a_background_move_starts_runs_beside_steps_and_switches_at_one_step() -> None:
    moves = MoveSchedule(blocking=False)
    assert moves.accepting and moves.order(moved_everywhere=False) is None and not moves.moving
    moves.queue(LAYER0)
    assert not moves.accepting and moves.unswitched == LAYER0 and moves.in_flight is None
    assert moves.order(moved_everywhere=False) == MoveOrder(start=LAYER0)  # step 1: start, run on the old weights
    assert moves.in_flight == moves.unswitched == LAYER0 and moves.moving and not moves.accepting
    # Steps 2 and 3 run while some rank still moves: nothing ordered, the move still counted.
    assert moves.order(moved_everywhere=False) is None and moves.order(moved_everywhere=False) is None
    assert moves.steps_beside_moves == 2 and moves.moving
    with pytest.raises(ValueError, match="layer 0's move is not switched yet"):
        moves.queue(LAYER1)
    assert moves.order(moved_everywhere=True) == MoveOrder(switch=0)  # step 4: every rank switches before it
    assert moves.unswitched is None and moves.accepting and moves.num_switches == 1 and moves.moving
    assert moves.order(moved_everywhere=True) is None and not moves.moving  # a finished flag alone switches nothing
    assert moves.num_switches == 1


def test_the_next_move_starts_once_the_last_one_switched() -> None:
    moves = MoveSchedule(blocking=False)
    moves.queue(LAYER0)
    moves.order(moved_everywhere=False)
    # The engine may queue the next move only once the executor accepts: after the switch.
    assert moves.order(moved_everywhere=True) == MoveOrder(switch=0)
    moves.queue(LAYER1)
    assert moves.order(moved_everywhere=False) == MoveOrder(start=LAYER1)
    assert moves.order(moved_everywhere=True) == MoveOrder(switch=1)
    assert moves.num_switches == 2 and moves.steps_beside_moves == 0


def test_a_blocking_move_starts_and_switches_before_the_same_step() -> None:
    moves = MoveSchedule(blocking=True)
    moves.queue(LAYER1)
    assert moves.order(moved_everywhere=False) == MoveOrder(start=LAYER1, wait=True)
    assert moves.in_flight is None and moves.accepting and moves.num_switches == 1 and moves.moving
    assert moves.order(moved_everywhere=False) is None and moves.steps_beside_moves == 0 and not moves.moving


def test_each_start_and_switch_is_logged_with_its_layer(caplog: pytest.LogCaptureFixture) -> None:
    """The log lines an operator (and the mesh's live benchmark) reads the moves from:
    a background move's start and its switch, a blocking move's one line."""
    caplog.set_level(logging.INFO, logger="shared.engine.executor.move_schedule")
    moves = MoveSchedule(blocking=False)
    moves.queue(LAYER1)
    moves.order(moved_everywhere=False)
    moves.order(moved_everywhere=False)
    moves.order(moved_everywhere=True)
    blocking = MoveSchedule(blocking=True)
    blocking.queue(LAYER0)
    blocking.order(moved_everywhere=False)
    assert [r.getMessage() for r in caplog.records] == [
        "EPLB: layer 1 moving, in the background (slots [3, 2, 1, 0])",
        "EPLB: layer 1 switched on every rank (steps beside its move: 1)",
        "EPLB: layer 0 moving and switched before one step, blocking it (slots [0, 1, 2, 3])",
    ]
