"""The bytes of one stored block: a checksummed header, the layout string,
then the KV data.

    value = version u8 | crc32 u32 | stored_at f64 (unix s) | layout length u16 | layout | data

Checksum: CRC-32 (zlib) over (hash, header, layout, data). We guard against
accidental damage (bit rot, a torn write after an OS crash with sync off), not
an attacker who can write the LMDB file anyway; CRC-32 catches every burst
error up to 32 bits and misses random damage with p = 2^-32. On this machine
it runs at 1.4 GiB/s against 0.4 GiB/s for blake2b (digest_size=16), and it
runs on every read, so blake2b would become the bottleneck of Get (gRPC streams
~0.8 GB/s, LMDB reads 6-8 GiB/s).
"""

import struct
import zlib
from dataclasses import dataclass

FORMAT_VERSION = 1
HEADER = struct.Struct("<BIdH")
_CRC_FIELDS = struct.Struct("<dH")  # the header fields the checksum covers (after the crc itself)


@dataclass(slots=True, frozen=True)
class StoredBlock:
    layout: str
    data: bytes
    stored_at: float
    """Unix time of the put that first stored it."""


def _checksum(block_hash: bytes, stored_at: float, layout: bytes | memoryview, data: bytes | memoryview) -> int:
    """The hash is included so a value found under the wrong key counts as corrupt."""
    crc = zlib.crc32(block_hash)
    crc = zlib.crc32(_CRC_FIELDS.pack(stored_at, len(layout)), crc)
    crc = zlib.crc32(layout, crc)
    return zlib.crc32(data, crc)


def encode_block(block_hash: bytes, layout: str, data: bytes, stored_at: float) -> bytes:
    layout_bytes = layout.encode()
    if len(layout_bytes) > 0xFFFF:
        raise ValueError(f"layout string of {len(layout_bytes)} bytes; at most 65535")
    crc = _checksum(block_hash, stored_at, layout_bytes, data)
    return b"".join((HEADER.pack(FORMAT_VERSION, crc, stored_at, len(layout_bytes)), layout_bytes, data))


def decode_block(block_hash: bytes, value: memoryview) -> StoredBlock | None:
    """The block if its header parses and its checksum matches, else None.
    Verifies on LMDB's own buffer; copies the data out only once verified."""
    if len(value) < HEADER.size:
        return None
    version, crc, stored_at, layout_len = HEADER.unpack_from(value)
    start = HEADER.size + layout_len
    if version != FORMAT_VERSION or len(value) < start:
        return None
    layout, data = value[HEADER.size : start], value[start:]
    if _checksum(block_hash, stored_at, layout, data) != crc:
        return None
    return StoredBlock(bytes(layout).decode(errors="replace"), bytes(data), stored_at)
