"""What a request asks of the engine's KV connector, and what a finished one holds
for a peer: the transfer descriptors. They travel inside an EngineRequest and a
RequestOutput; the stage skeleton turns the peer's part into its wire form
(mesh_pb2.KvSource, shared/stage/kv_handoff.py). Plain data: no torch here.

A direct handoff carries the sliding-window blocks a query at the held boundary
sees (`window`), beside the persistent groups' blocks: decode then resumes with
the window prefill computed, as the same request on one engine would, instead
of replaying it (approximate in bounded mode). Stores never get them: sliding-
window KV lives only in worker memory (docs/architecture.md).
"""

from dataclasses import dataclass, field


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
    window_first: int = 0
    """The first block of the sliding window a query at num_blocks * block_size sees."""
    window: dict[int, list[int]] = field(default_factory=dict)
    """Per sliding KV group, the peer's block ids of blocks window_first .. num_blocks - 1;
    empty: no window is held (decode replays it)."""
    nixl: bytes = b""
    """How to read the blocks through NIXL from another namespace or host (the peer's
    NixlConnector.describe()); empty when the peer has no NIXL agent."""


@dataclass(slots=True)
class HeldBlocks:
    """A finished request's prompt blocks held for a peer to copy, until `deadline` (unix time)."""

    block_ids: dict[int, list[int]]
    num_blocks: int
    deadline: float
    window_first: int = 0
    window: dict[int, list[int]] = field(default_factory=dict)
    """As PeerSource's: per sliding group, blocks window_first .. num_blocks - 1; empty: none."""


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
    """What one direct load from `source` copies: (the peer's block ids, ours) per group.
    The persistent groups' blocks first_block .. first_block + num_blocks - 1 go into the
    leading ids of `block_ids` (what the engine reserved for the load and passed to
    start_load); with a window, every window block of each sliding group goes into that
    group's reserved ids. A window the reservation has no room for is not copied (the
    engine then indexes none and replays)."""
    src = {g: ids[first_block : first_block + num_blocks] for g, ids in source.block_ids.items()}
    dst = {g: block_ids[g][:num_blocks] for g in source.block_ids}
    if source.window and all(len(block_ids.get(g, ())) >= len(ids) for g, ids in source.window.items()):
        for g, ids in source.window.items():
            src[g] = list(ids)
            dst[g] = block_ids[g][: len(ids)]
    return src, dst


def persistent_ids(block_ids: dict[int, list[int]], persistent_groups: tuple[int, ...]) -> dict[int, list[int]]:
    """block_ids without the sliding groups' window blocks (a load for a peer source may
    carry them): what a store writes, since it holds only persistent groups."""
    return {g: ids for g, ids in block_ids.items() if g in persistent_groups}
