"""The direct prefill -> decode KV path: a connector that copies a request's
prompt KV straight out of the prefill engine's cache on this host (CUDA IPC on
a GPU, shared memory on the CPU), and hands every other load, and every save,
to the connector behind it (NIXL, then the stores).

Prefill holds the blocks under a lease and says so in the handoff
(`KVTransferParams.source`); the lease rules and the copy thread are
peer_link.py's. Here the peer's cache is mapped once and a copy is device to
device, one gather per cache tensor; when it is done the peer is told to let the
blocks go. A peer that cannot be mapped (another host, another PID namespace, a
dead process) sends the request to the connector behind.
"""

import logging
from collections.abc import Callable

import torch

from shared.kv.connectors.base import BlockIds, KVConnector
from shared.kv.connectors.peer_link import LEASE_MARGIN_S, PeerLink
from shared.kv.memory.share import open_peer
from shared.kv.transfer import PeerSource

log = logging.getLogger(__name__)

__all__ = ["LEASE_MARGIN_S", "PeerConnector"]


class PeerConnector(PeerLink):
    path = "peer"
    copy_name = "direct copy"

    def __init__(self, behind: KVConnector, release: Callable[[str, str], None]) -> None:
        """release(instance_id, request_id): tell the peer its held blocks may go."""
        super().__init__(behind, "kv-peer-copy")
        self._release = release
        self._peers: dict[bytes, list[torch.Tensor]] = {}

    def _reach(self, source: PeerSource) -> list[torch.Tensor] | None:
        if not source.region:
            return None  # no mappable region (a NIXL-only source): for the link behind
        try:
            return self._open(source)
        except ValueError as exc:
            log.info("no direct KV path to %s (%s): through kvcache", source.instance_id, exc)
            return None

    def _open(self, source: PeerSource) -> list[torch.Tensor]:
        tensors = self._peers.get(source.region)
        if tensors is None:
            layout, tensors = open_peer(source.region, self.region.device)
            if layout != self.region.peer_layout:  # a multi-rank peer's names its split: ranks copy rank to rank
                raise ValueError(f"the peer's layout {layout} is not ours ({self.region.peer_layout})")
            self._peers[source.region] = tensors
        return tensors

    def _move(self, request_id: str, source: PeerSource, route: list[torch.Tensor], src: BlockIds, dst: BlockIds) -> None:
        self.region.copy_from_peer(route, src, dst)

    def _done(self, request_id: str, source: PeerSource) -> None:
        self._release(source.instance_id, request_id)

    def close(self) -> None:
        super().close()
        self._peers.clear()
