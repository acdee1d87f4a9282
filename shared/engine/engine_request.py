"""What enters the engine: one typed request, the same offline and in a service.

A service resumes a request another instance started (decode after prefill)
with the tokens generated so far and the seeded sampler's state; KV-transfer
parameters say what the engine moves in or out for it. Nothing travels as
``**kwargs``. No torch here (images hold tensors, but this module names their type only).
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.engine.sampling_params import SamplingParams
from shared.kv.transfer import KVTransferParams

if TYPE_CHECKING:
    from shared.model.multimodal import ImageEmbeddings, ImageInputs


@dataclass(frozen=True, slots=True)
class RequestImages:
    """A prompt's images, as the model's image processor made them (or as a vision
    instance encoded them: ImageEmbeddings, which the engine takes instead of running
    the tower), and their names."""

    inputs: "ImageInputs | ImageEmbeddings"
    hashes: tuple[bytes, ...]
    """One per image, in order: its identity (shared/multimodal/identity.py, or a content
    hash, shared/engine/images.py's content_hashes), which the block hashes carry."""

    def __post_init__(self) -> None:
        if len(self.hashes) != len(self.inputs.grids) or not all(self.hashes):
            raise ValueError(f"{len(self.inputs.grids)} images need as many non-empty hashes, got {len(self.hashes)}")


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
    images: RequestImages | None = None
    """The prompt's images, for a vision-language model: its placeholder tokens (one run
    per image, the processor's count) stand where each image goes."""
