"""The expert load a worker reports while its engine keeps no window of its own: the
engine's running totals (EngineLoad.tokens_per_expert, since start) taken at each
heartbeat the engine stepped before, and the load over the last `num_beats` such
heartbeats as the newest minus the oldest. An idle engine's window keeps its last
steps, as the engine's own window of steps (eplb/load_window.py) does: an instance
that had nothing to do since is no more balanced than it was. One rank: a
one-process MoE engine holds every expert. An expert-parallel engine keeps its own
window per rank (EngineLoad.expert_load, from EPLB's), which the worker reports instead."""

from collections import deque

import numpy as np

from shared.engine.eplb.expert_load import ExpertLoad

NUM_BEATS = 10
"""Heartbeats (after steps) the window spans (10 s of work at the default 1 s interval):
long enough that a burst between two beats does not swing the balancer, short enough to
follow a shift."""


class ExpertLoadWindow:
    def __init__(self, num_beats: int = NUM_BEATS) -> None:
        if num_beats < 1:
            raise ValueError(f"num_beats must be >= 1, got {num_beats}")
        self._totals: deque[tuple[int, np.ndarray]] = deque(maxlen=num_beats + 1)
        """(steps since start, tokens per expert since start) at each beat, the oldest first."""

    def observe(self, tokens_per_expert: list[list[int]] | None, num_steps: int) -> ExpertLoad | None:
        """Take one heartbeat's running totals (num_steps: engine steps since start); the
        load over the window ending now, or None for a dense model."""
        if tokens_per_expert is None:
            return None
        totals = np.asarray(tokens_per_expert, dtype=np.int64)
        if not self._totals:  # the window's first edge is the engine's start
            self._totals.append((0, np.zeros_like(totals)))
        if num_steps != self._totals[-1][0]:
            self._totals.append((num_steps, totals))
        first_steps, first = self._totals[0]
        return ExpertLoad.from_expert_counts(totals - first, num_steps - first_steps)
