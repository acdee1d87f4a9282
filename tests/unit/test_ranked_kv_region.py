"""One instance's KV over its ranks as one region (shared/kv/memory/ranked_region.py):
a tensor-parallel instance's payloads are a one-rank engine's bytes (every head, in
order), written back each rank gets its heads; a direct copy goes rank to rank
through the peer's ranked description; an expert-parallel instance reads rank 0 and
writes every rank. The ranks' caches are real shared-memory files, mapped as rank 0
maps its workers'."""

import pytest
import torch

from shared.kv.memory.ranked_region import RankedKVRegion, open_region
from shared.kv.memory.region import KVRegion
from shared.kv.memory.share import SharedMemoryAllocator, open_peer
from shared.kv.spec import kv_cache_layout
from shared.model.parallel_layers import kv_heads_of_rank

LAYERS, BLOCKS, BS, DIM = 3, 8, 4, 2


def _region(heads: int, fill: torch.Tensor | None = None) -> KVRegion:
    """A region of LAYERS stacked caches [2, BLOCKS, BS, heads, DIM] in shared memory,
    filled with ``fill`` (the whole cache, heads included) where given."""
    layout = kv_cache_layout([None] * LAYERS)
    allocator = SharedMemoryAllocator()
    stacked = allocator((LAYERS, 2, BLOCKS, BS, heads, DIM), torch.float32)
    if fill is not None:
        stacked.copy_(fill)
    return KVRegion(list(stacked.unbind(0)), layout, allocator)


def _tensor_parallel(whole: torch.Tensor, num_kv_heads: int, tp: int) -> RankedKVRegion:
    """A ranked region whose rank r holds its heads of ``whole``; ranks > 0 mapped from their
    descriptions, as MultiprocExecutor.kv_region maps the workers'."""
    heads = [kv_heads_of_rank(num_kv_heads, r, tp) for r in range(tp)]
    ranks = [_region(count, whole[..., first : first + count, :].contiguous()) for first, count in heads]
    mapped = [open_region(r.share(), r.kv_layout, torch.device("cpu")) for r in ranks[1:]]
    return RankedKVRegion([ranks[0], *mapped], heads, num_kv_heads)


@pytest.mark.parametrize(("num_kv_heads", "tp"), [(4, 2), (1, 2), (2, 4)])
def test_tensor_parallel_payloads_are_the_one_rank_bytes(num_kv_heads: int, tp: int) -> None:
    whole = torch.randn(LAYERS, 2, BLOCKS, BS, num_kv_heads, DIM, generator=torch.Generator().manual_seed(0))
    one = _region(num_kv_heads, whole)
    ranked = _tensor_parallel(whole, num_kv_heads, tp)
    assert ranked.layout == one.layout and ranked.block_bytes == one.block_bytes
    assert ranked.peer_layout == f"{one.layout}|tp{tp}"
    ids = {0: [5, 1, 6]}
    assert torch.equal(ranked.read_payloads(ids), one.read_payloads(ids))
    # Written back into other blocks: each rank gets its heads, and reads give the same bytes.
    payloads = one.read_payloads(ids)
    ranked.write_payloads({0: [0, 2, 3]}, payloads)
    assert torch.equal(ranked.read_payloads({0: [0, 2, 3]}), payloads)
    for rank, (first, count) in zip(ranked.ranks, ranked.heads or ()):
        assert torch.equal(rank.stacked[:, :, [0, 2, 3]], whole[:, :, [5, 1, 6], :, :, :][..., first : first + count, :])
    # The byte store's form (read_blocks / write_blocks) and the host tier's (copy_out / copy_in) too.
    assert ranked.read_blocks(ids) == one.read_blocks(ids)
    staging = torch.zeros(4, ranked.block_bytes, dtype=torch.uint8)
    ranked.copy_out(ids, staging, [3, 0, 1])
    assert torch.equal(staging[[3, 0, 1]], payloads)
    ranked.copy_in({0: [7, 4, 5]}, staging, [3, 0, 1])
    assert torch.equal(ranked.read_payloads({0: [7, 4, 5]}), payloads)


def test_a_direct_copy_goes_rank_to_rank_and_a_peer_of_another_split_is_told_apart() -> None:
    gen = torch.Generator().manual_seed(1)
    theirs = _tensor_parallel(torch.randn(LAYERS, 2, BLOCKS, BS, 4, DIM, generator=gen), 4, 2)
    ours = _tensor_parallel(torch.zeros(LAYERS, 2, BLOCKS, BS, 4, DIM), 4, 2)
    layout, mapped = open_peer(theirs.share(), torch.device("cpu"))
    assert layout == ours.peer_layout  # what PeerConnector checks before it copies
    ours.copy_from_peer(mapped, {0: [6, 2]}, {0: [1, 3]})
    assert torch.equal(ours.read_payloads({0: [1, 3]}), theirs.read_payloads({0: [6, 2]}))
    one_rank = _region(4)
    assert layout != one_rank.peer_layout and one_rank.layout == ours.layout  # kvcache's bytes are shared


def test_expert_parallel_reads_rank_zero_and_writes_every_rank() -> None:
    gen = torch.Generator().manual_seed(2)
    whole = torch.randn(LAYERS, 2, BLOCKS, BS, 4, DIM, generator=gen)
    ranks = [_region(4, whole), _region(4, whole)]
    ranked = RankedKVRegion([ranks[0], open_region(ranks[1].share(), ranks[1].kv_layout, torch.device("cpu"))])
    one = _region(4, whole)
    assert ranked.layout == ranked.peer_layout == one.layout
    payloads = torch.randn(2, ranked.block_bytes // 4, generator=gen).view(torch.uint8)
    ranked.write_payloads({0: [0, 1]}, payloads)
    for rank in ranked.ranks:
        assert torch.equal(rank.read_payloads({0: [0, 1]}), payloads)
    # A one-rank peer's cache copies into every rank (the two hand off to each other directly).
    _, mapped = open_peer(one.share(), torch.device("cpu"))
    ranked.copy_from_peer(mapped, {0: [7]}, {0: [2]})
    for rank in ranked.ranks:
        assert torch.equal(rank.read_payloads({0: [2]}), one.read_payloads({0: [7]}))
    # NIXL registers every rank's memory, rank after rank (tests/unit/test_nixl_ranks.py pairs the copies).
    assert [a.data_ptr() for a in ranked.allocations] == [a.data_ptr() for r in ranked.ranks for a in r.allocations]
    assert len(ranked.allocations) == 2 and ranked.allocations[1].data_ptr() != ranks[1].allocations[0].data_ptr()  # mapped
    assert ranked.placement.copies(0, [3]) == [[(0, 3), (1, 3)]] and ranked.placement.copy_layout == one.layout
