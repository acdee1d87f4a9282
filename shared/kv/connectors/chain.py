"""The connector chain of a mesh worker, in the order a load asks: the direct copy
out of a peer's cache on this host (peer.py), then the host-memory tier
(host_tier.py, when it has bytes), then the kvcache service (kvcache.py). Each
link serves what it can and hands the rest to the one behind; a save goes
through every link to kvcache. The engine sees the head only; the worker keeps
the kvcache link too, for kvcache's state (`up`, `take_outcome`).
"""

from collections.abc import Callable
from dataclasses import dataclass

from shared.kv.connectors.base import KVConnector
from shared.kv.connectors.host_tier import HostTierConnector
from shared.kv.connectors.kvcache import KVCacheConnector
from shared.kv.connectors.peer import PeerConnector
from shared.runtime.settings import KVCacheSettings


@dataclass(frozen=True, slots=True)
class ConnectorChain:
    head: KVConnector
    """The first link: the one the engine drives."""
    kvcache: KVCacheConnector
    """The last link."""


def connector_chain(
    kvcache: KVCacheSettings, host_kv_cache_bytes: int, release: Callable[[str, str], None]
) -> ConnectorChain:
    """peer -> host tier (when host_kv_cache_bytes) -> kvcache. release(instance_id,
    request_id): tell a peer its held blocks may go (called from the peer link's thread)."""
    store = KVCacheConnector(kvcache.address, lookup_timeout_s=kvcache.lookup_timeout_s,
                             probe_interval_s=kvcache.probe_interval_s, load_when_faster=kvcache.load_when_faster,
                             shm_bytes=kvcache.shm_bytes)  # fmt: skip
    behind: KVConnector = store
    if host_kv_cache_bytes:
        behind = HostTierConnector(behind, host_kv_cache_bytes)
    return ConnectorChain(PeerConnector(behind, release), store)
