"""NIXL over an instance's ranks (issues 28, 33): a region over several ranks says where
each of its blocks lives (``placement``: (rank, local id) copies per block) and lists
every rank's memory rank after rank; ``descriptors`` pairs the peer's copies of each
block with ours (tensor parallel rank to rank, a one-rank block fanned out to every
replicated rank, a replicated peer read once, data-parallel from whichever rank each
side's id names) and coalesces runs only within one (peer rank, our rank) pair. Pure
arithmetic here; tests/parity/test_nixl_ranks.py moves real engines' KV."""

import json

import pytest
import torch

from shared.kv.connectors.nixl import TensorGeometry, descriptors, pair_copies
from shared.kv.memory.dp_region import DataParallelKVRegion
from shared.kv.memory.ranked_region import RankedKVRegion
from shared.kv.memory.region import KVRegion, Placement
from shared.kv.spec import kv_cache_layout

LAYERS, BLOCKS, BS, DIM = 2, 6, 4, 2


def _region(heads: int) -> KVRegion:
    stacked = torch.zeros(LAYERS, 2, BLOCKS, BS, heads, DIM)
    return KVRegion(list(stacked.unbind(0)), kv_cache_layout([None] * LAYERS))


def test_each_region_places_a_block_where_its_structure_keeps_it() -> None:
    one = _region(4)
    assert one.placement.copies(0, [3, 5]) == [[(0, 3)], [(0, 5)]] and one.placement.copy_layout == one.layout
    tp = RankedKVRegion([_region(2), _region(2)], [(0, 2), (2, 2)], 4)
    assert tp.placement.kind == "tp" and tp.placement.copies(0, [3, 5]) == [[(0, 3), (1, 3)], [(0, 5), (1, 5)]]
    assert tp.placement.copy_layout == tp.peer_layout == f"{one.layout}|tp2"  # copies are each rank's heads
    replicated = RankedKVRegion([_region(4), _region(4), _region(4)])
    assert replicated.placement.kind == "replicated" and replicated.placement.copy_layout == one.layout
    assert replicated.placement.copies(0, [1]) == [[(0, 1), (1, 1), (2, 1)]]
    dp = DataParallelKVRegion([_region(4), _region(4)])
    assert dp.placement.rows == {0: BLOCKS} and dp.placement.copy_layout == one.layout
    assert dp.placement.copies(0, [2, BLOCKS + 3]) == [[(0, 2)], [(1, 3)]]
    # What a peer computes the copies from: the placement as the description carries it.
    for region in (one, tp, replicated, dp):
        assert Placement.from_json(json.loads(json.dumps(region.placement.to_json()))) == region.placement
        # Every rank's tensors, rank after rank: what NIXL registers and the description lists.
        ranks = getattr(region, "ranks", [region])
        assert [t.data_ptr() for t in region.tensors] == [t.data_ptr() for r in ranks for t in r.tensors]
        assert len(region.allocations) == len(ranks)


@pytest.mark.parametrize("desc", [{"kind": "tp", "ranks": 1, "copy_layout": "x"},
                                  {"kind": "dp", "ranks": 2, "copy_layout": "x"},
                                  {"kind": "ring", "ranks": 2, "copy_layout": "x"}])  # fmt: skip
def test_a_placement_that_cannot_be_is_refused(desc: dict) -> None:
    with pytest.raises(ValueError):
        Placement.from_json(desc)


def test_copies_pair_by_position_fan_out_or_read_the_first() -> None:
    a, b = [(0, 4), (1, 4)], [(0, 7), (1, 7)]
    assert pair_copies(a, b) == [((0, 4), (0, 7)), ((1, 4), (1, 7))]
    assert pair_copies([(0, 4)], b) == [((0, 4), (0, 7)), ((0, 4), (1, 7))]  # one rank fanned out
    assert pair_copies(a, [(0, 7)]) == [((0, 4), (0, 7))]  # a replicated peer read once


