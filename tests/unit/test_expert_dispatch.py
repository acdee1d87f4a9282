"""Expert parallelism's bookkeeping without processes (shared/model/expert_parallel.py,
expert_dispatch.py): a placement's reverse map and its refusals, the replica each
(token, choice) pair takes, the send order and counts of a dispatch, and a rank's
experts copied out of the full stack."""

import pytest
import torch

from shared.model.expert_dispatch import plan_dispatch
from shared.model.expert_parallel import ExpertShard
from shared.model.moe import Experts
from shared.model.moe_config import MoEConfig

# 8 experts on 4 ranks of 3 slots: expert 0 three times, experts 1 and 3 twice.
SLOTS = [0, 1, 2, 3, 0, 4, 5, 6, 7, 3, 1, 0]


def test_shard_maps_each_expert_to_its_slots() -> None:
    shard = ExpertShard.from_slots(SLOTS, 8, 4, rank=1)
    assert shard.slots_per_rank == 3
    assert shard.local_experts().tolist() == [3, 0, 4]
    assert shard.replica_counts.tolist() == [3, 2, 1, 2, 1, 1, 1, 1]
    assert [shard.replica_slots[e, : int(n)].tolist() for e, n in enumerate(shard.replica_counts)] == [
        [0, 4, 11], [1, 10], [2], [3, 9], [5], [6], [7], [8],
    ]  # fmt: skip
    assert ExpertShard.contiguous(8, 4, rank=2).local_experts().tolist() == [4, 5]


def test_shard_refuses_a_lost_expert_and_uneven_slots() -> None:
    with pytest.raises(ValueError, match=r"experts \[5\] have no slot"):
        ExpertShard.from_slots([0, 1, 2, 3, 4, 6, 7, 0], 8, 2, rank=0)
    with pytest.raises(ValueError, match="do not divide"):
        ExpertShard.from_slots(list(range(8)) + [0], 8, 2, rank=0)
    with pytest.raises(ValueError, match="outside"):
        ExpertShard.from_slots(list(range(7)) + [8], 8, 2, rank=0)


def test_replica_is_token_index_plus_rank_modulo_replicas() -> None:
    ids = torch.tensor([[0, 3], [0, 1], [7, 0], [2, 0]])
    for rank in range(4):
        shard = ExpertShard.from_slots(SLOTS, 8, 4, rank)
        slots = shard.choose_replicas(ids)
        assert torch.equal(shard.slot_experts[slots], ids)  # every pair goes to its own expert
        for t in range(4):
            for c in range(2):
                e = int(ids[t, c])
                replicas = shard.replica_slots[e, : int(shard.replica_counts[e])].tolist()
                assert int(slots[t, c]) == replicas[(t + rank) % len(replicas)]
    # Expert 0's three replicas serve rank 0's tokens 0, 1, 2 in turn (slots 0, 4, 11).
    assert ExpertShard.from_slots(SLOTS, 8, 4, 0).choose_replicas(ids)[:3, :].tolist() == [[0, 3], [4, 10], [8, 11]]


def test_plan_groups_pairs_by_destination_in_token_order() -> None:
    slots = torch.tensor([[4, 9], [11, 1], [8, 0]])  # ranks [[1, 3], [3, 0], [2, 0]]
    plan = plan_dispatch(slots, slots_per_rank=3, num_ranks=4)
    assert plan.send_counts == [2, 1, 1, 2]
    assert plan.order.tolist() == [3, 5, 0, 4, 1, 2]  # pairs token * k + choice
    assert plan.local_slots.tolist() == [1, 0, 1, 2, 0, 2]
    empty = plan_dispatch(torch.empty(0, 2, dtype=torch.int64), 3, 4)
    assert empty.send_counts == [0, 0, 0, 0] and empty.order.numel() == 0


def test_select_copies_the_chosen_experts_with_the_kernel() -> None:
    moe = MoEConfig(4, 2, 6, expert_bias=True)
    experts = Experts(5, moe, torch.float32, torch.device("cpu"))
    for i, p in enumerate(experts.parameters()):
        p.copy_(torch.arange(p.numel(), dtype=torch.float32).view(p.shape) + 100 * i)
    chosen = experts.select(torch.tensor([2, 0, 2]))
    for name, whole in experts.stacked().items():
        assert torch.equal(chosen.stacked()[name], whole[[2, 0, 2]])
    assert chosen.moe.num_experts == 3 and chosen._fused_moe is experts._fused_moe
    x = torch.randn(4, 5)
    ones = torch.ones(4, 1)
    # Slot 1 of the copy is expert 0 of the whole.
    assert torch.equal(chosen(x, torch.full((4, 1), 1), ones), experts(x, torch.zeros(4, 1, dtype=torch.int64), ones))
