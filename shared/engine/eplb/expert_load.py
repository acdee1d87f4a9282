"""An MoE instance's expert load as the engine reports it and the mesh carries it (the
heartbeat, the metrics, the EP balancer): per MoE layer, the tokens each rank's experts
took over a window of engine steps, and the layer's balancedness, mean over max tokens
per rank. Per layer, never summed over layers: a layer's all-to-all waits for that
layer's busiest rank.

Made by the engine from the window of counts every MoE engine keeps
(`LLMEngine.expert_load`, through eplb/balancer.py), one-rank engines included."""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared.engine.eplb.placement import Placement


@dataclass(frozen=True, slots=True)
class ExpertLoad:
    tokens_per_rank: tuple[tuple[float, ...], ...]
    """[MoE layer][rank]: (token, choice) pairs routed to the rank's experts over the
    window, under the placement the ranks run now; an expert with replicas has its
    tokens split evenly over them (EPLB's own estimate: the dispatch spreads a hot
    expert's tokens over its replicas round-robin by token)."""
    window_steps: int
    """Steps the figures cover (the window, or fewer until it first fills)."""
    num_rebalances: int = 0
    """New placements fully handed out to the ranks (each that changed a layer) since the
    engine started."""
    num_redundant_experts: int = 0
    """Slots beyond one per expert, over all ranks."""

    def __post_init__(self) -> None:  # any nested sequence in, one hashable shape out
        rows = tuple(tuple(float(t) for t in row) for row in self.tokens_per_rank)
        object.__setattr__(self, "tokens_per_rank", rows)

    @property
    def num_layers(self) -> int:
        return len(self.tokens_per_rank)

    @property
    def num_ranks(self) -> int:
        return len(self.tokens_per_rank[0]) if self.tokens_per_rank else 0

    def mean_tokens_per_rank(self) -> list[float]:
        return [sum(ranks) / len(ranks) for ranks in self.tokens_per_rank]

    def max_tokens_per_rank(self) -> list[float]:
        return [max(ranks) for ranks in self.tokens_per_rank]

    def balancedness(self) -> list[float]:
        """Per layer, mean / max tokens per rank: 1.0 is perfectly even (and a layer that
        got no tokens counts as balanced), 1 / ranks is one rank doing it all."""
        return [mean / top if top else 1.0 for mean, top in zip(self.mean_tokens_per_rank(), self.max_tokens_per_rank())]

    @classmethod
    def from_expert_counts(
        cls, tokens_per_expert: Sequence[Sequence[int]] | np.ndarray, window_steps: int, placement: Placement,
        **counters: int,
    ) -> "ExpertLoad":  # fmt: skip
        """From tokens per expert over the window [layer][logical expert]: summed per rank
        under the placement (an expert's tokens split evenly over its replicas; a one-rank
        placement holds every expert)."""
        counts = np.asarray(tokens_per_expert, dtype=np.int64)
        if counts.ndim != 2:
            raise ValueError(f"tokens per expert must be [layers, experts], got shape {counts.shape}")
        return cls(placement.rank_loads(counts).tolist(), window_steps, **counters)
