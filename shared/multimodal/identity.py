"""An image's identity: 256 bits that name what the vision tower would make of it.

Over the model, the image processor's settings and the decoded pixels with their
shape (vLLM's mm_hash does the same): the same picture sent as PNG or as lossless
WebP is one image, and one image under another model or processor is another. A
client's uuid (vLLM's ``uuid`` on the content part) stands for the pixels where
given: the client vouches that one uuid is one image. Never a short value in the
token ids: SGLang's 30-bit one collides at ~39k distinct images with even odds.

Each field is length-prefixed, and uuid and pixel hashes are told apart by a tag, so
no two different inputs spell the same bytes to the hash."""

import hashlib
import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

_PERSON = b"infermesh-image1"
"""blake2b's personalisation (16 bytes): these hashes never equal another use's."""


def image_hash(
    model: str, processor_settings: Mapping[str, Any], pixels: np.ndarray, uuid: str | None = None
) -> bytes:
    """32 bytes naming the image: blake2b over model, the canonical JSON of
    processor_settings, and uuid if given, else pixels (uint8, height x width x 3)."""
    h = hashlib.blake2b(digest_size=32, person=_PERSON)
    _field(h, model.encode())
    _field(h, canonical_json(processor_settings).encode())
    if uuid is not None:
        _field(h, b"uuid")
        _field(h, uuid.encode())
        return h.digest()
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"pixels must be uint8 height x width x 3, got {pixels.dtype} {pixels.shape}")
    _field(h, b"pixels")
    h.update(struct.pack("<3Q", *pixels.shape))  # 2x6 and 3x4 are not one image
    h.update(np.ascontiguousarray(pixels).data)
    return h.digest()


def canonical_json(settings: Mapping[str, Any]) -> str:
    """One spelling per value: sorted keys, no spaces, no NaN (a caller's bug, refused)."""
    return json.dumps(settings, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _field(h: "hashlib._Hash", data: bytes) -> None:
    h.update(struct.pack("<Q", len(data)))
    h.update(data)
