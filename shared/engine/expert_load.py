"""An MoE instance's expert load as the mesh reports it (issue 28, the EP balancer):
tokens per rank per MoE layer over a window of engine steps, and per layer the figure
EPLB is judged by, balancedness (mean over max tokens per rank). Torch-free: the
worker turns it into its heartbeat and metrics, the engine (or, until the engine keeps
its own window, the worker) builds it from host copies of the expert counts."""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared.engine.eplb.placement import Placement


@dataclass(frozen=True)
class ExpertLoad:
    tokens_per_rank: list[list[int]]
    """[MoE layer][rank]: the (token, expert choice) pairs each rank's experts computed
    over the window."""
    window_steps: int
    """Engine steps the window holds."""

    @property
    def num_layers(self) -> int:
        return len(self.tokens_per_rank)

    @property
    def num_ranks(self) -> int:
        return len(self.tokens_per_rank[0]) if self.tokens_per_rank else 0

    def mean_tokens_per_rank(self) -> list[float]:
        return [sum(ranks) / len(ranks) for ranks in self.tokens_per_rank]

    def max_tokens_per_rank(self) -> list[int]:
        return [max(ranks) for ranks in self.tokens_per_rank]

    def balancedness(self) -> list[float]:
        """Per layer, mean / max tokens per rank: 1.0 is perfectly even (and a layer that
        got no tokens counts as balanced), 1 / ranks is one rank doing it all."""
        return [mean / top if top else 1.0 for mean, top in zip(self.mean_tokens_per_rank(), self.max_tokens_per_rank())]

    @classmethod
    def from_expert_counts(
        cls, tokens_per_expert: Sequence[Sequence[int]] | np.ndarray, window_steps: int, placement: Placement | None = None
    ) -> "ExpertLoad":
        """From tokens per expert over the window [layer][logical expert]: summed per rank
        under the placement (an expert's tokens split evenly over its replicas, rounded),
        or, with no placement, one rank holding every expert (a single-process engine)."""
        counts = np.asarray(tokens_per_expert, dtype=np.int64)
        if counts.ndim != 2:
            raise ValueError(f"tokens per expert must be [layers, experts], got shape {counts.shape}")
        if placement is None:
            per_rank = counts.sum(-1, keepdims=True)
        else:
            per_rank = np.rint(placement.rank_loads(counts)).astype(np.int64)
        return cls(per_rank.tolist(), window_steps)
