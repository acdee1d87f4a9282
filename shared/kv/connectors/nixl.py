"""KV read straight out of a peer engine's cache through NIXL: the path between
containers, pods and nodes, where the same-namespace copy (peer.py) cannot map
the peer's memory. It sits behind that copy and in front of the stores.

Each engine registers its paged cache with its process's NIXL agent once
(`register_kv_region`). A prefill that holds a request's blocks under a lease
describes them in the handoff (`describe()`: its agent's name and where each
cache tensor lies); decode fetches the agent's metadata once per peer (over
NATS, by the `fetch_metadata` callback; a restarted peer has a new agent name,
so its metadata is fetched anew), then reads every group's leased blocks
straight into the blocks it reserved, in ONE transfer: a descriptor per run of
consecutive blocks per cache tensor and k/v plane, every layer at once. The
read carries a notification; prefill's connector hears it (`take_released`)
and its engine ends the lease then, with no message of ours.

An instance over several ranks (tensor or expert parallel, data-parallel attention)
is one region in rank 0's process with every rank's cache mapped there
(shared/kv/memory/ranked_region.py): its agent registers every rank's memory, the
description lists every rank's tensors (rank after rank) and the region's
`Placement` (which rank holds which copy of a block), and a read pairs the peer's
copies of each block with ours (`pair_copies`): still one read, one notification,
one lease. A peer whose copies cannot pair with ours (another tensor-parallel split)
is left to the link behind.

The lease rules and the read's thread are peer_link.py's, as for the peer copy:
a failed or timed-out read is recomputed, visibly (LoadResult.error; the span's
kv.path says "recompute"). Loads without a NIXL source and every save go to
the connector behind.
"""

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from shared.kv.connectors.base import BlockIds, KVConnector
from shared.kv.connectors.peer_link import PeerLink
from shared.kv.memory.region import Copy, KVRegion, Placement
from shared.kv.transfer import PeerSource
from shared.kv.wire.nixl import MemoryRegion, NixlAgent, NixlTransferError, NixlUnavailable, Registration

log = logging.getLogger(__name__)

RELEASE_PREFIX = b"kv-release:"
"""The notification a read leaves with the peer: this, then the request id."""


@dataclass(frozen=True, slots=True)
class TensorGeometry:
    """Where one cache tensor [planes, blocks, ...] lies: block b of plane p starts at
    address + p * plane_stride + b * block_stride and is block_bytes long."""

    address: int
    plane_stride: int
    block_stride: int
    block_bytes: int
    device: int
    planes: int = 2
    """K and V; one for a cache of one plane (DeepSeek-V4's)."""


def tensor_geometry(tensor: torch.Tensor) -> TensorGeometry:
    if tensor.dim() < 3 or not tensor[0, 0].is_contiguous():
        raise ValueError(f"a cache tensor of shape {tuple(tensor.shape)} is not [planes, blocks, ...] with contiguous blocks")
    size = tensor.element_size()
    return TensorGeometry(
        tensor.data_ptr(), tensor.stride(0) * size, tensor.stride(1) * size, tensor[0, 0].numel() * size,
        tensor.device.index or 0, tensor.shape[0],
    )  # fmt: skip


def block_runs(src: list[int], dst: list[int]) -> np.ndarray:
    """[runs, 3] (first source block, first destination block, length) of the runs
    where both sides' ids are consecutive: one descriptor each."""
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    if not len(s):
        return np.zeros((0, 3), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(s)])))
    return np.stack([s[starts], d[starts], lengths], axis=1)


def pair_copies(remote: list[Copy], local: list[Copy]) -> list[tuple[Copy, Copy]]:
    """Which of the peer's copies of a block each of ours reads: as many on both sides
    pair by position (tensor parallel rank r into rank r, replicated into replicated, one
    rank into one); otherwise every local copy reads the peer's first (one rank fanned out
    into a replicated instance; a replicated peer read once into one rank)."""
    if len(remote) == len(local):
        return list(zip(remote, local))
    return [(remote[0], copy) for copy in local]


