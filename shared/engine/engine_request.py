"""What enters the engine: one typed request, the same offline and in a service.

A service resumes a request another instance started (decode after prefill)
with the tokens generated so far and the seeded sampler's state; KV-transfer
parameters say what the engine moves in or out for it. Nothing travels as
``**kwargs``. No torch here.
"""

from dataclasses import dataclass, field

from shared.engine.sampling_params import SamplingParams
from shared.kv.transfer import KVTransferParams


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
