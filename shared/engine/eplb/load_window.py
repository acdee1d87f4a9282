"""The load EPLB places from: a sliding window of per-step tokens per expert per MoE
layer (a ring buffer with a running sum, so a step costs one row's add and subtract,
not a sum over the window), and the figure a placement is judged by: per-layer
balancedness, mean over max tokens per rank. Per layer, never summed over layers: the
all-to-all of each layer waits for that layer's slowest rank."""

import numpy as np

from shared.engine.eplb.placement import Placement


class LoadWindow:
    """The last `window_steps` steps' counts [layers, experts]. Host arrays: the engine's
    counts ride back to the host with each step's tokens (RunnerOutput.expert_counts)."""

    def __init__(self, num_layers: int, num_experts: int, window_steps: int) -> None:
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        self.window_steps = window_steps
        self._ring = np.zeros((window_steps, num_layers, num_experts), dtype=np.int64)
        self._sum = np.zeros((num_layers, num_experts), dtype=np.int64)
        self._next = 0
        self.num_recorded = 0
        """Steps recorded since the start (the window holds the last window_steps)."""

    def record(self, counts: np.ndarray) -> None:
        """One step's counts [layers, experts] (a CPU torch tensor converts too)."""
        counts = np.asarray(counts, dtype=np.int64)
        if counts.shape != self._sum.shape:
            raise ValueError(f"counts of shape {counts.shape}, the window holds {self._sum.shape}")
        # Integer counts: the running sum stays exact however long it runs.
        self._sum += counts - self._ring[self._next]
        self._ring[self._next] = counts
        self._next = (self._next + 1) % self.window_steps
        self.num_recorded += 1

    @property
    def num_steps(self) -> int:
        """Steps in the window now (fewer than window_steps until it first fills)."""
        return min(self.num_recorded, self.window_steps)

    def total(self) -> np.ndarray:
        """Tokens per expert per layer over the window [layers, experts] (a copy)."""
        return self._sum.copy()


def balancedness(load: np.ndarray, placement: Placement) -> np.ndarray:
    """Per layer, mean / max tokens per rank [layers] (or [steps, layers] for a load
    [steps, layers, experts]) under the placement, each expert's tokens split evenly over
    its replicas. 1.0 is perfect; a layer with no tokens counts as balanced."""
    ranks = placement.rank_loads(load)
    top = ranks.max(-1)
    return np.where(top > 0, ranks.mean(-1) / np.where(top > 0, top, 1.0), 1.0)
