"""The paged KV cache as a region of blocks that KV connectors read and write.

The model runner owns the cache tensors; a connector gets this view of them
(`KVConnector.register_kv_region`) and moves blocks itself, on its own thread,
so no KV copy runs on the engine's step thread. A block's payload is the
persistent groups' KV of one block id per group, each group's page of each of
its layers (shared/kv/spec.py's `Page`) in the cache dtype: [layers, k/v,
block_size, kv_heads, head_dim] when every page is the whole block (a dense
model: the block's memory as it is), else the pages' used rows and channels one
after the other (DeepSeek-V4's compressed groups: only their entries). `layout`
names it; two engines exchange blocks only when their layouts agree. Groups of
different page sizes have tensors of their own (shared/kv/spec.py's size classes):
a group's layer k uses its class's tensor k, `tensors` lists every class's.

Threads: torch's copies release the GIL. On CUDA the connector's copies run on
a stream of their own and the call returns once they are done, so the engine
sees loaded blocks complete when the connector reports them; a read first
waits for the work the engine has queued, so it never sees a half-written block.
The engine makes sure nobody else writes the blocks a connector is moving
(reserved for a load, referenced for a save).
"""

import math
import threading
from dataclasses import dataclass, field

import torch

from shared.kv.memory.share import Allocator, describe
from shared.kv.spec import KVCacheLayout


Copy = tuple[int, int]
"""One copy of a block: (rank, the block's id in that rank's cache)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where an instance's blocks live among its ranks: what a NIXL read needs of each side
    (shared/kv/connectors/nixl.py), the local region's and, from the handoff's description,
    the peer's.

    - ``one``: one rank; block b is rank 0's b.
    - ``tp`` (tensor parallel): every rank holds its KV heads of every block under the same
      id, so block b is every rank's b, rank r's heads in each.
    - ``replicated`` (expert parallel beside replicated attention, DeepSeek-V4): every rank
      holds the whole KV, the same on each, so block b is every rank's b, equal copies.
    - ``dp`` (data-parallel attention): block ids are instance-wide, ``r * rows[g] + b``
      (dp_region.py), so block id i of group g is rank ``i // rows[g]``'s ``i % rows[g]`` alone.
    """

    kind: str = "one"
    ranks: int = 1
    rows: dict[int, int] = field(default_factory=dict)
    """dp: per KV group, the ids one rank spans (DataParallelKVRegion.strides)."""
    copy_layout: str = ""
    """What one copy of a block is: the payload layout, with the tensor-parallel split where
    a copy is one rank's heads (``|tpN``, as ``peer_layout`` names it). Two instances' copies
    pair only when these agree."""

    def copies(self, group: int, block_ids: list[int]) -> list[list[Copy]]:
        """Per block id of ``group`` (the instance's ids), its copies: (rank, local id) each."""
        if self.kind == "dp":
            rows = self.rows[group]
            return [[divmod(b, rows)] for b in block_ids]
        return [[(r, b) for r in range(self.ranks)] for b in block_ids]

    def to_json(self) -> dict:
        return {"kind": self.kind, "ranks": self.ranks, "rows": {str(g): n for g, n in self.rows.items()},
                "copy_layout": self.copy_layout}  # fmt: skip

    @classmethod
    def from_json(cls, desc: dict) -> "Placement":
        kind, ranks = str(desc["kind"]), int(desc["ranks"])
        if kind not in ("one", "tp", "replicated", "dp") or ranks < 1 or (kind == "one") != (ranks == 1):
            raise ValueError(f"no such placement: {kind} over {ranks} ranks")
        rows = {int(g): int(n) for g, n in desc.get("rows", {}).items()}
        if kind == "dp" and (not rows or min(rows.values()) < 1):
            raise ValueError("a data-parallel placement without its rows per group")
        return cls(kind, ranks, rows, str(desc["copy_layout"]))


