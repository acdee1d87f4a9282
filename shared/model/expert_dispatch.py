"""Moving (token, choice) pairs to the ranks that hold their experts and their outputs
back: the dispatch and combine of expert parallelism (issue 28), behind one small
interface so that another transport can replace the all-to-all.

The interface is DeepEP's shape (``Buffer.dispatch`` / ``Buffer.combine``): dispatch
takes each token's hidden state, its k *physical* expert slots (a replica already
chosen: shared/model/expert_parallel.py) and its k routing weights, and returns what
this rank received plus a handle; combine takes the received pairs' outputs, in the
order they were received, and returns each local token's sum over its k choices.
DeepEP itself does not install here (it builds against NVSHMEM and CUDA only), so the
one implementation is ``AllToAllDispatcher``: ``torch.distributed.all_to_all_single``
with the split sizes exchanged first. That collective is in NCCL and in gloo (gloo
implements it on CPU tensors, uneven splits included), so the CPU tests run the code
the GPUs run.

Every rank of the group must call dispatch and combine for every MoE layer of every
step, with no tokens if it has none (data-parallel attention: DeepSeek runs an empty
batch on an idle rank): a collective that one rank skips hangs the others.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from shared.model.moe import sum_over_choices


@dataclass(frozen=True, slots=True)
class ReceivedPairs:
    """The (token, choice) pairs a rank computes: rows in the order received (by
    source rank, then in the source's send order)."""

    hidden: torch.Tensor
    """[R, hidden]: each pair's token hidden state."""
    local_slots: torch.Tensor
    """[R] int64: the pair's expert as this rank's slot number (0 .. slots_per_rank - 1)."""
    weights: torch.Tensor
    """[R]: the pair's routing weight (the experts' kernel weighs each output)."""


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    """Where a rank's pairs go: what the combine needs to put the outputs back."""

    order: torch.Tensor
    """[P] int64: the pairs (``token * k + choice``) in send order, grouped by destination rank."""
    local_slots: torch.Tensor
    """[P] int64, in send order: the pair's slot on its destination rank."""
    send_counts: list[int]
    """Pairs sent to each rank (host ints: all_to_all_single takes its splits on the host)."""
    num_tokens: int
    top_k: int


def plan_dispatch(slots: torch.Tensor, slots_per_rank: int, num_ranks: int) -> DispatchPlan:
    """slots [T, k] int64 physical expert slots (slot ``r * slots_per_rank + s`` is slot s
    of rank r) -> the send order. A stable sort keeps each destination's pairs in token
    order. The host reads the per-rank counts here: the one sync of the dispatch."""
    num_tokens, top_k = slots.shape
    flat = slots.reshape(-1)
    destination = flat // slots_per_rank
    order = torch.sort(destination, stable=True).indices
    send_counts = torch.bincount(destination, minlength=num_ranks).tolist()
    return DispatchPlan(order, (flat % slots_per_rank)[order], send_counts, num_tokens, top_k)


@dataclass(frozen=True, slots=True)
class CombineHandle:
    """What a dispatch leaves for its combine."""

    plan: DispatchPlan
    recv_counts: list[int]
    """Pairs received from each rank."""


class ExpertDispatcher(Protocol):
    """The transport of one expert-parallel group (every rank holds one)."""

    def dispatch(
        self, hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, slots_per_rank: int
    ) -> tuple[ReceivedPairs, CombineHandle]:
        """hidden [T, hidden], slots and weights [T, k] -> the pairs this rank computes."""
        ...

    def combine(self, outputs: torch.Tensor, handle: CombineHandle) -> torch.Tensor:
        """outputs [R, hidden] (the received pairs', weighted, in received order) -> [T,
        hidden]: each local token's k outputs added in choice order."""
        ...


class AllToAllDispatcher:
    """Dispatch and combine by ``all_to_all_single`` over a process group (NCCL or gloo).
    Each pair's hidden state travels once per choice (no dedup of a token sent twice to
    one rank, which DeepEP does): simple, and the CPU tests do not care."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        # The group's own rank and size: dist.get_rank(group) needs torch.distributed's
        # default group, which an engine's group (made from its own store) goes without.
        self.rank = dist.get_rank() if group is None else group.rank()
        self.num_ranks = dist.get_world_size() if group is None else group.size()

    def _exchange(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=self.group)
        return recv

    def dispatch(
        self, hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, slots_per_rank: int
    ) -> tuple[ReceivedPairs, CombineHandle]:
        plan = plan_dispatch(slots, slots_per_rank, self.num_ranks)
        counts = torch.tensor(plan.send_counts, dtype=torch.int64, device=hidden.device)
        recv_counts_tensor = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts_tensor, counts, group=self.group)
        recv_counts = recv_counts_tensor.tolist()
        token_of_pair = plan.order // plan.top_k
        received = ReceivedPairs(
            self._exchange(hidden[token_of_pair], plan.send_counts, recv_counts),
            self._exchange(plan.local_slots, plan.send_counts, recv_counts),
            self._exchange(weights.reshape(-1)[plan.order], plan.send_counts, recv_counts),
        )
        return received, CombineHandle(plan, recv_counts)

    def combine(self, outputs: torch.Tensor, handle: CombineHandle) -> torch.Tensor:
        plan = handle.plan
        back = self._exchange(outputs, handle.recv_counts, plan.send_counts)  # [P] in send order
        per_pair = torch.empty_like(back)
        per_pair[plan.order] = back
        return sum_over_choices(per_pair.view(plan.num_tokens, plan.top_k, outputs.shape[-1]))
