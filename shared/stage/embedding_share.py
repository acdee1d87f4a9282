"""Image embeddings read straight out of a vision instance's memory on the same host
(E/P/D): the direct path, beside kvcache, that KV's peer copy takes
(shared/kv/connectors/peer.py), through the same mapping (shared/kv/memory/share.py).

The vision instance keeps an arena in shared memory (`SharedMemoryAllocator`: a file
under /dev/shm, unlinked at once, reachable as /proc/<pid>/fd/<fd> while it lives) and
writes each image's embeddings there as it stores them in kvcache. The encode reply
carries, per image, where (`EmbeddingSource`: the arena's description, an offset, a
generation); the balancer puts it on the image (ImageData.peer_source). Prefill and
decode map the arena once (`open_peer`) and copy the bytes out; anything that stops
that (another PID namespace or host: the file there is another one; the instance gone;
the entry overwritten) is a `ValueError`, and the caller fetches from kvcache instead.
Given a directory both see (`engine.kv_share_dir`, as KV), the arena's file descriptor
is also handed over a unix socket there, which reaches a reader in another PID
namespace on the same host (shared/kv/memory/fd_passing.py). Where neither reaches (another PID namespace without
that directory, another host), the arena is also registered with the instance's NIXL
agent (vision.nixl) and the source says how to read it through NIXL
(`EmbeddingSource.nixl`): prefill and decode READ the entry through theirs
(shared/stage/embedding_nixl.py), under the same checks.

No lease: the arena is a ring and an entry lives until the ring comes round to it. Each
entry starts with a header (the image's identity, a generation); the writer clears the
generation before it touches an entry's bytes and sets it last, and the reader checks
identity and generation before and after its copy (a seqlock): a copy that raced a
rewrite is thrown away, never used as another image's embeddings. (Stores reach the
other process in program order on x86-64 and through the page cache of one file; the
copy is checked, not trusted, either way.)"""

import json
import logging
import struct
from collections import OrderedDict
from dataclasses import dataclass

import torch

from shared.kv.memory.share import SharedMemoryAllocator, describe, open_peer

log = logging.getLogger(__name__)

LAYOUT = "emb-arena1"
"""The arena's layout in its description: a peer that reads another format refuses it."""
HEADER = struct.Struct("<32sQQ")
"""An entry's header: the image's identity, the generation (0: being written), the data's bytes."""
ALIGN = 64
MAX_MAPPED = 8
"""Arenas a reader keeps mapped (vision instances on this host, restarts included)."""


@dataclass(frozen=True, slots=True)
class EmbeddingSource:
    """Where an image's embeddings lie in a vision instance's arena (ImageData.peer_source)."""

    region: str
    """The arena's description (shared/kv/memory/share.py's describe, as text)."""
    offset: int
    generation: int
    nbytes: int
    layout: str
    """The embeddings' blob layout (shared/stage/embeddings.py: dtype, shape, grid)."""
    nixl: str = ""
    """How to read the arena through NIXL (shared/stage/embedding_nixl.py's description:
    the instance, its agent, the arena's address and size); "": not offered."""

    def to_bytes(self) -> bytes:
        return json.dumps({"region": self.region, "offset": self.offset, "generation": self.generation,
                           "nbytes": self.nbytes, "layout": self.layout, "nixl": self.nixl}).encode()  # fmt: skip

    @classmethod
    def from_bytes(cls, data: bytes) -> "EmbeddingSource":
        """ValueError when data is not one (data from the network: checked, never trusted)."""
        try:
            d = json.loads(data)
            source = cls(str(d["region"]), int(d["offset"]), int(d["generation"]), int(d["nbytes"]), str(d["layout"]),
                         str(d.get("nixl", "")))  # fmt: skip
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"unreadable embedding source: {exc}") from None
        if source.offset < 0 or source.nbytes < 0 or source.generation <= 0:
            raise ValueError("an embedding source out of range")
        return source