class KVRegion:
    def __init__(
        self, kv_caches: list[torch.Tensor], layout: KVCacheLayout, allocator: Allocator | None = None,
        description: bytes | None = None,
    ) -> None:  # fmt: skip
        """allocator: what made the tensors when the cache is shared with peers by its memory
        (a CPU cache; a GPU cache handed across PID namespaces). description: for a cache
        mapped from another process (its owner's share()), that description: share() gives
        it on (rank 0 describes its workers' caches to peers so, ranked_region.py)."""
        self.kv_caches = kv_caches
        self.kv_layout = layout
        tensors: list[torch.Tensor | None] = [None] * layout.num_tensors
        for layer, kv in enumerate(kv_caches):
            tensors[layout.tensor_index(layer)] = kv
        assert all(t is not None for t in tensors), "a cache tensor no layer uses"
        self.tensors: list[torch.Tensor] = tensors  # type: ignore[assignment]
        """The cache tensors, size class by class; the k-th of a class used by the k-th layer
        of each of its groups (one class: the k-th layer of every group)."""
        self._tensor_ids = [[layout.tensor_index(layer) for layer in g.layers] for g in layout.groups]
        """Per group, the indices into ``tensors`` of its layers' caches."""
        self.stacked = _stacked(self.tensors)
        """The tensors as one [tensors, 2, blocks, ...] tensor, when they lie back to back in
        one allocation (CausalLM.allocate_kv_cache makes them so): a copy then moves a block
        of every layer at once."""
        self.device = kv_caches[0].device
        self.persistent_groups = layout.persistent_groups
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._lock = threading.Lock()  # one connector copy at a time on the side stream
        planes, _, bs, heads, dim = kv_caches[0].shape
        self._block_shape = (planes, bs, heads, dim)
        self._pages = {g: layout.groups[g].spec.page(bs) for g in self.persistent_groups}
        self._whole_blocks = all(page.covers(bs) for page in self._pages.values())
        """Every persistent page is the whole block: payloads are the blocks' memory as it is."""
        dtype = str(kv_caches[0].dtype).removeprefix("torch.")
        if self._whole_blocks:
            layers = sum(len(layout.groups[g].layers) for g in self.persistent_groups)
            self.block_bytes = layers * kv_caches[0][:, 0].numel() * kv_caches[0].element_size()
            self.layout = f"{dtype}:{layers}x2x{bs}x{heads}x{dim}"
        else:
            shapes = {}
            for g, p in self._pages.items():
                _, _, _, heads, width = self._group_tensors(g)[0].shape
                shapes[g] = (p.planes, p.rows, heads, width if p.channels is None else p.channels)
            self._page_elements = {g: len(layout.groups[g].layers) * math.prod(shape) for g, shape in shapes.items()}
            self.block_bytes = sum(self._page_elements.values()) * kv_caches[0].element_size()
            self.layout = f"{dtype}:" + "+".join(
                f"{len(layout.groups[g].layers)}x" + "x".join(map(str, shape)) for g, shape in shapes.items()
            )
        """block_bytes: bytes of one block's payload. layout: its dtype and shape, [layers of
        the persistent groups, k/v, block_size, kv_heads, head_dim] for whole blocks, else
        [layers, planes, rows, kv_heads, channels] of each persistent group's page, '+' between."""
        self.peer_layout = self.layout
        """What a peer's cache must be for copy_from_peer (the layout it describes in share()):
        the payload's layout here; a multi-rank instance's names its split too (ranked_region.py)."""
        self._allocator = allocator
        self._description: bytes | None = description

    @property
    def placement(self) -> Placement:
        """Where each block lives (Placement): here, one rank's cache, block b at b."""
        return Placement("one", 1, {}, self.layout)

    def share(self) -> bytes:
        """How a peer on this host maps this cache (see kv_share)."""
        if self._description is None:
            self._description = describe(self.allocations, self._allocator, self.layout)
        return self._description

    def copy_from_peer(self, peer: list[torch.Tensor], src: dict[int, list[int]], dst: dict[int, list[int]]) -> None:
        """Copy blocks src (per group: persistent groups' and sliding groups' window, see
        shared/kv/transfer.py copy_plan) of a peer's cache tensors into our blocks dst,
        tensor by tensor: one gather and one scatter per cache tensor and group, device
        to device on a GPU (CUDA IPC), memory to memory on the CPU. Whole blocks move, so
        the layouts must agree (the caller checked)."""
        with self._lock, self._side_stream():
            for group, src_ids in src.items():
                dst_index = torch.tensor(dst[group], dtype=torch.long, device=self.device)
                num_layers = len(self.kv_layout.groups[group].layers)
                if self.stacked is not None and len(peer) == 1 and peer[0].dim() == 6:
                    # One gather and one scatter for every layer of the group.
                    theirs = peer[0][:num_layers]
                    blocks = theirs.index_select(2, torch.tensor(src_ids, dtype=torch.long, device=theirs.device))
                    self.stacked[:num_layers].index_copy_(2, dst_index, blocks.to(self.device, non_blocking=True))
                    continue
                tensors = per_tensor(peer)
                for t in self._tensor_ids[group]:
                    theirs = tensors[t]
                    blocks = theirs.index_select(1, torch.tensor(src_ids, dtype=torch.long, device=theirs.device))
                    self.tensors[t].index_copy_(1, dst_index, blocks.to(self.device, non_blocking=True))
            if self._stream is not None:
                self._stream.synchronize()

    @property
    def allocations(self) -> list[torch.Tensor]:
        """The cache's allocations, in the order of ``tensors``: each run of tensors back to
        back in one allocation as one [tensors, planes, blocks, ...] tensor (a size class of
        one row shape; one class: ``stacked``), any other tensor as itself. What a peer
        maps (per_tensor undoes it)."""
        out: list[torch.Tensor] = []
        run: list[torch.Tensor] = []
        for t in [*self.tensors, None]:
            if run and (t is None or t.untyped_storage().data_ptr() != run[0].untyped_storage().data_ptr()):
                whole = _stacked(run)  # one tensor too: a one-group Llama's [1, 2, blocks, ...], as before
                out += [whole] if whole is not None else run
                run = []
            if t is not None:
                run.append(t)
        return out

    def close(self) -> None:
        if self._allocator is not None:
            self._allocator.close()

    def _group_tensors(self, group: int) -> list[torch.Tensor]:
        return [self.tensors[t] for t in self._tensor_ids[group]]

    # -- for the engine's thread (the state cache): on the current stream --------

    @torch.inference_mode()
    def gather(self, block_ids: dict[int, list[int]]) -> torch.Tensor:
        """The blocks of several groups (the same number from each), as one host tensor
        [blocks, layers of those groups, planes, block_size, kv_heads, head_dim], in one
        copy; where those layers' rows differ (size classes), [blocks, elements]: each
        layer's block after the other."""
        return self._gather_here(block_ids).cpu()

    def _gather_here(self, block_ids: dict[int, list[int]]) -> torch.Tensor:
        """As gather, left on the cache's device."""
        parts = []
        for group, ids in block_ids.items():
            index = torch.tensor(ids, dtype=torch.long, device=self.device)
            parts += [kv.index_select(1, index) for kv in self._group_tensors(group)]  # [planes, n, bs, H, D] each
        if not parts or parts[0].shape[1] == 0:
            return torch.empty(0, device=self.device)
        if len({p.shape for p in parts}) > 1:
            return torch.cat([p.transpose(0, 1).reshape(p.shape[1], -1) for p in parts], dim=1)
        return torch.stack(parts).permute(2, 0, 1, 3, 4, 5).contiguous()

    @torch.inference_mode()
    def scatter(self, block_ids: dict[int, list[int]], data: torch.Tensor) -> None:
        """The inverse of gather: data [blocks, layers, planes, ...] (or [blocks, elements])
        into those groups' blocks."""
        data = data.to(self.device, non_blocking=True)
        if data.dim() == 2:
            self._scatter_flat(block_ids, data)
            return
        layer = 0
        for group, ids in block_ids.items():
            index = torch.tensor(ids, dtype=torch.long, device=self.device)
            if self.stacked is not None:
                # One copy for every layer of the group (per-layer copies ran at 0.33 GB/s
                # on the CPU against 1.6 for this, 2 MiB blocks; on a GPU, 1 launch, not L).
                num_layers = len(self.kv_layout.groups[group].layers)
                part = data[:, layer : layer + num_layers].permute(1, 2, 0, 3, 4, 5)
                self.stacked[:num_layers].index_copy_(2, index, part.to(self.stacked.dtype))
                layer += num_layers
                continue
            for kv in self._group_tensors(group):
                kv.index_copy_(1, index, data[:, layer].transpose(0, 1).to(kv.dtype))
                layer += 1

    def _scatter_flat(self, block_ids: dict[int, list[int]], data: torch.Tensor) -> None:
        """scatter of gather's [blocks, elements] form: each layer's block after the other."""
        offset = 0
        for group, ids in block_ids.items():
            index = torch.tensor(ids, dtype=torch.long, device=self.device)
            for kv in self._group_tensors(group):
                planes, _, *row = kv.shape
                size = planes * math.prod(row)
                chunk = data[:, offset : offset + size].reshape(len(ids), planes, *row).transpose(0, 1)
                kv.index_copy_(1, index, chunk.to(kv.dtype))
                offset += size

    # -- for connectors: payloads of the persistent groups, from any thread --------

    def read_blocks(self, block_ids: dict[int, list[int]]) -> list[bytes]:
        """One payload per block index (block_ids: per persistent group, the same count)."""
        return [blk.numpy().tobytes() for blk in self.read_payloads(block_ids)]

    def read_payloads(self, block_ids: dict[int, list[int]]) -> torch.Tensor:
        """The payloads as a host uint8 tensor [blocks, block_bytes]."""
        with self._lock, self._side_stream():
            if self._stream is not None:
                self._stream.wait_stream(torch.cuda.default_stream(self.device))
            data = self._payloads_here(block_ids).cpu()
        if not data.numel():
            return torch.empty(0, self.block_bytes, dtype=torch.uint8)
        return data

    def write_payloads(self, block_ids: dict[int, list[int]], payloads: torch.Tensor) -> None:
        """Write host payloads [blocks, block_bytes] (uint8; pinned memory copies fastest)
        into the blocks, one id per payload in each persistent group."""
        with self._lock, self._side_stream():
            self._write_payloads_here({g: ids[: payloads.shape[0]] for g, ids in block_ids.items()}, payloads)
            if self._stream is not None:
                self._stream.synchronize()

    def _payloads_here(self, block_ids: dict[int, list[int]]) -> torch.Tensor:
        """The blocks' payloads [blocks, block_bytes] uint8, on the cache's device."""
        if self._whole_blocks:
            data = self._gather_here(block_ids)
            if not data.numel():
                return torch.empty(0, self.block_bytes, dtype=torch.uint8, device=self.device)
            return data.view(data.shape[0], -1).view(torch.uint8)
        parts = []
        for group, ids in block_ids.items():
            page = self._pages[group]
            index = torch.tensor(ids, dtype=torch.long, device=self.device)
            for kv in self._group_tensors(group):
                rows = kv[: page.planes, :, : page.rows, :, : page.channels].index_select(1, index)
                parts.append(rows.transpose(0, 1).reshape(len(ids), -1))  # [n, planes * rows * H * C]
        if not parts or parts[0].shape[0] == 0:
            return torch.empty(0, self.block_bytes, dtype=torch.uint8, device=self.device)
        return torch.cat(parts, dim=1).view(torch.uint8)

    def _write_payloads_here(self, block_ids: dict[int, list[int]], payloads: torch.Tensor) -> None:
        """The inverse of _payloads_here: payloads [blocks, block_bytes] uint8 (any device)."""
        num_blocks = payloads.shape[0]
        if self._whole_blocks:
            layers = sum(len(self.kv_layout.groups[g].layers) for g in block_ids)
            self.scatter(block_ids, payloads.view(self.kv_caches[0].dtype).view(num_blocks, layers, *self._block_shape))
            return
        data = payloads.to(self.device, non_blocking=True).view(self.kv_caches[0].dtype)
        offset = 0
        for group, ids in block_ids.items():
            page = self._pages[group]
            index = torch.tensor(ids, dtype=torch.long, device=self.device)
            for kv in self._group_tensors(group):
                _, _, _, heads, width = kv.shape
                channels = width if page.channels is None else page.channels
                size = page.planes * page.rows * heads * channels
                chunk = data[:, offset : offset + size].reshape(num_blocks, page.planes, page.rows, heads, channels)
                kv[: page.planes, index, : page.rows, :, :channels] = chunk.transpose(0, 1)
                offset += size

    @torch.inference_mode()
    def copy_out(self, block_ids: dict[int, list[int]], dst: torch.Tensor, rows: list[int]) -> None:
        """The blocks' payloads into rows of dst (a host [rows, block_bytes] uint8 tensor;
        pinned memory makes the copies asynchronous), block i into rows[i]: one gather on
        the device, then one copy per run of consecutive rows."""
        with self._lock, self._side_stream():
            if self._stream is not None:
                self._stream.wait_stream(torch.cuda.default_stream(self.device))
            data = self._payloads_here(block_ids)
            for start, row, length in _runs(rows):
                dst[row : row + length].copy_(data[start : start + length], non_blocking=True)
            if self._stream is not None:
                self._stream.synchronize()

    @torch.inference_mode()
    def copy_in(self, block_ids: dict[int, list[int]], src: torch.Tensor, rows: list[int]) -> None:
        """The inverse of copy_out: rows of src into the blocks (block i from rows[i])."""
        with self._lock, self._side_stream():
            staging = torch.empty((len(rows), self.block_bytes), dtype=torch.uint8, device=self.device)
            for start, row, length in _runs(rows):
                staging[start : start + length].copy_(src[row : row + length], non_blocking=True)
            self._write_payloads_here({g: ids[: len(rows)] for g, ids in block_ids.items()}, staging)
            if self._stream is not None:
                self._stream.synchronize()

    def write_blocks(self, block_ids: dict[int, list[int]], payloads: list[bytes]) -> int:
        """Write the leading payloads of the right size into the blocks (per persistent
        group, one id per payload); returns how many were written."""
        good = 0
        for payload in payloads:
            if len(payload) != self.block_bytes:
                break
            good += 1
        if good == 0:
            return 0
        raw = torch.frombuffer(bytearray(b"".join(payloads[:good])), dtype=torch.uint8)
        self.write_payloads(block_ids, raw.view(good, self.block_bytes))
        return good

    def _side_stream(self) -> "torch.cuda.StreamContext | _NoStream":
        return torch.cuda.stream(self._stream) if self._stream is not None else _NoStream()


