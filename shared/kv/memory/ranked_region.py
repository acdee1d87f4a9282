"""One instance's KV cache over its N ranks, as the one region its KV connector moves.

An instance of N ranks (tensor or expert parallelism, shared/engine/executor) is one
process per rank, each with a paged cache of the same blocks (rank 0's scheduler
hands out one block id for all). The connector lives in rank 0's process and sees
one region, this one; every rank's cache is mapped into rank 0's process (shared
memory on the CPU, CUDA IPC on a GPU: the ranks share a host, shared/kv/memory/share.py),
so a load or a save moves every rank's part on the connector's own thread, in rank
0's process, with no collective on the ranks' step path and no extra copy of the cache.

- **Tensor parallelism** (with expert parallelism too, for the families whose
  attention splits beside it: Qwen3-MoE, GPT-OSS): rank r holds KV heads [first_r, first_r + count_r) of every
  layer (``kv_heads_of_rank``; heads replicated where there are fewer than ranks).
  A block's payload, what a store keeps, is the whole block with every head in order,
  the same bytes and layout a one-rank engine of the model has: read, each head is
  taken from the first rank that holds it; written, each rank gets its heads. So the
  kvcache service and the host tier hold one form of a block whatever the instances'
  sizes. A direct copy out of a peer's cache goes rank to rank (the peer's rank r
  into ours), so it needs the peer's split: ``peer_layout`` names it, and a peer of
  another size is not mapped (the load then comes from kvcache).
- **Replicated KV** (DeepSeek-V4, tensor- or expert-parallel: its query heads split
  but its one KV head, state and compressed caches computed whole on every rank): every
  rank holds the whole KV, equal on every rank (the same KV path on the same inputs).
  Reads come from rank 0, writes and copies go to every rank (each rank needs its own
  copy: N identical copies are written into the instance, one is read out of it); to
  peers and stores the instance looks like one rank (its description is rank 0's), so
  such an instance and a one-rank instance of the model hand off to each other directly.

NIXL (between containers and hosts) reads and writes every rank's part too: rank 0's
agent registers every rank's cache as mapped here (``tensors``/``allocations``, rank
after rank) and a read pairs the peer's copies of each block with ours (``placement``:
tensor parallel rank r with rank r, the split the same on both sides; replicated
attention fans a one-rank peer's block out to every rank and reads a replicated peer's
rank for rank). On a GPU the other ranks' memory is a CUDA IPC / VMM mapping in rank
0's process; whether UCX's cuda_ipc and RDMA transports accept such mappings is
unverified until a multi-GPU run (issue 33). Not carried: the sliding-window state
cache (``gather``/``scatter``; the engine keeps none with several ranks).

Why here and not in the ranks: a connector per rank (each rank moving its own
shard, as vLLM's NixlConnector does per worker) needs a NATS and kvcache client per
rank and a join of N reports per load; the ranks of one instance are on one host, so
rank 0 can reach every rank's memory itself, and one connector keeps one report
per load and one lease per handoff.
"""

import json
import math

import torch

from shared.kv.memory.dp_region import DataParallelKVRegion
from shared.kv.memory.region import JoinedRanksRegion, KVRegion, Placement, per_tensor
from shared.kv.memory.share import open_peer
from shared.kv.spec import KVCacheLayout