def _geometry(base: int, ranks: int, tensors: int = 2) -> list[TensorGeometry]:
    """ranks x tensors geometries, rank after rank: tensor k of rank r at base + 10000 r + 1000 k,
    planes 100 apart, blocks 10 apart, 8 bytes each."""
    return [TensorGeometry(base + 10000 * r + 1000 * k, 100, 10, 8, 0) for r in range(ranks) for k in range(tensors)]


def _starts(rows) -> list[int]:  # noqa: ANN001
    return [int(row[0]) for row in rows]


def test_tensor_parallel_reads_rank_r_into_rank_r() -> None:
    tp = Placement("tp", 2, {}, "l|tp2")
    remote, local = descriptors({0: [2, 3]}, {0: [5, 6]}, {0: [0, 1]}, _geometry(0, 2), _geometry(500000, 2), tp, tp)
    # 2 rank pairs x 2 tensors x 2 planes, one run of 2 blocks each.
    assert len(remote) == len(local) == 8 and set(remote[:, 1].tolist()) == {16}
    assert _starts(remote) == [20, 120, 1020, 1120, 10020, 10120, 11020, 11120]
    assert _starts(local) == [500050, 500150, 501050, 501150, 510050, 510150, 511050, 511150]


def test_a_one_rank_block_fans_out_to_every_replicated_rank_and_a_replicated_peer_is_read_once() -> None:
    one, replicated = Placement(), Placement("replicated", 2, {}, "l")
    remote, local = descriptors({0: [2]}, {0: [5]}, {0: [0, 1]}, _geometry(0, 1), _geometry(500000, 2), one, replicated)
    assert _starts(remote) == [20, 120, 1020, 1120] * 2  # the same block read twice
    assert _starts(local) == [500050, 500150, 501050, 501150, 510050, 510150, 511050, 511150]
    remote, local = descriptors({0: [2]}, {0: [5]}, {0: [0, 1]}, _geometry(0, 2), _geometry(500000, 1), replicated, one)
    assert _starts(remote) == [20, 120, 1020, 1120] and _starts(local) == [500050, 500150, 501050, 501150]
    # Replicated into replicated: rank to rank.
    remote, local = descriptors({0: [2]}, {0: [5]}, {0: [0]}, _geometry(0, 2, 1), _geometry(500000, 2, 1),
                                replicated, replicated)  # fmt: skip
    assert _starts(remote) == [20, 120, 10020, 10120] and _starts(local) == [500050, 500150, 510050, 510150]


def test_data_parallel_blocks_move_between_the_ranks_their_ids_name_and_runs_stay_within_a_pair() -> None:
    theirs, ours = Placement("dp", 2, {0: 8}, "l"), Placement("dp", 2, {0: 6}, "l")
    # Peer ids 9, 10 are its rank 1's 1, 2; ours 3, 4 are our rank 0's: one run of 2.
    remote, local = descriptors({0: [9, 10]}, {0: [3, 4]}, {0: [0]}, _geometry(0, 2, 1), _geometry(500000, 2, 1),
                                theirs, ours)  # fmt: skip
    assert _starts(remote) == [10010, 10110] and _starts(local) == [500030, 500130]
    assert set(remote[:, 1].tolist()) == {16}
    # Consecutive on both sides in ids, but from two peer ranks: two runs, never one across ranks.
    remote, local = descriptors({0: [7, 8]}, {0: [6, 7]}, {0: [0]}, _geometry(0, 2, 1), _geometry(500000, 2, 1),
                                theirs, ours)  # fmt: skip
    assert _starts(remote) == [70, 170, 10000, 10100]  # peer rank 0's 7, rank 1's 0
    assert _starts(local) == [510000, 510100, 510010, 510110]  # our rank 1's 0 and 1
    assert set(remote[:, 1].tolist()) == {8}
    # A data-parallel peer into one rank: each block from the rank it lies in.
    remote, local = descriptors({0: [1, 9]}, {0: [2, 3]}, {0: [0]}, _geometry(0, 2, 1), _geometry(500000, 1, 1),
                                theirs, Placement())  # fmt: skip
    assert _starts(remote) == [10, 110, 10010, 10110] and _starts(local) == [500020, 500120, 500030, 500130]
