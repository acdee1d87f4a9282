"""A request's images on the mesh's wire (services/balancer/router/wire.py,
shared/stage/convert.py): lossless there and back, placed where the front door expanded
them (so the balancer's routing keys are the workers' block hashes), a request whose
images pass one NATS message let through (the bus sends it in parts), and one past the
mesh's limit on a request's images refused with a 400 naming the image and the limit."""

import asyncio

import numpy as np
import pytest

from services.balancer.generation import GenerationError, GenerationRequest
from services.balancer.router.wire import MAX_REQUEST_BYTES, ImageLayout, NO_IMAGES, wire_images
from shared.engine.sampling_params import SamplingParams
from shared.kv.block_hash import ImageSpan, hash_block_chain, image_spans
from shared.multimodal.grid import PatchGrid
from shared.multimodal.identity import image_hash
from shared.multimodal.image import LoadedImage
from shared.runtime.bus_parts import MAX_MESSAGE_BYTES
from shared.stage.convert import image_from_proto, image_to_proto
from tests.helpers.image_files import noise

PAD = 7
LAYOUT = ImageLayout(PAD, PatchGrid())
NATS_MAX_PAYLOAD = 1 << 20
"""nats-server's default max_payload."""


def loaded(pixels: np.ndarray, param: str) -> LoadedImage:
    return LoadedImage(pixels, "data:image/png;base64", image_hash("m", {}, pixels), param=param)


def request(images: list[LoadedImage], text: list[int] | None = None, max_tokens: int = 8) -> GenerationRequest:
    """A prompt of text, then each image's expanded placeholder run between two text tokens."""
    prompt = list(text or [1, 2, 3])
    for image in images:
        prompt += [5] + [PAD] * LAYOUT.grid.num_tokens(*image.size, image.param) + [6]
    return GenerationRequest("r-1", prompt, SamplingParams(max_tokens=max_tokens), images=images)


def test_pixels_cross_losslessly_and_a_wrong_message_is_refused() -> None:
    pixels = noise(33, 17, seed=3)
    msg = image_to_proto(pixels, b"h" * 32)
    assert (msg.height, msg.width) == (17, 33)
    assert np.array_equal(image_from_proto(msg, "images.0"), pixels)
    msg.width = 34  # the PNG is not what the message says
    with pytest.raises(ValueError, match="images.0: the PNG is 33x17, not the 34x17"):
        image_from_proto(msg, "images.0")
    with pytest.raises(ValueError, match="32 bytes"):
        image_from_proto(image_to_proto(pixels, b"short"), "images.0")
    msg = image_to_proto(pixels, b"h" * 32)
    msg.png = msg.png[: len(msg.png) // 2]
    with pytest.raises(ValueError, match="images.0: .*truncated"):
        image_from_proto(msg, "images.0")


def test_the_images_are_placed_where_the_front_door_expanded_them() -> None:
    red, blue = loaded(noise(20, 10, 1), "messages.0.content.1"), loaded(noise(8, 12, 2), "messages.0.content.3")
    req = request([red, blue])
    wire = asyncio.run(wire_images(req, LAYOUT, 16))
    # 20x10 and 8x12 grow to the minimum area: 6 tokens each, after [1, 2, 3, 5] and then [6, 5].
    assert wire.spans == (ImageSpan(red.hash, 4, 6), ImageSpan(blue.hash, 12, 6))
    assert [np.array_equal(image_from_proto(m, "i"), i.pixels) for m, i in zip(wire.messages, req.images)] == [True] * 2
    assert [m.hash for m in wire.messages] == [red.hash, blue.hash]
    # The routing keys of blocks holding an image differ with the image, not before it.
    other = loaded(noise(20, 10, 9), "messages.0.content.1")
    other_wire = asyncio.run(wire_images(request([other, blue]), LAYOUT, 16))
    mine = hash_block_chain(req.prompt_token_ids, 4, "fp", images=wire.spans)
    theirs = hash_block_chain(req.prompt_token_ids, 4, "fp", images=other_wire.spans)
    assert mine[0] == theirs[0] and mine[1] != theirs[1]  # block 1 (tokens 4..7) holds the first image
    assert asyncio.run(wire_images(request([]), LAYOUT, 16)) is NO_IMAGES


def test_image_spans_refuse_a_short_or_missing_run() -> None:
    with pytest.raises(ValueError, match="shorter"):
        image_spans([1, PAD, PAD, 2], PAD, [b"a"], [3])
    with pytest.raises(ValueError, match="no placeholder run for image 1"):
        image_spans([1, PAD, PAD, 2], PAD, [b"a", b"b"], [2, 2])


def test_images_past_one_nats_message_go_and_past_the_limit_are_a_400_naming_it() -> None:
    # Noise does not compress: 360x360 RGB is ~390 KB of PNG. Three pass nats-server's
    # default 1 MiB: the bus sends them in parts, so the default limit lets them through.
    images = [loaded(noise(360, 360, seed), f"messages.0.content.{seed}") for seed in range(3)]
    wire = asyncio.run(wire_images(request(images), LAYOUT, 16))
    assert sum(m.ByteSize() for m in wire.messages) > NATS_MAX_PAYLOAD
    assert MAX_REQUEST_BYTES == MAX_MESSAGE_BYTES // 2  # the other half: prompt logprobs in the same handoff
    # Under a limit of 1 MiB two fit, three do not.
    asyncio.run(wire_images(request(images[:2]), LAYOUT, 16, max_bytes=1 << 20))
    with pytest.raises(GenerationError) as caught:
        asyncio.run(wire_images(request(images), LAYOUT, 16, max_bytes=1 << 20))
    assert caught.value.status == 400 and caught.value.param == "messages.0.content.2"
    assert "lossless PNG" in str(caught.value) and f"limit of {1 << 20} bytes" in str(caught.value)
    # The budget holds the handoff the request grows into: a long answer's tokens count too.
    with pytest.raises(GenerationError) as caught:
        asyncio.run(wire_images(request(images[:2], max_tokens=40_000), LAYOUT, 16, max_bytes=1 << 20))
    assert caught.value.param == "messages.0.content.1"