class RankedKVRegion(JoinedRanksRegion):
    """The instance's ranks' regions as one (rank 0's first). ``heads``: per rank,
    (first, count) of the KV heads it holds of ``num_kv_heads`` (tensor parallelism);
    None when every rank holds the whole KV (replicated KV: expert parallelism beside
    replicated attention, or DeepSeek-V4's, whose KV no rank splits).

    A KVRegion for the connectors (same methods); its own state is the ranks' regions
    alone, each with its lock and (on a GPU) its copy stream."""

    def __init__(self, ranks: list[KVRegion], heads: list[tuple[int, int]] | None = None, num_kv_heads: int = 0) -> None:
        first = self._join(ranks)
        self.heads = heads
        self.num_kv_heads = num_kv_heads
        if heads is None:
            self.layout = first.layout
            self.block_bytes = first.block_bytes
            self.peer_layout = first.peer_layout
            return
        if len(heads) != len(ranks):
            raise ValueError(f"{len(heads)} head ranges for {len(ranks)} ranks")
        if not all(r._whole_blocks for r in ranks):
            raise ValueError("not implemented yet: moving a tensor-parallel instance's KV whose pages are not "
                             "whole blocks (compressed caches)")  # fmt: skip
        self._readers = _covering(heads, num_kv_heads)
        """Per rank that is read, the heads taken from it: each head from the first rank holding it."""
        planes, _, bs, _, dim = first.kv_caches[0].shape
        layers = sum(len(self.kv_layout.groups[g].layers) for g in self.persistent_groups)
        self._block_shape = (layers, planes, bs, num_kv_heads, dim)
        self._dtype = first.kv_caches[0].dtype
        self.block_bytes = math.prod(self._block_shape) * first.kv_caches[0].element_size()
        dtype = str(self._dtype).removeprefix("torch.")
        self.layout = f"{dtype}:{layers}x{planes}x{bs}x{num_kv_heads}x{dim}"
        """The payload's layout: a one-rank engine's of the model (module docstring)."""
        self.peer_layout = f"{self.layout}|tp{len(ranks)}"
        """What a peer's cache must be for a rank-to-rank direct copy: the same split."""

    @property
    def tensor_parallel(self) -> bool:
        """Whether the ranks split the KV by head (False: replicated KV, even where the
        model's query heads are split, as DeepSeek-V4's are)."""
        return self.heads is not None

    @property
    def placement(self) -> Placement:
        """Every rank holds every block under its id: its heads (tensor parallel, the
        split in ``peer_layout``) or the whole KV (replicated attention)."""
        if self.tensor_parallel:
            return Placement("tp", len(self.ranks), {}, self.peer_layout)
        return Placement("replicated", len(self.ranks), {}, self.layout)

    # -- for peers on this host -------------------------------------------------

    def share(self) -> bytes:
        """Tensor parallel: every rank's description, with the split (open_peer maps them
        all, rank after rank); replicated KV: rank 0's, the whole KV."""
        if not self.tensor_parallel:
            return self.ranks[0].share()
        return json.dumps({
            "layout": self.peer_layout, "ranks": [json.loads(r.share()) for r in self.ranks],
            "heads": [list(h) for h in self.heads or ()], "num_kv_heads": self.num_kv_heads,
        }).encode()  # fmt: skip

    def copy_from_peer(self, peer: list[torch.Tensor], src: dict[int, list[int]], dst: dict[int, list[int]]) -> None:
        """Tensor parallel: ``peer`` is a peer of our split's tensors, rank after rank (open_peer
        of its share()), each rank's copied into ours; replicated KV: one whole cache,
        copied into every rank."""
        if not self.tensor_parallel:
            for rank in self.ranks:
                rank.copy_from_peer(peer, src, dst)
            return
        per_rank, left = divmod(len(peer), len(self.ranks))
        if left:
            raise ValueError(f"{len(peer)} peer tensors for {len(self.ranks)} ranks")
        for r, rank in enumerate(self.ranks):
            rank.copy_from_peer(peer[r * per_rank : (r + 1) * per_rank], src, dst)

    # -- payloads (stores, the host tier) -----------------------------------------

    def read_payloads(self, block_ids: dict[int, list[int]]) -> torch.Tensor:
        if not self.tensor_parallel:
            return self.ranks[0].read_payloads(block_ids)
        parts = []
        for r, (first, count) in self._readers:
            data = self.ranks[r].read_payloads(block_ids)
            if not data.numel():
                return torch.empty(0, self.block_bytes, dtype=torch.uint8)
            layers, planes, bs, _, dim = self._block_shape
            own = self.heads[r][1]  # type: ignore[index]
            shaped = data.view(self._dtype).view(data.shape[0], layers, planes, bs, own, dim)
            offset = first - self.heads[r][0]  # type: ignore[index]
            parts.append(shaped[..., offset : offset + count, :])
        whole = torch.cat(parts, dim=4).contiguous()
        return whole.view(torch.uint8).view(whole.shape[0], self.block_bytes)

    def write_payloads(self, block_ids: dict[int, list[int]], payloads: torch.Tensor) -> None:
        if not self.tensor_parallel:
            for rank in self.ranks:
                rank.write_payloads(block_ids, payloads)
            return
        num = payloads.shape[0]
        whole = payloads.contiguous().view(self._dtype).view(num, *self._block_shape)
        for rank, (first, count) in zip(self.ranks, self.heads or ()):
            part = whole[..., first : first + count, :].contiguous()
            rank.write_payloads(block_ids, part.view(torch.uint8).view(num, -1))


def _covering(heads: list[tuple[int, int]], num_kv_heads: int) -> list[tuple[int, tuple[int, int]]]:
    """(rank, (first head, count)) runs that take each of num_kv_heads once, in order,
    each from the first rank holding it."""
    runs: list[tuple[int, tuple[int, int]]] = []
    head = 0
    while head < num_kv_heads:
        rank = next((r for r, (first, count) in enumerate(heads) if first <= head < first + count), None)
        if rank is None:
            raise ValueError(f"no rank holds KV head {head}")
        first, count = heads[rank]
        runs.append((rank, (head, first + count - head)))
        head = first + count
    return runs


def open_region(description: bytes, layout: KVCacheLayout, device: torch.device) -> KVRegion:
    """A cache another process on this host described (KVRegion.share(), or a
    RankedKVRegion's or a DataParallelKVRegion's), mapped here as a region: what the write-behind process and rank
    0 (for the other ranks' caches) read and write. ValueError if it cannot be mapped."""
    desc = json.loads(description)
    if "ranks" not in desc:
        _, allocations = open_peer(description, device)
        # The cache's allocations, as KVRegion.allocations lists them: tensors in layout.tensor_index order.
        tensors = per_tensor(allocations)
        caches = [tensors[layout.tensor_index(layer)] for layer in range(layout.num_layers)]
        return KVRegion(caches, layout, description=description)
    ranks = [open_region(json.dumps(r).encode(), layout, device) for r in desc["ranks"]]
    if "dp" in desc:
        return DataParallelKVRegion(ranks)
    return RankedKVRegion(ranks, [(int(a), int(b)) for a, b in desc["heads"]], int(desc["num_kv_heads"]))
