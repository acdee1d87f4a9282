"""Rank 0's bookkeeping of EPLB's weight moves (issue 28): which layer moves, and at
which step every rank switches it. Torch-free; the ranks' side is expert_mover.py.

A move takes at least two steps' messages: one names the layer to start moving (every
rank starts its mover thread before that step's forward, and the step runs on the old
placement); a later one, sent once rank 0 learns that every rank finished (its mover's
closing all-reduce returned), names the layer to switch, so every rank switches before
the same forward. Between the two, steps run with the move in flight. One move at a
time: the new weights of one layer are the only extra memory.

``blocking``: the move is started and waited for before the same step's forward (the
old synchronous move, kept to measure what the background one saves).

Each start and switch is logged (INFO, MOVE_STARTED / MOVE_SWITCHED / MOVE_BLOCKING):
an operator sees when experts moved, and the mesh's live benchmark
(tools/bench/eplb_live_mesh_bench.py) reads from the decode instance's log when
each move was in flight, to class the inter-token gaps a client saw.
"""

import logging
from dataclasses import dataclass

from shared.engine.eplb.balancer import ExpertMove

log = logging.getLogger(__name__)

MOVE_STARTED = "EPLB: layer %d moving, in the background (slots %s)"
MOVE_SWITCHED = "EPLB: layer %d switched on every rank (steps beside its move: %d)"
MOVE_BLOCKING = "EPLB: layer %d moving and switched before one step, blocking it (slots %s)"


@dataclass(frozen=True, slots=True)
class MoveOrder:
    """What every rank does about expert moves before a step's forward, in this order:
    switch ``switch`` (its move finished on every rank), start moving ``start`` in the
    background, and with ``wait`` wait for that move and switch it at once."""

    switch: int | None = None
    start: ExpertMove | None = None
    wait: bool = False


class MoveSchedule:
    def __init__(self, blocking: bool) -> None:
        self.blocking = blocking
        self._queued: ExpertMove | None = None
        self._in_flight: ExpertMove | None = None
        self.moving = False
        """Whether the last ordered step started, switched or ran beside a move."""
        self.num_switches = 0
        self.steps_beside_moves = 0
        """Steps whose forward ran while a move was in flight, started at an earlier step
        (never with blocking moves): the background path at work."""
        self._steps_beside_this = 0
        """Of those, the steps beside the move in flight (for its log line)."""

    @property
    def accepting(self) -> bool:
        """Whether a new move may be queued: none waits and none is in flight."""
        return self._queued is None and self._in_flight is None

    @property
    def in_flight(self) -> ExpertMove | None:
        return self._in_flight

    @property
    def unswitched(self) -> ExpertMove | None:
        """The move handed to the executor and not switched yet (queued or in flight)."""
        return self._queued or self._in_flight

    def queue(self, move: ExpertMove) -> None:
        """The move to start with the next step."""
        if not self.accepting:
            busy = self.unswitched
            assert busy is not None
            raise ValueError(f"layer {busy.layer}'s move is not switched yet: one move at a time")
        self._queued = move

    def order(self, moved_everywhere: bool) -> MoveOrder | None:
        """The next step's order (None: nothing to do). ``moved_everywhere``: every rank
        finished the move in flight (rank 0's mover says so)."""
        switch: int | None = None
        if self._in_flight is not None:
            if moved_everywhere:
                switch, self._in_flight = self._in_flight.layer, None
                self.num_switches += 1
                log.info(MOVE_SWITCHED, switch, self._steps_beside_this)
            else:
                self.steps_beside_moves += 1
                self._steps_beside_this += 1
        start, self._queued = self._queued, None
        if start is not None and self.blocking:
            self.num_switches += 1
            log.info(MOVE_BLOCKING, start.layer, list(start.slot_experts))
            order: MoveOrder | None = MoveOrder(switch, start, wait=True)
        else:
            if start is not None:
                self._in_flight, self._steps_beside_this = start, 0
                log.info(MOVE_STARTED, start.layer, list(start.slot_experts))
            order = None if switch is None and start is None else MoveOrder(switch, start)
        self.moving = order is not None or self._in_flight is not None
        return order
