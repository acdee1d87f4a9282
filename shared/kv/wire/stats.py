"""kvcache's counts, one type for all who speak of them: the store makes it, the
Stats RPC carries it (StatsReply, fields of the same names) and the client returns it.
The service's /metrics are made from the same object (services/kvcache/servicer.py)."""

from dataclasses import asdict, dataclass, fields

from shared.proto import kvcache_pb2


@dataclass(slots=True, frozen=True)
class KVCacheStats:
    """Sizes now, and counts since the store was opened (a process's life, not persisted)."""

    num_blocks: int
    """Blocks held now."""
    num_bytes: int
    """Data bytes of the blocks held now."""
    capacity_bytes: int
    """Data bytes held at most before eviction."""
    num_evicted: int
    """Blocks evicted to stay under capacity."""
    num_expired: int
    """Blocks deleted after ttl_s without use."""
    num_corrupt: int
    """Blocks that failed their checksum (deleted, never served)."""
    num_hits: int
    """Blocks served by Get."""
    num_misses: int
    """Get reads that found no servable block (a Get ends at its first)."""
    num_blobs: int = 0
    """Keyed blobs held now (GetBlobs/PutBlobs: the vision stage's image embeddings)."""
    blob_bytes: int = 0
    """Data bytes of the blobs held now."""
    num_blob_hits: int = 0
    """Blobs served by GetBlobs."""
    num_blob_misses: int = 0
    """Blobs asked for by GetBlobs and not held (or expired, or corrupt)."""

    def to_proto(self) -> kvcache_pb2.StatsReply:
        return kvcache_pb2.StatsReply(**asdict(self))

    @classmethod
    def from_proto(cls, reply: kvcache_pb2.StatsReply) -> "KVCacheStats":
        return cls(**{f.name: getattr(reply, f.name) for f in fields(cls)})