def descriptors(
    plan_src: dict[int, list[int]],
    plan_dst: dict[int, list[int]],
    tensors_of_group: dict[int, list[int]],
    theirs: list[TensorGeometry],
    ours: list[TensorGeometry],
    their_placement: Placement | None = None,
    our_placement: Placement | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The (remote, local) descriptor lists, [n, 3] (address, bytes, device) each, that
    move plan_src's blocks of the peer into plan_dst's blocks here: per group and per
    (peer rank, our rank) its blocks' copies pair in (the placements, pair_copies), for
    each of its layers' cache tensors (tensors_of_group: their indices within a rank's
    tensors; theirs / ours list every rank's, rank after rank) and each plane, one
    descriptor per run of blocks consecutive on both sides. A placement left out: one rank."""
    their_placement = their_placement or Placement()
    our_placement = our_placement or Placement()
    their_per_rank = len(theirs) // their_placement.ranks
    our_per_rank = len(ours) // our_placement.ranks
    remote, local = [], []
    for group, src in plan_src.items():
        dst = plan_dst[group]
        pairs: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for their_copies, our_copies in zip(their_placement.copies(group, src), our_placement.copies(group, dst),
                                            strict=True):  # fmt: skip
            for (their_rank, their_id), (our_rank, our_id) in pair_copies(their_copies, our_copies):
                src_ids, dst_ids = pairs.setdefault((their_rank, our_rank), ([], []))
                src_ids.append(their_id)
                dst_ids.append(our_id)
        for (their_rank, our_rank), (src_ids, dst_ids) in pairs.items():
            remote_part, local_part = _pair_descriptors(
                block_runs(src_ids, dst_ids), tensors_of_group[group],
                theirs[their_rank * their_per_rank : (their_rank + 1) * their_per_rank],
                ours[our_rank * our_per_rank : (our_rank + 1) * our_per_rank],
            )  # fmt: skip
            remote += remote_part
            local += local_part
    if not remote:
        return np.zeros((0, 3), dtype=np.uint64), np.zeros((0, 3), dtype=np.uint64)
    return np.concatenate(remote).astype(np.uint64), np.concatenate(local).astype(np.uint64)


def _pair_descriptors(
    runs: np.ndarray, tensor_ids: list[int], theirs: list[TensorGeometry], ours: list[TensorGeometry]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """descriptors of one peer rank's tensors and one of ours: per tensor and plane, one per run."""
    remote: list[np.ndarray] = []
    local: list[np.ndarray] = []
    if len(runs):
        for k in tensor_ids:
            t, o = theirs[k], ours[k]
            if (t.block_bytes, t.planes) != (o.block_bytes, o.planes):
                raise ValueError(f"cache tensor {k}: the peer's blocks are {t.planes} x {t.block_bytes} bytes, "
                                 f"ours {o.planes} x {o.block_bytes}")  # fmt: skip
            for plane in range(t.planes):
                lengths = runs[:, 2] * t.block_bytes
                remote.append(np.stack([t.address + plane * t.plane_stride + runs[:, 0] * t.block_stride,
                                        lengths, np.full(len(runs), t.device)], axis=1))  # fmt: skip
                local.append(np.stack([o.address + plane * o.plane_stride + runs[:, 1] * o.block_stride,
                                       lengths, np.full(len(runs), o.device)], axis=1))  # fmt: skip
    return remote, local


class NixlConnector(PeerLink):
    path = "nixl"
    copy_name = "NIXL read"

    def __init__(
        self,
        behind: KVConnector,
        agent_name: str,
        fetch_metadata: Callable[[str], bytes],
        *,
        backends: tuple[str, ...] = ("UCX",),
        transfer_timeout_s: float = 30.0,
        loopback_only: bool = False,
    ) -> None:
        """fetch_metadata(instance_id): the NIXL agent metadata of that peer (over NATS;
        raises when it does not answer). Called from this connector's thread.
        loopback_only: the worker binds loopback, so UCX listens there alone."""
        super().__init__(behind, "kv-nixl-read")
        self._agent_name = agent_name
        self._backends = backends
        self._fetch = fetch_metadata
        self._timeout_s = transfer_timeout_s
        self._loopback_only = loopback_only
        self.agent: NixlAgent | None = None
        self._registration: Registration | None = None
        """The KV cache's: what peers are given metadata of (not the kvcache client's
        landing buffer, which shares this agent)."""
        self._geometry: list[TensorGeometry] = []
        """Every rank's cache tensors, rank after rank (one rank: its own)."""
        self._placement = Placement()
        self._memory = "DRAM"
        self._description = b""
        self.num_bytes_read = 0

    # -- set-up ------------------------------------------------------------------

    def register_kv_region(self, region: KVRegion) -> None:
        super().register_kv_region(region)
        try:
            self._geometry = [tensor_geometry(t) for t in region.tensors]
            self._placement = region.placement
            agent = NixlAgent(self._agent_name, self._backends, loopback_only=self._loopback_only)
            whole = region.allocations
            self._memory = "VRAM" if region.device.type == "cuda" else "DRAM"
            self._registration = agent.register(
                [MemoryRegion(t.data_ptr(), t.numel() * t.element_size(), t.device.index or 0) for t in whole],
                self._memory)  # fmt: skip
        except (NixlUnavailable, ValueError) as exc:
            log.warning("no NIXL KV path (%s): across namespaces KV comes from kvcache", exc)
            return
        self.agent = agent
        self._description = json.dumps(
            {"agent": agent.name, "memory": self._memory, "layout": region.layout,
             "tensors": [[g.address, g.plane_stride, g.block_stride, g.block_bytes, g.device, g.planes]
                         for g in self._geometry],
             "placement": self._placement.to_json()}
        ).encode()  # fmt: skip
        log.info("NIXL agent %s: %d bytes of KV cache registered (%s)", agent.name,
                 sum(t.numel() * t.element_size() for t in whole), self._memory)  # fmt: skip

    @property
    def ready(self) -> bool:
        """Whether peers can read this engine's cache (and this engine theirs)."""
        return self.agent is not None

    def describe(self) -> bytes:
        """How a peer reads this engine's held blocks (the handoff's KvSource.nixl);
        empty without NIXL."""
        return self._description

    def metadata(self) -> bytes:
        """This agent's metadata, for a peer that asks (once per peer): of the KV cache
        alone."""
        assert self.agent is not None
        return self.agent.metadata(only=self._registration)

    # -- loads -----------------------------------------------------------------

    def _reach(self, source: PeerSource) -> dict | None:
        """The peer's description when a read from it may work, else None."""
        if not source.nixl or self.agent is None:
            return None
        try:
            peer = json.loads(source.nixl)
            if peer["memory"] not in ("DRAM", "VRAM") or peer["layout"] != self.region.layout:
                return None
            peer["tensors"] = [TensorGeometry(*(int(v) for v in t)) for t in peer["tensors"]]
            # A peer from before placements is one rank.
            placement = peer.get("placement")
            theirs = Placement.from_json(placement) if placement else Placement("one", 1, {}, peer["layout"])
            peer["placement"] = theirs
            if not isinstance(peer["agent"], str):
                return None
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("unreadable NIXL source from %s (%s): through kvcache", source.instance_id, exc)
            return None
        ours, num_theirs = self._placement, len(peer["tensors"])
        per_rank, left = divmod(num_theirs, theirs.ranks)
        if theirs.copy_layout != ours.copy_layout or left or per_rank * ours.ranks != len(self._geometry):
            # Another tensor-parallel split (each copy other heads): the same-namespace copy refuses it too.
            log.info("no NIXL KV path from %s (its blocks are %s over %d ranks, ours %s over %d): through the link "
                     "behind", source.instance_id, theirs.copy_layout, theirs.ranks, ours.copy_layout, ours.ranks)  # fmt: skip
            return None
        return peer

    def _move(self, request_id: str, source: PeerSource, route: dict, src: BlockIds, dst: BlockIds) -> None:
        """One READ of every block; the notification it leaves ends the peer's lease."""
        assert self.agent is not None
        name = route["agent"]
        self.agent.ensure_peer(name, lambda: self._fetch(source.instance_id))
        layout = self.region.kv_layout
        tensors = {g: [layout.tensor_index(layer) for layer in layout.groups[g].layers] for g in src}
        remote, local = descriptors(src, dst, tensors, route["tensors"], self._geometry, route["placement"],
                                    self._placement)  # fmt: skip
        try:
            self.num_bytes_read += self.agent.read(name, local, remote, self._memory, route["memory"],
                                                   RELEASE_PREFIX + request_id.encode(), self._timeout_s)  # fmt: skip
        except NixlTransferError:
            self.agent.forget_peer(name)  # it may be gone or restarted: fetch its metadata again next time
            raise

    # -- the owner's side: reads of our held blocks that finished ---------------

    def take_released(self) -> list[str]:
        released = self.behind.take_released()
        if self.agent is not None:
            for note in self.agent.take_notifications():
                if note.startswith(RELEASE_PREFIX):
                    released.append(note[len(RELEASE_PREFIX) :].decode(errors="replace"))
        return released

    def close(self) -> None:
        super().close()
        if self.agent is not None:
            self.agent.close()
