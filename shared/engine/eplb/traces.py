"""Synthetic skewed routing traces, seeded, for the EPLB simulation and tests. A random
router routes almost uniformly, which no placement needs; real traffic does not: per
expert loads are drawn log-normal (the shape DeepEP's analysis fitted to DeepSeek-V3
traffic; its sigma here is our assumption, stated by every user), and the mix drifts
so the hot experts change.

The drift is an Ornstein-Uhlenbeck walk of each expert's log-load: stationary N(0, 1)
at every step (so the log-normal shape holds throughout), correlated over
`drift_steps`: a placement computed from past steps meets a load that has moved on.
A step's counts are Poisson around tokens * top_k * share: the per-step noise a batch
of that size has, which no placement can remove."""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TraceSpec:
    num_layers: int
    num_experts: int
    sigma: float = 0.5
    """Log-normal sigma of per-expert load (0.5: the hottest of 128 experts carries ~3x
    the mean, the figure usually quoted for hot experts; 1.0 is a harsher case)."""
    tokens_per_step: int = 8192
    top_k: int = 8
    drift_steps: float = 2000.0
    """Correlation time of the drift in steps: the mix has largely changed after it."""
    seed: int = 0


class DriftingLogNormalTrace:
    """Steps of counts [layers, experts], each layer with its own hot experts."""

    def __init__(self, spec: TraceSpec) -> None:
        self.spec = spec
        self._rng = np.random.default_rng(spec.seed)
        self._z = self._rng.standard_normal((spec.num_layers, spec.num_experts))
        self._keep = float(np.exp(-1.0 / spec.drift_steps))
        self._kick = float(np.sqrt(1.0 - self._keep**2))

    def shares(self) -> np.ndarray:
        """This step's expected share of routed tokens per expert [layers, experts]."""
        weights = np.exp(self.spec.sigma * self._z)
        return weights / weights.sum(1, keepdims=True)

    def step(self) -> np.ndarray:
        """One step's counts [layers, experts] int64; the mix then drifts one step."""
        routed = self.spec.tokens_per_step * self.spec.top_k
        counts = self._rng.poisson(routed * self.shares())
        self._z = self._keep * self._z + self._kick * self._rng.standard_normal(self._z.shape)
        return counts

    def steps(self, num_steps: int) -> np.ndarray:
        """num_steps steps at once [steps, layers, experts]."""
        return np.stack([self.step() for _ in range(num_steps)])
