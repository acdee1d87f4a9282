"""The request as the mesh's messages carry it: the PrefillRequest of an attempt, and
its images made ready once per request (a migration resends the same ones): each a
lossless PNG (shared/stage/convert.py), placed in the prompt (their spans: routing
keys equal to the workers' block hashes, which carry each image's identity), and the
whole checked against MAX_REQUEST_BYTES also once prefill has grown it into decode's
handoff. Images ride the request's NATS messages rather than a bulk channel: the Bus
sends a message past the server's max_payload in parts (shared/runtime/bus_parts.py),
so the bound is the bus's, not one NATS message; a request's images are bounded
(images.max_per_request, the PNG sizes checked here), and a second channel from the
balancer to every prefill and decode instance would be another authenticated plane
for what fits the first."""

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from services.balancer.generation import GenerationError, GenerationRequest
from shared.kv.block_hash import ImageSpan, image_spans
from shared.multimodal.errors import ImageError
from shared.multimodal.grid import PatchGrid
from shared.proto import mesh_pb2
from shared.runtime.bus_parts import MAX_MESSAGE_BYTES
from shared.stage.convert import image_to_proto, params_to_proto

HANDOFF_BYTES_PER_BLOCK = 64
"""What decode's handoff adds per prompt block beyond the request: the block's hash (34
bytes on the wire) and its id in prefill's cache per KV group (up to 5 bytes each, a
few groups), rounded up."""
HANDOFF_HEADROOM_BYTES = 32 << 10
"""The rest of the handoff and the message around it: NATS headers (the trace context),
the KV source's region and NIXL descriptions, the first token's logprobs, instance names."""
TOKEN_ID_BYTES = 5
"""A token id's most bytes on the wire (a uint32 varint)."""
MAX_REQUEST_BYTES = MAX_MESSAGE_BYTES // 2
"""The most bytes a request with its images, grown into decode's handoff, may take on
the bus: half the bound on a message sent in parts (128 MiB), the other half left to
the prompt logprobs the same handoff may carry (frontend/jobs.py
MAX_PROMPT_LOGPROB_BYTES). 64 MiB holds the default inline body's images
(balancer.max_request_bytes, 50 MiB as base64) at any compression."""


@dataclass(frozen=True, slots=True)
class ImageLayout:
    """How the served model lays an image into a prompt: its placeholder token, repeated
    once per image token, as many as the processor's grid makes (the front door's
    expansion, shared/multimodal/grid.py)."""

    token_id: int
    grid: PatchGrid


@dataclass(frozen=True, slots=True)
class WireImages:
    """A request's images as every attempt sends them."""

    messages: tuple[mesh_pb2.ImageData, ...] = ()
    spans: tuple[ImageSpan, ...] = ()
    """Each image's placeholder run and identity: what the routing keys carry."""


NO_IMAGES = WireImages()


async def wire_images(req: GenerationRequest, layout: ImageLayout | None, block_size: int,
                      max_bytes: int = MAX_REQUEST_BYTES) -> WireImages:  # fmt: skip
    """The request's images for the mesh; a 400 naming the image and the limit where,
    beside the rest of the request, they would pass max_bytes (the bus sends them in
    parts: a server's max_payload is no limit)."""
    if not req.images:
        return NO_IMAGES
    first = req.images[0].param
    if layout is None:  # the front door refuses images for such a model before loading them
        raise GenerationError(f"{first}: the model does not accept images", 400, "invalid_request_error", param=first)
    try:
        lengths = [layout.grid.num_tokens(*image.size, image.param) for image in req.images]
        spans = image_spans(req.prompt_token_ids, layout.token_id, [image.hash for image in req.images], lengths)
    except ImageError as exc:
        raise GenerationError(str(exc), 400, "invalid_request_error", param=exc.param) from None
    except ValueError as exc:  # the front door's expansion made the runs: a mismatch is the conversation's
        raise GenerationError(f"messages: {exc}", 400, "invalid_request_error", param="messages") from None
    # PNG takes milliseconds per image: off the event loop.
    messages = await asyncio.to_thread(lambda: [image_to_proto(image.pixels, image.hash) for image in req.images])
    check_fits(req, messages, max_bytes, block_size)
    return WireImages(tuple(messages), tuple(spans))


def check_fits(req: GenerationRequest, messages: Sequence[mesh_pb2.ImageData], max_bytes: int,
               block_size: int) -> None:  # fmt: skip
    """A 400 naming the first image past the budget when the request with its images,
    grown into decode's handoff (its tokens: a migration resends the prompt with the
    tokens so far; a hash and block ids per block; headroom), passes max_bytes."""
    num_tokens = len(req.prompt_token_ids) + req.params.max_tokens
    size = prefill_request(req, (), "").ByteSize() + TOKEN_ID_BYTES * req.params.max_tokens
    size += -(-num_tokens // block_size) * HANDOFF_BYTES_PER_BLOCK + HANDOFF_HEADROOM_BYTES
    for image, msg in zip(req.images, messages):
        size += msg.ByteSize() + 8  # the field's tag and length
        if size > max_bytes:
            total = sum(m.ByteSize() for m in messages)
            raise GenerationError(
                f"{image.param}: the request's images take {total} bytes as lossless PNG, and with the "
                f"conversation they pass the mesh's limit of {max_bytes} bytes for a request's images; "
                "send smaller or fewer images", 400, "invalid_request_error", param=image.param,
            )  # fmt: skip


def prefill_request(req: GenerationRequest, images: Sequence[mesh_pb2.ImageData],
                    decode_instance: str) -> mesh_pb2.PrefillRequest:  # fmt: skip
    """The request as a prefill instance, or its decode instance prefilling it, takes it."""
    return mesh_pb2.PrefillRequest(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=params_to_proto(req.params),
        cache_salt=req.cache_salt or "",
        decode_instance=decode_instance,
        images=images,
    )
