"""The next intervals' load, from the load seen so far: Holt's linear trend (double
exponential smoothing) on requests/s and mean input and output lengths. The planner
sizes for the interval in which a new instance would be ready, so it needs a trend,
not only the last value; and it plans for the forecast's upper band (the spread of
its own one-step errors), because a late instance costs more than an idle one.

Used by the replay simulator and, later, the live planner service; torch-free, no I/O.
"""

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class Holt:
    """Holt's linear trend on one series."""

    alpha: float = 0.5
    """Weight of a new observation in the level."""
    beta: float = 0.3
    """Weight of a new level change in the trend."""
    error_weight: float = 0.2
    """Weight of a new one-step error in the running error variance."""
    level: float | None = None
    trend: float = 0.0
    error_var: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "error_weight"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"Holt.{name} must be in (0, 1], got {getattr(self, name)}")

    def observe(self, value: float) -> None:
        if self.level is None:
            self.level = value
            return
        error = value - (self.level + self.trend)
        self.error_var = (1 - self.error_weight) * self.error_var + self.error_weight * error * error
        previous = self.level
        self.level = self.alpha * value + (1 - self.alpha) * (self.level + self.trend)
        self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.trend

    def forecast(self, steps: int = 1) -> float:
        if self.level is None:
            raise ValueError("Holt.forecast before any observation")
        return self.level + steps * self.trend

    def upper(self, steps: int = 1, z: float = 1.2816) -> float:
        """The forecast plus z error deviations `steps` ahead (z 1.28: a one-sided 90 %
        band); the one-step error's variance grows with the horizon as a random walk's."""
        return self.forecast(steps) + z * math.sqrt(self.error_var * steps)


@dataclass(frozen=True, slots=True)
class Load:
    """One interval's load: what the planner sizes for."""

    requests_per_s: float
    input_tokens_mean: float
    output_tokens_mean: float


@dataclass(slots=True)
class LoadForecaster:
    rate: Holt = field(default_factory=Holt)
    input_tokens: Holt = field(default_factory=Holt)
    output_tokens: Holt = field(default_factory=Holt)
    z: float = 1.2816
    """How many error deviations above the forecast the rate is planned for."""

    def observe(self, load: Load) -> None:
        self.rate.observe(load.requests_per_s)
        self.input_tokens.observe(load.input_tokens_mean)
        self.output_tokens.observe(load.output_tokens_mean)

    def forecast(self, steps: int = 1) -> Load:
        """The load `steps` intervals ahead: the rate at its upper band, lengths at their trend."""
        return Load(requests_per_s=max(self.rate.upper(steps, self.z), 1e-6),
                    input_tokens_mean=max(self.input_tokens.forecast(steps), 1.0),
                    output_tokens_mean=max(self.output_tokens.forecast(steps), 1.0))

    def peak(self, steps: int) -> Load:
        """The most load of the next 1..`steps` intervals, each part at its own worst.
        What to size for when removing an instance takes effect at once and adding one
        takes `steps`: on a falling trend the far forecast alone would shed instances
        the nearer intervals still need. (The trend is linear: the ends bound it.)"""
        near, far = self.forecast(1), self.forecast(steps)
        return Load(max(near.requests_per_s, far.requests_per_s), max(near.input_tokens_mean, far.input_tokens_mean),
                    max(near.output_tokens_mean, far.output_tokens_mean))
