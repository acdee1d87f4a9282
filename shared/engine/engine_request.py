"""What enters the engine: one typed request, the same offline and in a service.

A service resumes a request another instance started (decode after prefill)
with the tokens generated so far and the seeded sampler's state; KV-transfer
parameters say what the engine moves in or out for it. Nothing travels as
``**kwargs``. No torch here.
"""

from dataclasses import dataclass, field

from shared.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class KVTransferParams:
    """What the engine's KV connector does for this request."""

    load: bool = False
    """At admission, load the prompt's blocks the connector's source holds and this
    engine lacks (the request waits for them in WAITING_FOR_KV)."""
    save: bool = False
    """When the request ends, store its prompt's full blocks the source lacks; its
    last output is held back until they are stored (a handoff may then rely on them)."""


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
    sampler_state: bytes | None = None
    """A seeded sampler's state to resume from (the request handed over mid-generation)."""
    kv_transfer: KVTransferParams | None = None
    trace_carrier: dict[str, str] | None = None
    """W3C trace headers of the request: the connector's calls join its trace."""
