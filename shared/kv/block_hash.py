"""The content address of a KV block, defined once for every process.

A full block of ``block_size`` tokens is named by a chain hash over
(parent block's hash, the block's token ids, extra keys). The first block's
extra keys carry the model fingerprint and the tenant's cache salt, so the
whole chain depends on them; a block holding an image's tokens carries that
image's (hash, offset), since the tokens themselves are one placeholder id. The same
prefix gives the same hashes in every process and after every restart, which
is what lets the kvcache service (LMDB key), the balancer (routing key) and
each worker's prefix index agree. Never Python's ``hash()``: it is salted per
process.
"""

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""HASH_BYTES (32) bytes of SHA-256."""

HASH_BYTES = hashlib.sha256().digest_size

# The parent of the first block. Changing the version string invalidates every
# stored block, which is the point when the hash layout changes.
ROOT_HASH = BlockHash(hashlib.sha256(b"infermesh/kv-block/v1").digest())

ExtraKey = str | bytes | int


def _encode_extra_keys(extra_keys: Sequence[ExtraKey]) -> bytes:
    """Length-prefixed, type-tagged encoding so ("ab", "c") != ("a", "bc")."""
    out = bytearray(struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        if isinstance(key, bool) or not isinstance(key, (str, bytes, int)):
            raise TypeError(f"extra key must be str, bytes or int, got {type(key).__name__}")
        if isinstance(key, int):
            out += b"i" + struct.pack("<q", key)
            continue
        raw = key.encode() if isinstance(key, str) else key
        out += (b"s" if isinstance(key, str) else b"b") + struct.pack("<I", len(raw)) + raw
    return bytes(out)


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()
) -> BlockHash:
    """Hash one block. Token ids are packed as little-endian uint32 so the bytes
    (and the hash) do not depend on the platform or on Python's int size."""
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    h.update(_encode_extra_keys(extra_keys))
    return BlockHash(h.digest())


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """An image's run of placeholder tokens in a prompt: they all share one token id,
    so the ids alone cannot tell two images apart; the image's identity (32 bytes,
    shared/multimodal/identity.py) goes into the hash of every block the run touches."""

    hash: bytes
    start: int
    """The sequence position of its first token."""
    length: int
    """Its number of tokens."""


def image_spans(
    token_ids: Sequence[int], image_token_id: int, hashes: Sequence[bytes], lengths: Sequence[int]
) -> list[ImageSpan]:
    """Where each image's placeholder run sits in a prompt: image k (named hashes[k])
    takes lengths[k] tokens from the first placeholder after image k-1's run. The engine
    (lengths from the processor's grids) and the balancer (from the front door's
    arithmetic, for routing keys) place them with this one function, so their block
    hashes agree. ValueError where a run is missing or short."""
    if len(hashes) != len(lengths):
        raise ValueError(f"{len(hashes)} image hashes for {len(lengths)} lengths")
    ids = list(token_ids)
    spans: list[ImageSpan] = []
    at = 0
    for identity, length in zip(hashes, lengths):
        try:
            at = ids.index(image_token_id, at)
        except ValueError:
            raise ValueError(f"no placeholder run for image {len(spans)}") from None
        if ids[at : at + length] != [image_token_id] * length:
            raise ValueError(f"image {len(spans)}'s placeholder run at {at} is shorter than its {length} tokens")
        spans.append(ImageSpan(identity, at, length))
        at += length
    return spans


def image_extra_keys(images: Sequence[ImageSpan], first: int, end: int) -> tuple[ExtraKey, ...]:
    """The extra keys of the block over positions [first, end): per image it overlaps,
    (image hash, offset of the block's first token of it within the image). The offset
    matters: a block holding tokens 16..31 of an image is not one holding 0..15."""
    keys: list[ExtraKey] = []
    for image in images:
        if image.start < end and first < image.start + image.length:
            keys += [image.hash, max(first, image.start) - image.start]
    return tuple(keys)


def first_block_extra_keys(model_fingerprint: str, cache_salt: str | None) -> tuple[ExtraKey, ...]:
    """What the first block of every chain mixes in: blocks of another model or
    another tenant's salt never match."""
    return (model_fingerprint, cache_salt or "")


def hash_block_chain(
    token_ids: Sequence[int],
    block_size: int,
    model_fingerprint: str,
    cache_salt: str | None = None,
    *,
    start: int = 0,
    parent: BlockHash | None = None,
    images: Sequence[ImageSpan] = (),
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids``, starting at block ``start``
    (whose parent hash is ``parent``; None for the chain's first block).
    A trailing partial block has no hash: its content is not final yet. ``images``:
    the prompt's image runs, whose (hash, offset) the blocks they touch carry."""
    hashes: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    for i in range(start, num_full):
        extra = first_block_extra_keys(model_fingerprint, cache_salt) if i == 0 else ()
        if images:
            extra += image_extra_keys(images, i * block_size, (i + 1) * block_size)
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


def kv_fingerprint(model_fingerprint: str, kv_dtype: str) -> str:
    """What the chain's first block mixes in: the KV bytes depend on the weights
    and on the cache dtype, so both name the chain. Engines and the balancer
    (which hashes prompts for routing) call this one function."""
    return f"{model_fingerprint}:{kv_dtype}"
