"""The sweep's schedule under a time budget, as pure functions (tested exactly in
tests/unit/test_planner_grid.py).

A budget scales the grid down rather than the rounds: a point measured once says
nothing of its noise, so every point keeps its warm-up and its timed rounds, and
points are dropped instead. They run coarse to fine (the ends of each axis first,
then the midpoints), so what a short budget leaves out is the grid's interior, and
what it keeps still spans the range. A point is kept only if its estimated time,
with that of the points kept before it, fits what is left of its stage's share;
time a stage does not use passes to the next.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

STAGE_SHARES = {"prefill": 0.5, "decode": 0.5, "vision": 0.2, "kvcache": 0.2}
"""Of the budget, by stage (held-out points are measured within their stage's share)."""


def coarse_to_fine(values: Sequence[int]) -> list[int]:
    """The values sorted, reordered ends first, then midpoints by halving:
    [1, 2, 4, 8, 16] -> [1, 16, 4, 2, 8]."""
    vs = sorted(set(values))
    if len(vs) <= 2:
        return vs
    order = [vs[0], vs[-1]]
    spans = [(0, len(vs) - 1)]
    while spans:
        nxt = []
        for lo, hi in spans:
            if hi - lo < 2:
                continue
            mid = (lo + hi) // 2
            order.append(vs[mid])
            nxt += [(lo, mid), (mid, hi)]
        spans = nxt
    return order


def grid_order(xs: Sequence[int], ys: Sequence[int]) -> list[tuple[int, int]]:
    """Every (x, y), coarse points of both axes before fine ones."""
    rx = {x: i for i, x in enumerate(coarse_to_fine(xs))}
    ry = {y: i for i, y in enumerate(coarse_to_fine(ys))}
    return sorted(((x, y) for x in rx for y in ry), key=lambda p: (max(rx[p[0]], ry[p[1]]), rx[p[0]] + ry[p[1]], p))


def estimate_s(work: float, measured: Sequence[tuple[float, float]], num_rounds: int) -> float:
    """A point's time (warm-up and timed rounds) from the points measured so far,
    each (work, seconds per round): the most pessimistic per-work rate of them (a
    small point's fixed costs overestimate a large one: the safe side). 0 before any."""
    if not measured:
        return 0.0
    return (num_rounds + 1) * max(seconds * work / max(w, 1e-9) for w, seconds in measured)


@dataclass(slots=True)
class Budget:
    """The sweep's clock: each part ends at the sum of the shares up to it."""

    total_s: float
    parts: tuple[str, ...]
    start: float = field(default_factory=time.monotonic)

    def deadline(self, part: str) -> float:
        shares = {p: STAGE_SHARES[p] for p in self.parts}
        scale = 1.0 / sum(shares.values())
        upto = self.parts[: self.parts.index(part) + 1]
        return self.start + self.total_s * scale * sum(shares[p] for p in upto)

    def fits(self, part: str, estimate_s: float, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now + estimate_s <= self.deadline(part)
