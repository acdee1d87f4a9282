from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockHeader(_message.Message):
    __slots__ = ("block_hash", "num_bytes", "layout", "ttl_s")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    num_bytes: int
    layout: str
    ttl_s: float
    def __init__(self, block_hash: _Optional[bytes] = ..., num_bytes: _Optional[int] = ..., layout: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("num_stored", "num_existing", "num_bytes", "shm_refused")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_EXISTING_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_REFUSED_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_existing: int
    num_bytes: int
    shm_refused: str
    def __init__(self, num_stored: _Optional[int] = ..., num_existing: _Optional[int] = ..., num_bytes: _Optional[int] = ..., shm_refused: _Optional[str] = ...) -> None: ...

class ShmSegment(_message.Message):
    __slots__ = ("path", "size", "nonce")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    nonce: bytes
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class NixlTarget(_message.Message):
    __slots__ = ("agent", "metadata", "address", "size", "token")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    agent: str
    metadata: bytes
    address: int
    size: int
    token: bytes
    def __init__(self, agent: _Optional[str] = ..., metadata: _Optional[bytes] = ..., address: _Optional[int] = ..., size: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class ShmBlock(_message.Message):
    __slots__ = ("header", "offset")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    offset: int
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., offset: _Optional[int] = ...) -> None: ...

class PutShmRequest(_message.Message):
    __slots__ = ("shm", "blocks")
    SHM_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    shm: ShmSegment
    blocks: _containers.RepeatedCompositeFieldContainer[ShmBlock]
    def __init__(self, shm: _Optional[_Union[ShmSegment, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[ShmBlock, _Mapping]]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("block_hashes", "shm", "nixl")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    shm: ShmSegment
    nixl: NixlTarget
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., shm: _Optional[_Union[ShmSegment, _Mapping]] = ..., nixl: _Optional[_Union[NixlTarget, _Mapping]] = ...) -> None: ...

class GetReply(_message.Message):
    __slots__ = ("header", "data", "missing", "landed", "segment_full", "shm_refused", "nixl_refused")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    LANDED_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FULL_FIELD_NUMBER: _ClassVar[int]
    SHM_REFUSED_FIELD_NUMBER: _ClassVar[int]
    NIXL_REFUSED_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    data: bytes
    missing: bytes
    landed: ShmBlock
    segment_full: bytes
    shm_refused: str
    nixl_refused: str
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., missing: _Optional[bytes] = ..., landed: _Optional[_Union[ShmBlock, _Mapping]] = ..., segment_full: _Optional[bytes] = ..., shm_refused: _Optional[str] = ..., nixl_refused: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("num_leading",)
    NUM_LEADING_FIELD_NUMBER: _ClassVar[int]
    num_leading: int
    def __init__(self, num_leading: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("num_blocks", "num_bytes", "capacity_bytes", "num_evicted", "num_expired", "num_corrupt", "num_hits", "num_misses", "num_blobs", "blob_bytes", "num_blob_hits", "num_blob_misses")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    NUM_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOBS_FIELD_NUMBER: _ClassVar[int]
    BLOB_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOB_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOB_MISSES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    capacity_bytes: int
    num_evicted: int
    num_expired: int
    num_corrupt: int
    num_hits: int
    num_misses: int
    num_blobs: int
    blob_bytes: int
    num_blob_hits: int
    num_blob_misses: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., num_evicted: _Optional[int] = ..., num_expired: _Optional[int] = ..., num_corrupt: _Optional[int] = ..., num_hits: _Optional[int] = ..., num_misses: _Optional[int] = ..., num_blobs: _Optional[int] = ..., blob_bytes: _Optional[int] = ..., num_blob_hits: _Optional[int] = ..., num_blob_misses: _Optional[int] = ...) -> None: ...
