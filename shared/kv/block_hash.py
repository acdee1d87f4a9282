"""The content address of a KV block, defined once for every process.

A full block of ``block_size`` tokens is named by a chain hash over
(parent block's hash, the block's token ids, extra keys). The first block's
extra keys carry the model fingerprint and the tenant's cache salt, so the
whole chain depends on them; later blocks may carry image hashes. The same
prefix gives the same hashes in every process and after every restart, which
is what lets the kvcache service (LMDB key), the balancer (routing key) and
each worker's prefix index agree. Never Python's ``hash()``: it is salted per
process.
"""

import hashlib
import struct
from collections.abc import Sequence
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
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids``, starting at block ``start``
    (whose parent hash is ``parent``; None for the chain's first block).
    A trailing partial block has no hash: its content is not final yet."""
    hashes: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    for i in range(start, num_full):
        extra = first_block_extra_keys(model_fingerprint, cache_salt) if i == 0 else ()
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


def kv_fingerprint(model_fingerprint: str, kv_dtype: str) -> str:
    """What the chain's first block mixes in: the KV bytes depend on the weights
    and on the cache dtype, so both name the chain. Engines and the balancer
    (which hashes prompts for routing) call this one function."""
    return f"{model_fingerprint}:{kv_dtype}"
