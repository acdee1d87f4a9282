"""Expert parallelism for the MoE layers (issue 28), with data-parallel attention as
DeepSeek runs it: every rank routes its own tokens, sends each (token, choice) pair to
a rank holding a replica of its expert, computes the pairs it receives with its own
experts and gets its pairs' outputs back (shared/model/expert_dispatch.py moves them).

- ``ExpertShard``: one MoE layer's placement as one rank needs it: the logical expert
  of every physical slot (an EPLB placement's ``phy_to_log`` row, redundant replicas
  included, or the static contiguous one) and, per expert, the slots holding it.
- ``ExpertParallelExperts``: stands in for a ``SparseMoE``'s ``experts`` (same call,
  same result), so the router, the per-expert counts and the shared experts stay the
  block's own and run locally: the counts are of this rank's tokens per logical
  expert, on the device (the group's counts are their sum), and the shared experts
  are replicated. The experts it computes are an ``Experts`` of the rank's slots, run
  by the model's own kernel (the PyTorch path, the fused MoE, or batch-invariant
  mode's ``InvariantExperts``, under which a pair's output is bitwise the
  single-process one's wherever it is computed).
- ``switch``: a new placement and the weights for it, swapped in together between
  steps; ``move_experts`` gathers those weights from the ranks that hold them now
  (one all-to-all per layer), ``Experts.select`` from a full host copy.

A replica is chosen per pair as ``(token index + rank) % replicas``: deterministic
(the same batch goes to the same slots), spread over the replicas, and free of the
outputs (every replica holds the same weights).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shared.model.expert_dispatch import ExpertDispatcher
from shared.model.moe import Experts, SparseMoE


@dataclass(frozen=True)
class ExpertShard:
    """One MoE layer's placement, seen from one rank of the expert-parallel group.
    Physical slot ``r * slots_per_rank + s`` is slot s of rank r (as shared/engine/eplb)."""

    rank: int
    num_ranks: int
    slots_per_rank: int
    slot_experts: torch.Tensor
    """[num_ranks * slots_per_rank] int64: the logical expert in each physical slot."""
    replica_slots: torch.Tensor
    """[num_experts, max replicas] int64: each expert's slots, ascending, padded with its
    last one (never read: a replica index is below the count)."""
    replica_counts: torch.Tensor
    """[num_experts] int64, each >= 1."""

    @classmethod
    def from_slots(
        cls, slot_experts: Sequence[int] | torch.Tensor, num_experts: int, num_ranks: int, rank: int,
        device: torch.device | str = "cpu",
    ) -> "ExpertShard":  # fmt: skip
        """From the logical expert of each physical slot (``Placement.phy_to_log[layer]``)."""
        slots = torch.as_tensor(slot_experts, dtype=torch.int64).reshape(-1).cpu()
        if not 0 <= rank < num_ranks or slots.numel() % num_ranks:
            raise ValueError(f"{slots.numel()} slots do not divide over {num_ranks} ranks (rank {rank})")
        if slots.numel() and (slots.min() < 0 or slots.max() >= num_experts):
            raise ValueError(f"a slot holds an expert outside 0 .. {num_experts - 1}")
        counts = torch.bincount(slots, minlength=num_experts)
        if (counts == 0).any():
            missing = torch.nonzero(counts == 0).flatten().tolist()
            raise ValueError(f"experts {missing} have no slot: every expert needs a replica")
        order = torch.sort(slots, stable=True).indices  # slots grouped by expert, ascending within one
        starts = counts.cumsum(0) - counts
        width = int(counts.max())
        within = torch.arange(width)[None, :].clamp(max=counts[:, None] - 1)  # pad with the last replica
        replica_slots = order[starts[:, None] + within]
        device = torch.device(device)
        return cls(rank, num_ranks, slots.numel() // num_ranks, slots.to(device), replica_slots.to(device),
                   counts.to(device))  # fmt: skip

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int, rank: int, device: torch.device | str = "cpu") -> "ExpertShard":
        """The static placement: expert e on rank e // (num_experts / num_ranks), no replicas."""
        return cls.from_slots(torch.arange(num_experts), num_experts, num_ranks, rank, device)

    @property
    def num_experts(self) -> int:
        return self.replica_counts.shape[0]

    def local_experts(self, rank: int | None = None) -> torch.Tensor:
        """[slots_per_rank]: the logical expert of each of a rank's slots (this one's by default)."""
        r = self.rank if rank is None else rank
        return self.slot_experts[r * self.slots_per_rank : (r + 1) * self.slots_per_rank]

    def choose_replicas(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, k] logical experts -> [T, k] physical slots: replica
        ``(token index + rank) % replicas`` of each pair's expert."""
        token = torch.arange(ids.shape[0], device=ids.device)[:, None]
        replica = (token + self.rank) % self.replica_counts[ids]
        return self.replica_slots[ids, replica]