class JoinedRanksRegion(KVRegion):
    """What every region over an instance's ranks' regions shares (ranked_region.py's
    and dp_region.py's): it owns no tensors, only the ranks' regions (rank
    0's first), each with its lock and (on a GPU) its copy stream; copies to and from a
    staging tensor go through its payloads.

    NIXL is carried: ``tensors`` and ``allocations`` are every rank's, rank after rank,
    and ``placement`` says which rank's copy of a block is where, so rank 0's one agent
    registers every rank's cache (the others' as rank 0 mapped them) and a handoff is one
    read, one notification and one lease (shared/kv/connectors/nixl.py). On the CPU the
    other ranks' caches are shared memory, plain host memory to UCX. On a GPU they are
    CUDA IPC / VMM mappings of the other ranks' allocations in rank 0's process: whether
    UCX's cuda_ipc and RDMA transports accept memory so mapped is unverified until a
    multi-GPU run (issue 33); where registering it fails, the NIXL link turns itself off
    with that reason and KV goes through kvcache. The sliding-window state cache is not
    carried (``gather``/``scatter``; the engine keeps none with several ranks)."""

    kind = "multi-rank"
    """How errors name the instance."""

    def _join(self, ranks: list[KVRegion]) -> KVRegion:
        """Take the ranks' regions (KVRegion.__init__ is not run); rank 0's."""
        if len(ranks) < 2:
            raise ValueError(f"a {self.kind} KV region joins at least two ranks")
        first = ranks[0]
        self.ranks = ranks
        self.kv_layout = first.kv_layout
        self.device = first.device
        self.persistent_groups = first.persistent_groups
        self.kv_caches = first.kv_caches
        self.stacked = None
        return first

    @torch.inference_mode()
    def copy_out(self, block_ids: dict[int, list[int]], dst: torch.Tensor, rows: list[int]) -> None:
        data = self.read_payloads(block_ids)
        for start, row, length in _runs(rows):
            dst[row : row + length].copy_(data[start : start + length])

    @torch.inference_mode()
    def copy_in(self, block_ids: dict[int, list[int]], src: torch.Tensor, rows: list[int]) -> None:
        staging = src.index_select(0, torch.tensor(rows, dtype=torch.long, device=src.device))
        self.write_payloads({g: ids[: len(rows)] for g, ids in block_ids.items()}, staging)

    # -- for NIXL: every rank's memory, rank-major -----------------------------------

    @property
    def tensors(self) -> list[torch.Tensor]:  # type: ignore[override]
        """Every rank's cache tensors, rank after rank (each rank's in KVRegion.tensors' order):
        rank r's k-th is ``tensors[r * len(tensors) // ranks + k]``."""
        return [t for rank in self.ranks for t in rank.tensors]

    @property
    def allocations(self) -> list[torch.Tensor]:
        """Every rank's allocations, rank after rank: what rank 0's NIXL agent registers."""
        return [a for rank in self.ranks for a in rank.allocations]

    # -- not carried ---------------------------------------------------------------

    def gather(self, block_ids: dict[int, list[int]]) -> torch.Tensor:
        raise ValueError("no sliding-window state cache with several ranks")

    def scatter(self, block_ids: dict[int, list[int]], data: torch.Tensor) -> None:
        raise ValueError("no sliding-window state cache with several ranks")

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()


def per_tensor(allocations: list[torch.Tensor]) -> list[torch.Tensor]:
    """A cache's tensors from its allocations (KVRegion.allocations, as a peer maps them):
    a [tensors, planes, blocks, ...] allocation is that many tensors."""
    return [t for a in allocations for t in (a.unbind(0) if a.dim() == 6 else [a])]


def _runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """(index into rows, first row, length) of each run of consecutive rows."""
    runs: list[tuple[int, int, int]] = []
    for i, row in enumerate(rows):
        if runs and runs[-1][1] + runs[-1][2] == row:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((i, row, 1))
    return runs


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    first = tensors[0]
    storage = first.untyped_storage()
    for k, t in enumerate(tensors):
        if (
            not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage.data_ptr()
            or t.storage_offset() != first.storage_offset() + k * first.numel()
        ):
            return None
    whole = torch.empty(0, dtype=first.dtype, device=first.device)
    return whole.set_(storage, first.storage_offset(), (len(tensors), *first.shape))


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
