"""The mesh's live EPLB benchmark's arithmetic (tools/bench/eplb_live_mesh_bench.py):
the moves read back from an instance's log lines as move_schedule.py writes them, and
a client's inter-token gaps classed as during a move or outside one."""

import datetime
import logging

import pytest

from shared.engine.eplb.balancer import ExpertMove
from shared.engine.executor.move_schedule import MoveSchedule
from tools.bench.eplb_live_mesh_bench import Move, moves_in_log, split_gaps, start_offsets_ms


def _logged(caplog: pytest.LogCaptureFixture) -> str:
    """The records as the services' log format writes them (shared/runtime/telemetry.py)."""
    fmt = logging.Formatter("%(asctime)s %(levelname)s decode-0 %(name)s: %(message)s")
    return "\n".join(fmt.format(r) for r in caplog.records)


def test_the_moves_are_read_back_from_the_lines_the_schedule_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shared.engine.executor.move_schedule")
    moves = MoveSchedule(blocking=False)
    moves.queue(ExpertMove(2, (0, 1, 2, 3)))
    moves.order(moved_everywhere=False)  # starts layer 2
    moves.order(moved_everywhere=True)  # switches it
    moves.queue(ExpertMove(0, (3, 2, 1, 0)))
    moves.order(moved_everywhere=False)  # starts layer 0, never switched
    blocking = MoveSchedule(blocking=True)
    blocking.queue(ExpertMove(1, (0, 1, 2, 3)))
    blocking.order(moved_everywhere=False)
    found = moves_in_log("unrelated line\n" + _logged(caplog))
    assert [(m.layer, m.end == float("inf")) for m in found] == [(2, False), (1, False), (0, True)]
    times = [datetime.datetime.fromtimestamp(r.created).replace(microsecond=int(r.msecs) * 1000).timestamp()
             for r in caplog.records]  # fmt: skip
    assert (found[0].start, found[0].end) == (times[0], times[1])  # to the millisecond the log keeps
    assert found[1].start == found[1].end == times[3]  # a blocking move: an instant
    assert found[2].start == times[2]


def test_a_gap_is_during_a_move_when_its_step_began_during_one() -> None:
    """Placed by where it starts (within the tolerance), not by its length: the long gap
    11.0-19.95 spans no move start and is outside; the short one 19.95-20.1 began as the
    blocking move's step did."""
    moves = [Move(0, 10.0, 10.5), Move(1, 20.0, 20.0)]
    arrivals = [[9.0, 9.995, 10.2, 10.51, 11.0, 19.95], [19.985, 20.1, 20.4]]
    during, outside = split_gaps(arrivals, moves, tolerance_s=0.02)
    # Request 0: the gaps from 9.995 (the start step), 10.2 (beside) and 10.51 (the switch step).
    # Request 1: the gap from 19.985 (the blocking move's step).
    assert during == pytest.approx([205.0, 310.0, 490.0, 115.0])
    assert outside == pytest.approx([995.0, 8950.0, 300.0])
    assert start_offsets_ms(arrivals, moves) == pytest.approx([5.0, 15.0])
