"""A model's MoE layers made expert-parallel over the ranks of one instance (issue 28).
Every rank runs the same step (the executor sends each rank the same scheduler
output); the rest of the model is as its ``ParallelContext`` built it: tensor-parallel
over the same ranks (vLLM's ``--tensor-parallel-size N --enable-expert-parallel``:
Qwen3-MoE, GPT-OSS, DeepSeek-V4; heads split, o_proj's all-reduce), or whole on every
rank (data-parallel attention, below). Either way each MoE layer's input is the whole step on every rank, and each
MoE layer splits the step's tokens across the ranks: rank r takes its 1/N slice,
routes it, dispatches its (token, choice) pairs to the ranks holding their experts
and combines them back (shared/model/expert_parallel.py), adds its shared experts,
and the slices are all-gathered so every rank again holds the whole step. DeepSeek's
layout (each rank its own batch, its own attention) is ``split_tokens=False``: the
engine then schedules each rank's own requests (shared/engine/dp_scheduler.py) and
the MoE layers take them whole.

The MoE layers' outputs are the single process's: the all-gather is a copy, and a
token's MoE output depends on its own row only (bitwise so under batch-invariant
mode, whose kernels are per-row invariant; within float rounding otherwise, the
matmuls seeing other row counts). Tensor-parallel attention adds its own rounding
(o_proj's partial sums), so the model's logits are within float rounding of one
process's in every mode.

The per-expert counts: each rank's ``expert_counts`` holds its slice's counts after
the MoE layers; one all-reduce after the forward (a hook on the model) turns them
into the whole step's, on every rank. One small collective per step on the device,
rather than each worker sending its counts to rank 0 (a device-to-host read and a
pickle per worker per step): the engine's counts (EPLB's window, EngineLoad) are
then the instance's, as they are with one rank.

``move_layer_weights`` gathers one layer's experts for a new placement into new buffers
while the layer runs on with its old ones; ``switch_layer`` then swaps them in. Every
rank moves the same layer, and switches it before the same step (the executor's
mover, shared/engine/executor/expert_mover.py).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shared.model.expert_dispatch import AllToAllDispatcher
from shared.model.expert_parallel import (
    ExpertParallelExperts,
    ExpertShard,
    install_expert_parallel,
    move_experts,
    sparse_blocks,
)
from shared.model.interface import CausalLM
from shared.model.moe import Experts, SparseMoE
from shared.model.parallel import ParallelContext


class TokenSplitMoE(nn.Module):
    """An expert-parallel ``SparseMoE`` (``block``) fed this rank's slice of the step's
    tokens: the same call as the block (x [T, hidden], the input ids for hash routing,
    the rows to count), the whole step's output on every rank."""

    def __init__(self, block: SparseMoE, parallel: ParallelContext) -> None:
        super().__init__()
        if not parallel.is_expert_parallel:
            raise ValueError("a token split needs an expert-parallel group (ep_size > 1)")
        self.block = block
        self.rank, self.num_ranks, self.group = parallel.ep_rank, parallel.ep_size, parallel.ep_group

    @property
    def host_sync_free(self) -> bool:
        """Never: the dispatch reads its split sizes on the host (no CUDA graph)."""
        return False

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor | None = None, counted: torch.Tensor | None = None
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        per_rank = -(-num_tokens // self.num_ranks)  # equal slices (the last ones short or empty) for one all-gather
        start = min(self.rank * per_rank, num_tokens)
        stop = min(start + per_rank, num_tokens)
        out = self.block(
            x[start:stop],
            None if input_ids is None else input_ids[start:stop],
            None if counted is None else counted[start:stop],
        )
        padded = out.new_zeros((per_rank, *out.shape[1:]))
        padded[: stop - start] = out
        parts = [torch.empty_like(padded) for _ in range(self.num_ranks)]
        assert self.group is not None
        self.group.allgather([parts], [padded]).wait()
        return torch.cat(parts)[:num_tokens]


def make_expert_parallel(
    model: CausalLM, slot_experts: Sequence[Sequence[int]], parallel: ParallelContext, split_tokens: bool = True
) -> None:
    """Make ``model`` (built whole) expert-parallel over ``parallel``'s group: MoE layer i
    keeps the experts of this rank's slots of ``slot_experts[i]`` (an EPLB placement's
    ``phy_to_log`` rows) and drops the others, and (``split_tokens``: every rank runs the
    same step) takes its slice of each step's tokens. Without ``split_tokens`` (data-parallel
    attention: each rank runs its own requests) each MoE layer dispatches all of the rank's
    tokens and returns their outputs, no all-gather. Every rank calls it with the same placement."""
    blocks = sparse_blocks(model)
    counts = model.expert_counts
    if not blocks or counts is None:
        raise ValueError(f"expert parallelism needs MoE layers: {model.config.architecture} has none")
    if counts.shape[0] != len(blocks) or len(slot_experts) != len(blocks):
        raise ValueError(f"{len(blocks)} MoE blocks, {counts.shape[0]} count rows, {len(slot_experts)} placement rows")
    dispatcher = AllToAllDispatcher(parallel.ep_group)
    for block, slots in zip(blocks, slot_experts):
        device = block.experts.stacked()["gate_up_proj"].device
        shard = ExpertShard.from_slots(slots, counts.shape[1], parallel.ep_size, parallel.ep_rank, device)
        install_expert_parallel(block, shard, dispatcher)
    for parent in list(model.modules()) if split_tokens else []:
        for name, child in list(parent.named_children()):
            if isinstance(child, SparseMoE):
                setattr(parent, name, TokenSplitMoE(child, parallel))
    group = parallel.ep_group
    assert group is not None

    def sum_counts_over_ranks(module: nn.Module, args: Any, output: Any) -> None:
        group.allreduce([counts]).wait()

    model.register_forward_hook(sum_counts_over_ranks)


def rank_experts(slot_experts: Sequence[Sequence[int]], parallel: ParallelContext) -> list[list[int]]:
    """The experts of this rank's slots in each MoE layer (``slot_experts``: the
    placement's ``phy_to_log`` rows): what the loader reads for it (``load_model``'s
    ``held_experts``) before ``make_expert_parallel`` keeps them."""
    out: list[list[int]] = []
    for row in slot_experts:
        per_rank = len(row) // parallel.ep_size
        out.append([int(e) for e in row[parallel.ep_rank * per_rank : (parallel.ep_rank + 1) * per_rank]])
    return out


@dataclass(frozen=True, slots=True)
class MovedLayer:
    """One MoE layer's experts gathered for a new placement, in new buffers beside the
    ones the layer runs (which stay in use until ``switch_layer``)."""

    layer: int
    shard: ExpertShard
    local: Experts


def move_layer_weights(
    model: CausalLM, layer: int, slot_experts: Sequence[int], group: dist.ProcessGroup | None
) -> MovedLayer:
    """MoE layer ``layer``'s experts for the placement ``slot_experts`` (its new
    ``phy_to_log`` row), gathered from the ranks holding them (one all-to-all on
    ``group``) into new buffers; the layer goes on running its old ones. Every rank
    calls it for the same layer; it may run beside steps (the executor's mover thread),
    since it only reads the layer's weights. Costs one layer's rank slots of new
    weights, plus the all-to-all's send and receive copies, until the old ones are freed."""
    experts = _expert_parallel(model, layer)
    old = experts.shard
    new = ExpertShard.from_slots(slot_experts, old.num_experts, old.num_ranks, old.rank, old.slot_experts.device)
    with torch.inference_mode():  # the weights are inference tensors, like the runner's forward
        return MovedLayer(layer, new, move_experts(old, experts.local, new, group))


def switch_layer(model: CausalLM, moved: MovedLayer) -> None:
    """The layer takes its new placement and weights together: between steps, the same
    step on every rank (the old weights are freed once the last forward that read them is)."""
    _expert_parallel(model, moved.layer).switch(moved.shard, moved.local)


def layer_slots(model: CausalLM, layer: int) -> list[int]:
    """The placement MoE layer ``layer`` runs now (its ``phy_to_log`` row)."""
    return [int(e) for e in _expert_parallel(model, layer).shard.slot_experts.tolist()]


def _expert_parallel(model: CausalLM, layer: int) -> ExpertParallelExperts:
    experts = sparse_blocks(model)[layer].experts
    if not isinstance(experts, ExpertParallelExperts):
        raise ValueError(f"MoE layer {layer} is not expert-parallel")
    return experts
