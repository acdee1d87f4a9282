"""What an expert-parallel engine reports of its experts' load (``LLMEngine.expert_load``):
per MoE layer, the tokens each rank's experts took over EPLB's window and the layer's
balancedness, mean over max tokens per rank. Per layer, never summed over layers: a
layer's all-to-all waits for that layer's slowest rank. Plain Python (no torch, no
numpy): the heartbeat and the metrics carry it as it is."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExpertLoad:
    num_ranks: int
    window_steps: int
    """Steps the figures cover (the window, or fewer until it first fills)."""
    tokens_per_rank: tuple[tuple[float, ...], ...]
    """[MoE layer][rank]: (token, choice) pairs routed to the rank's experts over the
    window, under the placement the ranks run now; an expert with replicas has its
    tokens split evenly over them (EPLB's own estimate: the dispatch spreads a hot
    expert's tokens over its replicas round-robin by token)."""
    balancedness: tuple[float, ...]
    """[MoE layer]: mean / max of that layer's tokens_per_rank; 1.0 is perfect, and a
    layer with no tokens yet counts as balanced."""
    num_rebalances: int
    """New placements fully handed out to the ranks (each that changed a layer) since the
    engine started."""
    num_redundant_experts: int
    """Slots beyond one per expert, over all ranks."""
