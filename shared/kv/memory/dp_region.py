"""A data-parallel instance's KV caches as the one region its KV connector moves.

With data-parallel attention (EngineConfig.data_parallel_size) each rank holds the KV
of its own requests in its own cache, with its own block ids (one KV pool per rank,
shared/engine/dp_scheduler.py). The instance still has one connector (one NATS and
kvcache client set, one report per load) in rank 0's process, as a tensor- or
expert-parallel instance does (ranked_region.py): every rank's cache is mapped there
(shared/kv/memory/share.py), and this region joins them under **instance-wide block
ids**: block ``b`` of rank ``r``'s group ``g`` is ``r * stride[g] + b``, where
``stride[g]`` is the rows of that group's cache tensors (its blocks and its null
block). Each rank's side of the connector (shared/engine/dp_kv.py) adds its offsets
(``offsets``) to the ids it hands over, so loads land in, saves read from and held
blocks are named in the rank the request is pinned to.

- **Payloads** (stores, the host tier): a rank's cache holds the whole KV of its
  requests (attention is not split), so a block's payload is a one-rank engine's of
  the model: the same ``layout``, and the stores hold one form of a block whatever the
  instances' parallelism.
- **Direct copies** between instances on one host: the peer maps every rank's cache
  (``share`` lists them, rank after rank) and copies rank to rank, each block from the
  peer's rank its id names into ours. The ids in a handoff are the peer's
  instance-wide ones, so the peer's strides are read off its mapped tensors' shapes.
  ``peer_layout`` names the ranks: only a data-parallel peer of as many ranks is
  mapped (another goes through kvcache).

- **NIXL** (between containers and hosts): rank 0's agent registers every rank's cache
  (``tensors``/``allocations``, rank after rank) and a read takes each block from the
  rank its id names on the peer into the rank its id names here (``placement``: rank
  ``id // rows`` of the group, its local id); the peer's rows per group travel in its
  description. On a GPU the caveat of region.py's JoinedRanksRegion holds (mapped memory
  under UCX, unverified until a multi-GPU run).

Not carried: the sliding-window state cache (``gather``/``scatter``; the engine keeps
none with several ranks).
"""

import json
import torch

from shared.kv.memory.region import JoinedRanksRegion, KVRegion, Placement, per_tensor

BlockIds = dict[int, list[int]]


