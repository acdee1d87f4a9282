"""Live EPLB for one MoE engine (issue 28): the placement its ranks run now, the
window of per-step expert counts it is judged on, and the rebalancing. Every MoE
engine keeps one, so that its expert load (``expert_load``, the heartbeat's and the
metrics') comes from this one window: a one-rank engine's (one process, or tensor
parallel without expert parallelism) only measures, its placement one rank holding
every expert.

The engine calls ``record`` with each step's tokens per expert (the whole instance's:
the ranks all-reduce them) and then ``next_move``. Every ``step_interval`` recorded
steps a new placement is computed from the window on a background thread (numpy
releases the GIL in its array work, so the step loop runs on meanwhile); once it is
ready, ``next_move`` hands out one changed MoE layer at a time (the engine asks
whenever the executor takes one), whose weights the executor's ranks move in the
background while steps run on, then switch before one same step
(shared/engine/executor/move_schedule.py). A request never sees a half-moved layer: each layer's placement
is whole, old or new, in every forward. Torch-free.
"""

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from shared.engine.config import EplbConfig
from shared.engine.eplb.expert_load import ExpertLoad
from shared.engine.eplb.load_window import LoadWindow
from shared.engine.eplb.placement import Placement, PlacementSpec, compute_placement, initial_placement, with_layer


@dataclass(frozen=True, slots=True)
class ExpertMove:
    """One MoE layer's new placement: the logical expert of each physical slot (its
    ``phy_to_log`` row). Sent to every rank with a step, moved beside the following ones."""

    layer: int
    slot_experts: tuple[int, ...]


class ExpertBalancer:
    """``rebalance`` False: the placement stays the initial one, and the balancer only
    measures (EngineConfig.enable_eplb off, or one rank)."""

    def __init__(self, num_layers: int, num_experts: int, num_ranks: int, config: EplbConfig, rebalance: bool) -> None:
        self.spec = PlacementSpec(num_ranks, config.num_redundant_experts)
        self.placement: Placement = initial_placement(num_layers, num_experts, self.spec)
        """What the ranks run (or will, once the move in flight switches: a handed-out move counts)."""
        self.window = LoadWindow(num_layers, num_experts, config.window_size)
        self.step_interval = config.step_interval
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="eplb-placement") if rebalance else None
        self._computing: Future[Placement] | None = None
        self._target: Placement | None = None
        self._steps_since_placement = 0
        self._moves_toward_target = 0
        self.num_rebalances = 0
        """Placements that moved at least one layer, every layer of them applied."""
        self.num_layer_moves = 0

    def record(self, counts: np.ndarray) -> None:
        """One step's tokens per expert [MoE layers, experts], the whole instance's."""
        self.window.record(counts)
        self._steps_since_placement += 1

    def next_move(self) -> ExpertMove | None:
        """The next layer to move, if any (the executor takes one at a time)."""
        if self._pool is None:
            return None
        if self._target is None and self._computing is not None and self._computing.done():
            self._target, self._computing = self._computing.result(), None
        if self._target is not None:
            return self._move_toward(self._target)
        if self._computing is None and self._steps_since_placement >= self.step_interval:
            self._steps_since_placement = 0
            self._computing = self._pool.submit(compute_placement, self.window.total(), self.spec)
        return None

    def _move_toward(self, target: Placement) -> ExpertMove | None:
        changed = np.flatnonzero((self.placement.phy_to_log != target.phy_to_log).any(axis=1))
        if changed.size == 0:  # every layer there (or the new placement is the one running)
            self._target = None
            self.num_rebalances += self._moves_toward_target > 0
            self._moves_toward_target = 0
            return None
        layer = int(changed[0])
        self.placement = with_layer(self.placement, layer, target.phy_to_log[layer])
        self.num_layer_moves += 1
        self._moves_toward_target += 1
        return ExpertMove(layer, tuple(int(e) for e in target.phy_to_log[layer]))

    def expert_load(self) -> ExpertLoad:
        return ExpertLoad.from_expert_counts(
            self.window.total(), self.window.num_steps, self.placement,
            num_rebalances=self.num_rebalances, num_redundant_experts=self.spec.num_redundant_experts,
        )  # fmt: skip

    def close(self) -> None:
        """Stop the placement thread (a computation under way is abandoned)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
