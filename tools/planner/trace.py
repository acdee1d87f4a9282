"""The replay simulator's arrival trace: a simulated day compressed into planning
intervals, with a sinusoidal (diurnal) request rate between a low and a high, seeded
bursts on top, Poisson arrival counts, and per-request input and output lengths drawn
from log-normal distributions. Seeded, so every policy replays the same requests.
"""

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class TraceSpec:
    intervals: int = 480
    interval_s: float = 180.0
    """Dynamo's default planning interval."""
    low_rps: float = 20.0
    high_rps: float = 80.0
    bursts: int = 6
    """Bursts in the trace: each multiplies the rate for a few intervals."""
    burst_gain: tuple[float, float] = (1.2, 1.5)
    burst_intervals: tuple[int, int] = (2, 6)
    input_mean: float = 1500.0
    input_sigma: float = 0.6
    """Log-normal sigma of input lengths."""
    output_mean: float = 250.0
    output_sigma: float = 0.5
    samples_per_interval: int = 512
    """Requests drawn per interval to stand for all of its requests' lengths."""
    seed: int = 0


@dataclass(frozen=True)
class Interval:
    requests: int
    """Requests arriving in the interval."""
    input_tokens: np.ndarray
    """Sampled requests' input lengths (the interval's requests in proportion)."""
    output_tokens: np.ndarray


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int, cap: float) -> np.ndarray:
    mu = math.log(mean) - sigma * sigma / 2  # so the distribution's mean is `mean`
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), 1, cap)


def rates(spec: TraceSpec, rng: np.random.Generator) -> np.ndarray:
    """Requests/s per interval: the diurnal curve (low at the start, high mid-day) times bursts."""
    t = np.arange(spec.intervals) / spec.intervals
    base = spec.low_rps + (spec.high_rps - spec.low_rps) * (1 - np.cos(2 * np.pi * t)) / 2
    gain = np.ones(spec.intervals)
    for _ in range(spec.bursts):
        start = int(rng.integers(0, spec.intervals))
        length = int(rng.integers(spec.burst_intervals[0], spec.burst_intervals[1] + 1))
        gain[start:start + length] *= rng.uniform(*spec.burst_gain)
    return base * gain


def make_trace(spec: TraceSpec) -> list[Interval]:
    rng = np.random.default_rng(spec.seed)
    out = []
    for rate in rates(spec, rng):
        n = int(rng.poisson(rate * spec.interval_s))
        out.append(Interval(n, _lognormal(rng, spec.input_mean, spec.input_sigma, spec.samples_per_interval, 16384),
                            _lognormal(rng, spec.output_mean, spec.output_sigma, spec.samples_per_interval, 4096)))
    return out
