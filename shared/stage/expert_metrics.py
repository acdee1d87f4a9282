"""An MoE worker's expert-load series (issue 28, the EP balancer): per MoE layer, the
balancedness of its expert load (mean / max tokens per rank) and the mean and max it is
made of, over the window its heartbeat reports. Per layer, never summed over layers:
each layer's all-to-all waits for that layer's busiest rank.

Labelled by layer only, not by (layer, rank): at DeepSeek-V3's decode EP that would be
58 x 144 series per instance, and the per-layer mean and max already say how far the
busiest rank is ahead. A dashboard plots `min by (pod) (..._eplb_balancedness)` (the
worst layer, the one the balancer routes by) and the layers as a heatmap.

`layer` counts the model's MoE layers from 0, in model order (a model's dense layers
have no number), as the heartbeat's list does. Only an MoE engine creates them (a
dense model exports none)."""

from shared.engine.eplb.expert_load import ExpertLoad
from shared.runtime.metrics import Metrics


class ExpertLoadMetrics:
    def __init__(self, metrics: Metrics) -> None:
        layer = ("layer",)
        self.balancedness = metrics.gauge(
            "eplb_balancedness", "Per MoE layer, mean / max tokens per expert-parallel rank over the window (1: even)", layer
        )
        self.mean_tokens = metrics.gauge(
            "expert_tokens_per_rank_mean", "Per MoE layer, the mean over ranks of the (token, expert) pairs a rank computed over the window", layer
        )
        self.max_tokens = metrics.gauge(
            "expert_tokens_per_rank_max", "Per MoE layer, the busiest rank's (token, expert) pairs over the window", layer
        )
        self.num_ranks = metrics.gauge("expert_parallel_ranks", "Ranks the experts are spread over (1: one process)")
        self.window_steps = metrics.gauge("eplb_window_steps", "Engine steps the expert-load window holds")
        self.rebalances = metrics.counter(
            "eplb_rebalances", "EPLB placements applied that moved experts (every changed layer switched on every rank)"
        )
        self._rebalances_counted = 0
        """The engine's count (ExpertLoad.num_rebalances) the counter holds: it is advanced by the difference."""

    def update(self, load: ExpertLoad) -> None:
        for layer, (balance, mean, top) in enumerate(
            zip(load.balancedness(), load.mean_tokens_per_rank(), load.max_tokens_per_rank())
        ):
            name = str(layer)
            self.balancedness.labels(name).set(balance)
            self.mean_tokens.labels(name).set(mean)
            self.max_tokens.labels(name).set(top)
        self.num_ranks.set(load.num_ranks)
        self.window_steps.set(load.window_steps)
        if load.num_rebalances > self._rebalances_counted:
            self.rebalances.inc(load.num_rebalances - self._rebalances_counted)
            self._rebalances_counted = load.num_rebalances
