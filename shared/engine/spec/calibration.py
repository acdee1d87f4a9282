"""Calibrating a drafter's confidences from what verification accepted.

A drafter's raw score for position k (its probability of the token it proposed)
is not the chance that position k is accepted. DSpark calibrates it with
sequential temperature scaling (STS): one temperature T_k per position, chosen
in order k = 1, 2, ... so that the *survival* a_k = ∏_{i<=k} c_i, with
c_i = σ(logit(p_i) / T_i), matches the observed chance that the first k drafted
tokens were all accepted (the lowest expected calibration error, ECE, over a
grid of temperatures, with T_1..T_{k-1} already fixed).

Observations are (raw scores of the positions drafted, how many were accepted):
a position past the first rejection says nothing and is not counted.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

TEMPERATURE_GRID: tuple[float, ...] = tuple(round(0.25 * 1.15**i, 4) for i in range(30))
"""0.25 .. ~14: from sharpening to flattening the drafter's scores."""
ECE_BINS = 10
_EPS = 1e-6


def _logit(p: float) -> float:
    p = min(max(p, _EPS), 1 - _EPS)
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def _sigmoid_array(x: np.ndarray) -> np.ndarray:
    """_sigmoid elementwise, by the same branch per element."""
    with np.errstate(over="ignore"):  # exp of the branch not taken may overflow; unused
        return np.where(x >= 0, 1 / (1 + np.exp(-x)), np.exp(x) / (1 + np.exp(x)))


def _ece_by_row(predicted: np.ndarray, observed: np.ndarray, bins: int = ECE_BINS) -> list[float]:
    """expected_calibration_error of each row of predicted [trials, n] against observed
    [n] (0.0 / 1.0): the bin sums by bincount, which adds in order as that loop does."""
    trials, n = predicted.shape
    keys = np.minimum((predicted * bins).astype(np.int64), bins - 1) + bins * np.arange(trials)[:, None]
    keys = keys.ravel()
    size = trials * bins
    predicted_sums = np.bincount(keys, weights=predicted.ravel(), minlength=size).reshape(trials, bins).tolist()
    observed_sums = np.bincount(keys, weights=np.broadcast_to(observed, predicted.shape).ravel(), minlength=size)
    counts = np.bincount(keys, minlength=size).reshape(trials, bins).tolist()
    return [
        sum(abs(p - o) / n for p, o, c in zip(ps, os, cs) if c)
        for ps, os, cs in zip(predicted_sums, observed_sums.reshape(trials, bins).tolist(), counts)
    ]


def expected_calibration_error(predicted: Sequence[float], observed: Sequence[bool], bins: int = ECE_BINS) -> float:
    """Σ_b |bin b| / n · |mean predicted − observed rate| over equal-width bins."""
    if not predicted:
        return 0.0
    sums = [[0.0, 0.0, 0] for _ in range(bins)]
    for p, o in zip(predicted, observed):
        b = min(int(p * bins), bins - 1)
        sums[b][0] += p
        sums[b][1] += float(o)
        sums[b][2] += 1
    n = len(predicted)
    return sum(abs(s[0] - s[1]) / n for s in sums if s[2])


@dataclass
class SequentialTemperatureScaling:
    max_positions: int
    temperatures: list[float] = field(default_factory=list)
    max_observations: int = 0
    """Keep only the latest this many observations (0: all), so a running engine's
    fit follows recent traffic at a bounded cost."""
    _observations: list[tuple[tuple[float, ...], int]] = field(default_factory=list)

    def observe(self, raw_scores: Sequence[float], num_accepted: int) -> None:
        """One verified draft: the drafter's raw scores and how many leading tokens passed."""
        if not 0 <= num_accepted <= len(raw_scores):
            raise ValueError(f"num_accepted {num_accepted} outside 0..{len(raw_scores)}")
        if raw_scores:
            self._observations.append((tuple(raw_scores[: self.max_positions]), num_accepted))
            if self.max_observations and len(self._observations) > self.max_observations:
                del self._observations[: len(self._observations) - self.max_observations]

    def fit(self) -> list[float]:
        """Choose T_1, T_2, ... in order; a position with no observation keeps T = 1.

        Each score's logit is taken once, each row's survival through the positions
        already fixed is kept, and the grid's temperatures are tried as one array (the
        scalar definition's operations, in its order: the same temperatures). The fit
        runs every REFIT_EVERY verifications over up to max_observations rows: trial by
        trial in Python it cost 0.1-0.3 s of the host per fit, this a few ms."""
        self.temperatures = []
        observations = self._observations
        logits = [[_logit(p) for p in s] for s, _ in observations]
        prefix = np.ones(len(observations))  # per row, its survival through the positions fixed
        grid = np.array(TEMPERATURE_GRID)[:, None]
        for k in range(self.max_positions):
            rows = [i for i, (s, _) in enumerate(observations) if len(s) > k]
            if not rows:
                self.temperatures.append(1.0)
                continue
            observed = np.array([observations[i][1] > k for i in rows], dtype=np.float64)  # first k+1 accepted
            c = _sigmoid_array(np.array([logits[i][k] for i in rows]) / grid)  # [temperatures, rows]
            predicted = prefix[rows] * c
            best, best_ece = 0, math.inf
            for t, ece in enumerate(_ece_by_row(predicted, observed)):
                if ece < best_ece - 1e-12:
                    best, best_ece = t, ece
            self.temperatures.append(TEMPERATURE_GRID[best])  # an ECE is finite: some t always wins
            prefix[rows] *= c[best]
        return self.temperatures

    def confidences(self, raw_scores: Sequence[float]) -> list[float]:
        """c_k = σ(logit(p_k) / T_k) with the fitted temperatures (T = 1 where unfitted)."""
        return [
            _sigmoid(_logit(p) / (self.temperatures[k] if k < len(self.temperatures) else 1.0))
            for k, p in enumerate(raw_scores)
        ]


@dataclass
class AcceptanceByPosition:
    """For drafters without scores (prompt lookup): the observed acceptance rate of
    position k given the earlier ones passed, with a prior of `prior` worth
    `prior_weight` observations."""

    max_positions: int
    prior: float = 0.5
    prior_weight: float = 4.0
    _reached: list[int] = field(default_factory=list)
    _passed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._reached = [0] * self.max_positions
        self._passed = [0] * self.max_positions

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"num_accepted {num_accepted} outside 0..{num_drafted}")
        for k in range(min(num_drafted, num_accepted + 1, self.max_positions)):
            self._reached[k] += 1
            self._passed[k] += int(k < num_accepted)

    def rates(self) -> list[float]:
        return [(self._passed[k] + self.prior * self.prior_weight) / (self._reached[k] + self.prior_weight)
                for k in range(self.max_positions)]  # fmt: skip
