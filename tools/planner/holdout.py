"""The profile's accuracy check (issue 30's figure: predicted within 10 % of measured
at three held-out operating points per stage). Held-out points lie between grid
points along one axis, the other on the grid; the prediction is the log-log
interpolation between the two measured grid neighbours on that line (latency and
throughput follow power laws in length and batch far better than straight lines).
The predictor is a parameter, so the planner's own stage model can be checked
against the same measurements (services/planner/stage_model.py's, when it lands).

Pure functions, no I/O: tests/unit/test_planner_holdout.py checks them exactly.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

Point = tuple[int, int]
"""An operating point: (input_tokens, concurrency) for prefill, (batch, context) for decode."""
Figures = Mapping[str, float]
"""A point's figures by name (ttft_ms, tokens_per_s; itl_ms, tokens_per_s)."""
Predictor = Callable[[Point, str], float | None]
"""The predicted value of one figure at one point; None where it cannot say."""
NUM_HELD_OUT = 3


@dataclass(frozen=True, slots=True)
class Check:
    point: Point
    figure: str
    measured: float
    predicted: float | None

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured; None without a prediction."""
        if self.predicted is None:
            return None
        return (self.predicted - self.measured) / self.measured


def geometric_mid(a: int, b: int) -> int:
    return round(math.sqrt(a * b))


def held_out_points(xs: Sequence[int], ys: Sequence[int], num: int = NUM_HELD_OUT) -> list[Point]:
    """num points off the grid xs x ys, each between two grid neighbours along one
    axis and on the grid along the other: first between the xs at the smallest y,
    then between the ys at the smallest x, then along the xs at the other ys;
    spread over the gaps (first, last, middle, ...)."""
    xs, ys = sorted(set(xs)), sorted(set(ys))
    lines: list[list[Point]] = [
        [(geometric_mid(a, b), ys[0]) for a, b in zip(xs, xs[1:])],
        [(xs[0], geometric_mid(a, b)) for a, b in zip(ys, ys[1:])],
        *[[(geometric_mid(a, b), y) for a, b in zip(xs, xs[1:])] for y in ys[1:]],
    ]
    chosen: list[Point] = []
    for line in lines:
        for p in _spread(line):
            off_grid = p[0] not in xs or p[1] not in ys  # a midpoint of 1 and 2 is a grid value
            if off_grid and p not in chosen and len(chosen) < num:
                chosen.append(p)
    return chosen


def _spread(line: list[Point]) -> list[Point]:
    """first, last, then the middle ones."""
    if len(line) <= 2:
        return line
    return [line[0], line[-1], *line[1:-1]]


def log_interpolate(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    """y at x on the straight line through (x0, y0) and (x1, y1) in log-log space."""
    if x0 == x1:
        return y0
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


def grid_predictor(grid: Mapping[Point, Figures]) -> Predictor:
    """Log-log interpolation between the measured grid neighbours of a point on the
    line it shares with them (same y, or same x); None off every measured line or
    outside its measured span."""

    def predict(point: Point, figure: str) -> float | None:
        x, y = point
        for axis, fixed in ((0, y), (1, x)):
            line = sorted((p[axis], f[figure]) for p, f in grid.items() if p[1 - axis] == fixed and figure in f)
            value = point[axis]
            below = [(a, v) for a, v in line if a <= value]
            above = [(a, v) for a, v in line if a >= value]
            if below and above:
                (a0, v0), (a1, v1) = below[-1], above[0]
                return log_interpolate(value, a0, v0, a1, v1)
        return None

    return predict


def checks(measured: Mapping[Point, Figures], predict: Predictor) -> list[Check]:
    """Every figure of every held-out point, measured against predicted."""
    return [Check(p, name, value, predict(p, name))
            for p, figures in measured.items() for name, value in figures.items()]
