"""The connector chain of a mesh worker, in the order a load asks: the direct copy
out of a peer's cache mapped into this process (peer.py: same host and
namespace), then a read of a peer's cache through NIXL (nixl.py: another
container, pod or node), then the host-memory tier (host_tier.py, when it has
bytes), then the kvcache service (kvcache.py). Each link serves what it can and
hands the rest to the one behind; a save goes through every link to kvcache.
The engine sees the head only; the worker keeps the NIXL link (its metadata for
peers, its description in handoffs) and the kvcache link (kvcache's state:
`up`, `take_outcome`).

With kv_transfer.nixl on, the kvcache link's client also gets Gets written into a
landing buffer through NIXL (where kvcache cannot open its shared memory), with
the NIXL link's agent when it started: one agent per process. (The kvcache link
is built first, but makes its buffer at its first Get, after the engine
registered its cache with the NIXL link.)
"""

from collections.abc import Callable
from dataclasses import dataclass

from shared.kv.connectors.base import KVConnector
from shared.kv.connectors.host_tier import HostTierConnector
from shared.kv.connectors.kvcache import KVCacheConnector
from shared.kv.connectors.nixl import NixlConnector
from shared.kv.connectors.peer import PeerConnector
from shared.kv.wire.nixl import NixlAgent, agent_name
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
    backends = transfer.backends
    nixl: NixlConnector | None = None

    def kvcache_agent() -> NixlAgent:
        """The NIXL link's agent, else one of the kvcache client's own (the link is
        off, or its agent did not start: then neither will this one, and kvcache
        streams the bytes)."""
        if nixl is not None and nixl.agent is not None:
            return nixl.agent
        return NixlAgent(agent_name(f"{instance_id}-kv"), backends, loopback_only=loopback_only)

    store = KVCacheConnector(kvcache.address, lookup_timeout_s=kvcache.lookup_timeout_s,
                             probe_interval_s=kvcache.probe_interval_s, load_when_faster=kvcache.load_when_faster,
                             shm_bytes=kvcache.shm_bytes, nixl_bytes=transfer.kvcache_nixl_bytes if transfer.nixl else 0,
                             nixl_agent=kvcache_agent)  # fmt: skip
    behind: KVConnector = store
    if host_kv_cache_bytes:
        behind = HostTierConnector(behind, host_kv_cache_bytes)
    if transfer.nixl:
        nixl = NixlConnector(behind, agent_name(instance_id), fetch_nixl_metadata, backends=backends,
                             transfer_timeout_s=transfer.nixl_transfer_timeout_s,
                             loopback_only=loopback_only)  # fmt: skip
        behind = nixl
    return ConnectorChain(PeerConnector(behind, release), store, nixl)
