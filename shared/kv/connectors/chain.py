"""The connector chain of a mesh worker, in the order a load asks: the direct copy
out of a peer's cache mapped into this process (peer.py: same host and
namespace), then a read of a peer's cache through NIXL (nixl.py: another
container, pod or node), then the host-memory tier (host_tier.py, when it has
bytes), then the kvcache service (kvcache.py). Each link serves what it can and
hands the rest to the one behind; a save goes through every link to kvcache.
The engine sees the head only; the worker keeps the NIXL link (its metadata for
peers, its description in handoffs) and the kvcache link (kvcache's state:
`up`, `take_outcome`).
"""

from collections.abc import Callable
from dataclasses import dataclass

from shared.kv.connectors.base import KVConnector
from shared.kv.connectors.host_tier import HostTierConnector
from shared.kv.connectors.kvcache import KVCacheConnector
from shared.kv.connectors.nixl import NixlConnector
from shared.kv.connectors.peer import PeerConnector
from shared.kv.wire.nixl import agent_name
from shared.runtime.settings import KVCacheSettings, KVTransferSettings


@dataclass(frozen=True, slots=True)
class ConnectorChain:
    head: KVConnector
    """The first link: the one the engine drives."""
    kvcache: KVCacheConnector
    """The last link."""
    nixl: NixlConnector | None
    """The NIXL link, None when kv_transfer.nixl is off. It has an agent once the engine
    registered its cache, if NIXL started (`ready`)."""


def connector_chain(
    kvcache: KVCacheSettings,
    transfer: KVTransferSettings,
    host_kv_cache_bytes: int,
    instance_id: str,
    release: Callable[[str, str], None],
    fetch_nixl_metadata: Callable[[str], bytes],
    loopback_only: bool = False,
) -> ConnectorChain:
    """peer -> NIXL (when transfer.nixl) -> host tier (when host_kv_cache_bytes) ->
    kvcache. release(instance_id, request_id): tell a peer its held blocks may go
    (called from the peer link's thread); fetch_nixl_metadata(instance_id): that
    peer's NIXL agent metadata (called from the NIXL link's thread); loopback_only: the
    worker binds loopback, so NIXL's UCX listens there alone."""
    store = KVCacheConnector(kvcache.address, lookup_timeout_s=kvcache.lookup_timeout_s,
                             probe_interval_s=kvcache.probe_interval_s, load_when_faster=kvcache.load_when_faster,
                             shm_bytes=kvcache.shm_bytes)  # fmt: skip
    behind: KVConnector = store
    if host_kv_cache_bytes:
        behind = HostTierConnector(behind, host_kv_cache_bytes)
    nixl = None
    if transfer.nixl:
        backends = tuple(b.strip() for b in transfer.nixl_backends.split(",") if b.strip())
        nixl = NixlConnector(behind, agent_name(instance_id), fetch_nixl_metadata, backends=backends,
                             transfer_timeout_s=transfer.nixl_transfer_timeout_s,
                             loopback_only=loopback_only)  # fmt: skip
        behind = nixl
    return ConnectorChain(PeerConnector(behind, release), store, nixl)
