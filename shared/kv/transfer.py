"""What a request asks of the engine's KV connector, and what a finished one holds
for a peer: the transfer descriptors. They travel inside an EngineRequest and a
RequestOutput; the stage skeleton turns the peer's part into its wire form
(mesh_pb2.KvSource, shared/stage/kv_handoff.py). Plain data: no torch here.
"""

from dataclasses import dataclass


@dataclass(slots=True)
class PeerSource:
    """A request's prompt KV held in another engine's cache on this host, to copy directly."""

    instance_id: str
    region: bytes
    """How to map the peer's cache (KVRegion.share())."""
    block_ids: dict[int, list[int]]
    """Per persistent KV group, the peer's block ids of the prompt's leading blocks."""
    num_blocks: int
    lease_deadline: float
    """Unix time after which the peer may free the blocks: no copy reads them later."""
    layout: str
    nixl: bytes = b""
    """How to read the blocks through NIXL from another namespace or host (the peer's
    NixlConnector.describe()); empty when the peer has no NIXL agent."""


@dataclass(slots=True)
class HeldBlocks:
    """A finished request's prompt blocks held for a peer to copy, until `deadline` (unix time)."""

    block_ids: dict[int, list[int]]
    num_blocks: int
    deadline: float


@dataclass(slots=True)
class KVTransferParams:
    """What the engine's KV connector does for this request."""

    load: bool = False
    """At admission, load the prompt's blocks the connector's source (or `source`)
    holds and this engine lacks (the request waits for them in WAITING_FOR_KV)."""
    save: bool = False
    """When the request ends, store its prompt's full blocks the source lacks."""
    wait_for_save: bool = True
    """Hold the request's last output back until the save is stored (a handoff that
    relies on the store); False writes behind, off the request's latency."""
    hold: bool = False
    """When the request ends, keep its prompt's blocks for a peer to copy, under a
    lease (kv_lease_timeout_s); the last output says which blocks."""
    source: PeerSource | None = None
    """Copy the prompt's blocks from this peer's cache rather than from the store."""


def copy_plan(
    source: PeerSource, first_block: int, num_blocks: int, block_ids: dict[int, list[int]]
) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """(the peer's block ids per group, ours per group) of one load from a peer: its
    blocks first_block .. first_block + num_blocks - 1 of every persistent group into
    the blocks the engine reserved (`block_ids`)."""
    src = {g: ids[first_block : first_block + num_blocks] for g, ids in source.block_ids.items()}
    dst = {g: block_ids[g][:num_blocks] for g in src}
    return src, dst
