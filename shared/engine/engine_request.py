"""What enters the engine: one typed request, the same offline and in a service.

A service resumes a request another instance started (decode after prefill)
with the tokens generated so far and the seeded sampler's state; KV-transfer
parameters say what the engine moves in or out for it. Nothing travels as
``**kwargs``. No torch here.
"""

from dataclasses import dataclass, field

from shared.engine.sampling_params import SamplingParams


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


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt: str | list[int]
    """Token ids, or text the engine encodes with special tokens (BOS), as transformers does."""
    sampling_params: SamplingParams
    cache_salt: str | None = None
    """Keeps one tenant's cached prefixes apart from another's (it enters the block hashes)."""
    resume_token_ids: list[int] = field(default_factory=list)
    """Tokens already generated elsewhere: the engine continues after them."""
    kv_transfer: KVTransferParams | None = None
    trace_carrier: dict[str, str] | None = None
    """W3C trace headers of the request: the connector's calls join its trace."""