class DataParallelKVRegion(JoinedRanksRegion):
    """The ranks' regions (rank 0's first) under instance-wide block ids. A KVRegion for
    the connectors (same methods); its own state is the ranks' regions alone."""

    kind = "data-parallel"

    def __init__(self, ranks: list[KVRegion]) -> None:
        first = self._join(ranks)
        if any(r.layout != first.layout for r in ranks):
            raise ValueError("the data-parallel ranks' caches differ in layout")
        self.layout = first.layout
        self.block_bytes = first.block_bytes
        self.peer_layout = f"{first.peer_layout}|dp{len(ranks)}"
        """What a peer's cache must be for a direct copy: as many data-parallel ranks."""
        self.strides = _strides(first, [r.tensors for r in ranks])
        """Per KV group, the ids one rank spans (its cache tensors' rows)."""

    @property
    def placement(self) -> Placement:
        """Block id i of group g is rank ``i // strides[g]``'s ``i % strides[g]`` alone."""
        return Placement("dp", len(self.ranks), dict(self.strides), self.layout)

    def offsets(self, rank: int) -> dict[int, int]:
        """Per KV group, what rank ``rank``'s block ids are shifted by in this region."""
        return {g: rank * stride for g, stride in self.strides.items()}

    # -- for peers on this host -------------------------------------------------

    def share(self) -> bytes:
        """Every rank's description, rank after rank (open_peer maps them all)."""
        return json.dumps({
            "layout": self.peer_layout, "ranks": [json.loads(r.share()) for r in self.ranks], "dp": len(self.ranks),
        }).encode()  # fmt: skip

    def copy_from_peer(self, peer: list[torch.Tensor], src: BlockIds, dst: BlockIds) -> None:
        """``peer``: a data-parallel peer's tensors of as many ranks, rank after rank
        (open_peer of its share()); ``src`` in its instance-wide ids, ``dst`` in ours.
        Each run of blocks from one peer rank into one of ours is that pair's copy."""
        per_rank, left = divmod(len(peer), len(self.ranks))
        if left:
            raise ValueError(f"{len(peer)} peer tensors for {len(self.ranks)} ranks")
        theirs = [peer[r * per_rank : (r + 1) * per_rank] for r in range(len(self.ranks))]
        their_strides = _strides(self.ranks[0], [per_tensor(t) for t in theirs])
        pairs: dict[tuple[int, int], tuple[BlockIds, BlockIds]] = {}
        for group, src_ids in src.items():
            for s, d in zip(src_ids, dst[group], strict=True):
                src_rank, src_local = divmod(s, their_strides[group])
                dst_rank, dst_local = divmod(d, self.strides[group])
                part = pairs.setdefault((src_rank, dst_rank), ({}, {}))
                part[0].setdefault(group, []).append(src_local)
                part[1].setdefault(group, []).append(dst_local)
        for (src_rank, dst_rank), (src_part, dst_part) in pairs.items():
            self.ranks[dst_rank].copy_from_peer(theirs[src_rank], src_part, dst_part)

    # -- payloads (stores, the host tier) -----------------------------------------

    def read_payloads(self, block_ids: BlockIds) -> torch.Tensor:
        num = _count(block_ids)
        out = torch.empty(num, self.block_bytes, dtype=torch.uint8)
        for rank, positions, local in self._by_rank(block_ids):
            data = self.ranks[rank].read_payloads(local)
            out[torch.tensor(positions, dtype=torch.long)] = data
        return out

    def write_payloads(self, block_ids: BlockIds, payloads: torch.Tensor) -> None:
        num = payloads.shape[0]
        for rank, positions, local in self._by_rank({g: ids[:num] for g, ids in block_ids.items()}):
            self.ranks[rank].write_payloads(local, payloads[torch.tensor(positions, dtype=torch.long)])

    def _by_rank(self, block_ids: BlockIds) -> list[tuple[int, list[int], BlockIds]]:
        """(rank, positions in the request, that rank's local ids per group) of each rank
        the blocks lie in; a block's rank is its first group's id's (a request's blocks
        are all in its own rank's pool)."""
        groups = list(block_ids)
        if not groups:
            return []
        by_rank: dict[int, tuple[list[int], BlockIds]] = {}
        for i, first_id in enumerate(block_ids[groups[0]]):
            rank = first_id // self.strides[groups[0]]
            positions, local = by_rank.setdefault(rank, ([], {g: [] for g in groups}))
            positions.append(i)
            for g in groups:
                local_rank, local_id = divmod(block_ids[g][i], self.strides[g])
                if local_rank != rank:
                    raise ValueError(f"block {i} lies in rank {rank} for group {groups[0]}, {local_rank} for {g}")
                local[g].append(local_id)
        return [(rank, positions, local) for rank, (positions, local) in sorted(by_rank.items())]


def _count(block_ids: BlockIds) -> int:
    return len(next(iter(block_ids.values()), []))


def _strides(like: KVRegion, ranks_tensors: list[list[torch.Tensor]]) -> dict[int, int]:
    """Per KV group of ``like``'s layout, the rows of its cache tensors, the same in every
    rank of ``ranks_tensors`` (each rank's tensors in ``like.tensors``' order)."""

    def rows(tensors: list[torch.Tensor], group: int) -> int:
        return tensors[like._tensor_ids[group][0]].shape[1]

    strides = {g: rows(ranks_tensors[0], g) for g in range(len(like.kv_layout.groups))}
    for tensors in ranks_tensors[1:]:
        if any(rows(tensors, g) != stride for g, stride in strides.items()):
            raise ValueError("the data-parallel ranks' caches differ in size")
    return strides