class ExpertParallelExperts(nn.Module):
    """A ``SparseMoE``'s ``experts`` on one rank of an expert-parallel group: x [T, hidden],
    ids and weights [T, k] (this rank's tokens) -> [T, hidden], the sum over the k
    choices of weight * expert(x), the experts computed wherever they live. ``local``:
    the rank's slots as an ``Experts`` (expert s is slot s)."""

    def __init__(self, shard: ExpertShard, local: Experts, dispatcher: ExpertDispatcher) -> None:
        super().__init__()
        _check_fits(shard, local)
        self.shard = shard
        self.local = local
        self.dispatcher = dispatcher

    @property
    def host_sync_free(self) -> bool:
        """Never: the all-to-all takes its split sizes on the host (no CUDA graph)."""
        return False

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        shard, local = self.shard, self.local  # one placement for the whole forward
        slots = shard.choose_replicas(ids)
        received, handle = self.dispatcher.dispatch(x, slots, weights, shard.slots_per_rank)
        outputs = local(received.hidden, received.local_slots[:, None], received.weights[:, None])
        return self.dispatcher.combine(outputs, handle)

    def switch(self, shard: ExpertShard, local: Experts) -> None:
        """Take a new placement and its weights together (between steps: every rank of the
        group must switch the same layer before its next forward)."""
        if (shard.rank, shard.num_ranks) != (self.shard.rank, self.shard.num_ranks):
            raise ValueError("a placement switch keeps the rank and the group")
        _check_fits(shard, local)
        self.shard, self.local = shard, local


def _check_fits(shard: ExpertShard, local: Experts) -> None:
    held = local.stacked()["gate_up_proj"].shape[0]
    if held != shard.slots_per_rank:
        raise ValueError(f"the rank has {shard.slots_per_rank} slots but {held} experts were given")


def install_expert_parallel(block: SparseMoE, shard: ExpertShard, dispatcher: ExpertDispatcher) -> None:
    """Make ``block`` expert-parallel: its experts become the rank's slots of ``shard``
    (copied from the block's full experts, which are then dropped from it)."""
    full = block.experts
    if not isinstance(full, Experts):
        raise ValueError("the block is expert-parallel already: use switch for a new placement")
    if full.moe.num_experts != shard.num_experts:
        raise ValueError(f"the placement has {shard.num_experts} experts, the block {full.moe.num_experts}")
    block.experts = ExpertParallelExperts(shard, full.select(shard.local_experts()), dispatcher)


def sparse_blocks(model: nn.Module) -> list[SparseMoE]:
    """The model's MoE blocks in layer order: the rows of its ``expert_counts`` and of an
    EPLB placement."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def move_experts(old: ExpertShard, old_local: Experts, new: ExpertShard, group: dist.ProcessGroup | None = None) -> Experts:
    """The rank's experts for placement ``new``, moved from where ``old`` put them: each of
    its new slots copied from its own old slots where it held that expert, else sent by
    the lowest rank that held it. One all-to-all of whole experts (every weight of an
    expert flattened into one row); every rank of the group calls it for the same layer.
    The plan is the same on every rank: each one computes it from the two placements."""
    num_ranks, rank = old.num_ranks, old.rank
    if (new.num_ranks, new.rank) != (num_ranks, rank) or new.num_experts != old.num_experts:
        raise ValueError("a move keeps the group, the rank and the number of experts")
    old_slots = old.slot_experts.tolist()
    new_slots = new.slot_experts.tolist()
    held_by = [{old_slots[r * old.slots_per_rank + s] for s in range(old.slots_per_rank)} for r in range(num_ranks)]
    holders: dict[int, int] = {}
    for slot, expert in enumerate(old_slots):
        holders.setdefault(expert, slot // old.slots_per_rank)  # the lowest rank holding it

    def source(r: int, expert: int) -> int:
        return r if expert in held_by[r] else holders[expert]

    mine = old_slots[rank * old.slots_per_rank : (rank + 1) * old.slots_per_rank]
    send_rows: list[int] = []  # my old slot of each expert I send, by destination rank then its slot
    send_counts = [0] * num_ranks
    for r in range(num_ranks):
        for s in range(new.slots_per_rank):
            expert = new_slots[r * new.slots_per_rank + s]
            if source(r, expert) == rank:
                send_rows.append(mine.index(expert))
                send_counts[r] += 1
    recv_slots: list[int] = []  # my new slot of each expert received, by source rank then slot
    recv_counts = [0] * num_ranks
    for q in range(num_ranks):
        for s in range(new.slots_per_rank):
            if source(rank, new_slots[rank * new.slots_per_rank + s]) == q:
                recv_slots.append(s)
                recv_counts[q] += 1
    stacked = old_local.stacked()
    flat = torch.cat([t.reshape(t.shape[0], -1) for t in stacked.values()], dim=1)
    device = flat.device
    received = flat.new_empty((sum(recv_counts), flat.shape[1]))
    dist.all_to_all_single(received, flat[torch.tensor(send_rows, dtype=torch.int64, device=device)].contiguous(),
                           recv_counts, send_counts, group=group)  # fmt: skip
    moved = old_local.select(torch.zeros(new.slots_per_rank, dtype=torch.int64))  # shapes and kernel; filled below
    rows = torch.empty_like(received)
    rows[torch.tensor(recv_slots, dtype=torch.int64, device=device)] = received
    start = 0
    for name, whole in stacked.items():
        width = whole[0].numel()
        getattr(moved, name).copy_(rows[:, start : start + width].reshape(new.slots_per_rank, *whole.shape[1:]))
        start += width
    return moved
