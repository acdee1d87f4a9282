"""An image's identity (shared/multimodal/identity.py): one picture, however encoded
without loss, is one hash; another picture, another processor setting, another
model or a client's uuid is another."""

import numpy as np
import pytest

from shared.multimodal.decode import decode_image
from shared.multimodal.identity import image_hash
from tests.helpers.image_files import encode, noise

MODEL = "qwen2.5-vl-tiny"
PROCESSOR = {"patch_size": 14, "merge_size": 2, "min_pixels": 3136, "max_pixels": 12845056}


def decoded(data: bytes) -> np.ndarray:
    return decode_image(data, "messages.0.content.0", 1 << 24)


def test_the_same_picture_as_png_and_lossless_webp_is_one_image() -> None:
    pixels = noise(33, 17, seed=1)
    png, webp = encode(pixels, "PNG"), encode(pixels, "WEBP", lossless=True, quality=100)
    assert png != webp  # two files...
    from_png, from_webp = decoded(png), decoded(webp)
    assert np.array_equal(from_png, pixels) and np.array_equal(from_webp, pixels)
    assert image_hash(MODEL, PROCESSOR, from_png) == image_hash(MODEL, PROCESSOR, from_webp)  # ...one image


def test_distinct_pictures_settings_and_models_are_distinct_images() -> None:
    a, b = noise(16, 16, seed=1), noise(16, 16, seed=2)
    one_pixel = a.copy()
    one_pixel[5, 7, 1] ^= 1
    base = image_hash(MODEL, PROCESSOR, a)
    hashes = [
        base,
        image_hash(MODEL, PROCESSOR, b),
        image_hash(MODEL, PROCESSOR, one_pixel),
        image_hash(MODEL, {**PROCESSOR, "max_pixels": 1003520}, a),
        image_hash(MODEL, {**PROCESSOR, "do_resize": False}, a),
        image_hash("qwen2.5-vl-other", PROCESSOR, a),
        # The same bytes in another shape are another image.
        image_hash(MODEL, PROCESSOR, np.ascontiguousarray(a).reshape(8, 32, 3)),
    ]
    assert len(set(hashes)) == len(hashes)
    assert all(len(h) == 32 for h in hashes)  # 256 bits
    assert image_hash(MODEL, PROCESSOR, a.copy()) == base  # a function of the values alone
    # The settings' key order is no part of their meaning.
    assert image_hash(MODEL, dict(reversed(list(PROCESSOR.items()))), a) == base


def test_a_clients_uuid_names_the_image_instead_of_its_pixels() -> None:
    a, b = noise(8, 8, seed=1), noise(8, 8, seed=2)
    by_uuid = image_hash(MODEL, PROCESSOR, a, uuid="sku-1234-a")
    assert image_hash(MODEL, PROCESSOR, b, uuid="sku-1234-a") == by_uuid  # the client vouches for it
    assert image_hash(MODEL, PROCESSOR, a, uuid="sku-1234-b") != by_uuid
    assert image_hash(MODEL, PROCESSOR, a) != by_uuid
    assert image_hash("qwen2.5-vl-other", PROCESSOR, a, uuid="sku-1234-a") != by_uuid  # still per model


def test_pixels_must_be_rgb_bytes() -> None:
    with pytest.raises(ValueError, match="uint8 height x width x 3"):
        image_hash(MODEL, PROCESSOR, noise(4, 4).astype(np.float32))
    with pytest.raises(ValueError, match="uint8 height x width x 3"):
        image_hash(MODEL, PROCESSOR, noise(4, 4)[:, :, 0])