class EmbeddingArena:
    """The vision instance's side: a ring of embeddings in shared memory. Only the
    service's event loop (or one thread at a time) writes it."""

    def __init__(self, nbytes: int, share_dir: str = "") -> None:
        """OSError when /dev/shm cannot hold it (the instance then offers kvcache only).
        share_dir: where readers in other PID namespaces ask for it ("": not offered there)."""
        self._allocator = SharedMemoryAllocator(share_dir=share_dir)
        self.data = self._allocator((nbytes,), torch.uint8)
        self.region = describe([self.data], self._allocator, LAYOUT).decode()
        self._next = 0
        self._generation = 0
        self._entries: dict[bytes, EmbeddingSource] = {}
        self.nixl = ""
        """How readers reach the arena through NIXL, once it is registered there
        (shared/stage/embedding_nixl.py's offer_arena); every entry's source says it."""

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def address(self) -> int:
        return self.data.data_ptr()

    def get(self, key: bytes) -> EmbeddingSource | None:
        """Where key's embeddings lie, while the ring has not come round to them."""
        return self._entries.get(key)

    def put(self, key: bytes, layout: str, data: bytes) -> EmbeddingSource | None:
        """Where key's embeddings now lie (already there: the same entry); None when they
        do not fit the arena at all."""
        held = self._entries.get(key)
        if held is not None and held.layout == layout:
            return held
        size = HEADER.size + len(data)
        if len(key) != 32 or size > self.nbytes:
            return None
        offset = self._next if self._next + size <= self.nbytes else 0
        end = offset + size
        # Entries the new one overwrites are gone: their readers' checks fail from here on.
        for k, s in list(self._entries.items()):
            if s.offset < end and offset < s.offset + HEADER.size + s.nbytes:
                del self._entries[k]
        self._generation += 1
        view = self.data.numpy()
        view[offset : offset + HEADER.size] = 0  # generation 0 first: "being written"
        view[offset + HEADER.size : end] = memoryview(data)
        view[offset : offset + HEADER.size] = memoryview(HEADER.pack(key, self._generation, len(data)))
        self._next = (end + ALIGN - 1) // ALIGN * ALIGN
        source = EmbeddingSource(self.region, offset, self._generation, len(data), layout, self.nixl)
        self._entries[key] = source
        return source

    def close(self) -> None:
        self._entries.clear()
        self._allocator.close()


def check_entry(key: bytes, source: EmbeddingSource, header: bytes, after: bool) -> None:
    """The seqlock's check, on an entry's header read before the copy of its bytes or
    (after) once the copy is done: ValueError unless it still names key's generation."""
    if HEADER.unpack(header) != (key, source.generation, source.nbytes):
        if after:
            raise ValueError("the image's entry was overwritten during the copy")
        raise ValueError("the vision instance's arena no longer holds the image (overwritten)")


class ArenaReader:
    """The prefill (and decode) side: arenas mapped once per description, read with checks."""

    def __init__(self) -> None:
        self._mapped: OrderedDict[str, torch.Tensor] = OrderedDict()

    def read(self, key: bytes, source: EmbeddingSource) -> tuple[str, bytes]:
        """(layout, data) of key's embeddings, as kvcache's blob would be; ValueError when
        the arena cannot be mapped here or no longer holds them."""
        arena = self._map(source.region)
        start, end = source.offset, source.offset + HEADER.size + source.nbytes
        if end > arena.numel():
            raise ValueError("the embedding source lies past the arena's end")
        view = arena.numpy()
        check_entry(key, source, view[start : start + HEADER.size].tobytes(), after=False)
        data = view[start + HEADER.size : end].tobytes()
        check_entry(key, source, view[start : start + HEADER.size].tobytes(), after=True)
        return source.layout, data

    def _map(self, region: str) -> torch.Tensor:
        arena = self._mapped.get(region)
        if arena is not None:
            self._mapped.move_to_end(region)
            return arena
        layout, tensors = open_peer(region.encode(), torch.device("cpu"))
        if layout != LAYOUT or len(tensors) != 1 or tensors[0].dtype != torch.uint8 or tensors[0].dim() != 1:
            raise ValueError(f"not an embedding arena: {layout!r}")
        self._mapped[region] = tensors[0]
        while len(self._mapped) > MAX_MAPPED:
            self._mapped.popitem(last=False)
        return tensors[0]
