"""Image embeddings read out of a vision instance's arena through NIXL (E/P/D): the
path between containers, pods and nodes, where the arena cannot be mapped
(shared/stage/embedding_share.py's direct copy: another PID namespace without a
shared kv_share_dir, another host). KV takes the same path (shared/kv/connectors/nixl.py),
with the same pieces: the process's one NIXL agent (shared/kv/wire/nixl.py), the
agent's metadata asked for over NATS once per instance (`subjects.kv_nixl`, answered
by the vision instance as prefill answers it for KV), a page-aligned buffer
registered here that the bytes land in (shared/kv/wire/nixl_plane.py's LandingBuffer).

The vision instance registers its whole arena with its agent (`offer_arena`) and
gives readers metadata of the arena alone: NIXL refuses a descriptor outside it. A
reader READs the entry (header and bytes) in one transfer, then the header again in
a second: the seqlock of embedding_share.py, with "before" and "after" each a read.
A header that does not name the image and generation the source says, a transfer
that fails or times out, metadata that does not come: a ValueError, and the caller
fetches the image from kvcache. No lease and no notification: the ring's generation
is what tells a raced copy, as for the direct copy."""

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shared.kv.wire.nixl import MemoryRegion, NixlAgent, NixlTransferError, Registration
from shared.kv.wire.nixl_plane import MAX_METADATA_BYTES, MIN_TARGET_BYTES, LandingBuffer, valid_agent_name
from shared.runtime.subjects import check_token
from shared.stage.embedding_share import HEADER, EmbeddingArena, EmbeddingSource, check_entry

log = logging.getLogger(__name__)

MAX_ARENA_BYTES = 1 << 40


def offer_arena(arena: EmbeddingArena, agent: NixlAgent, instance_id: str) -> Registration:
    """Register the arena with the vision instance's agent; from here on each entry's
    source says how to read it through NIXL. The registration is what the instance
    describes to a reader that asks for its metadata (`agent.metadata(only=...)`)."""
    registration = agent.register([MemoryRegion(arena.address, arena.nbytes, 0)], "DRAM")
    arena.nixl = json.dumps({"instance": instance_id, "agent": agent.name, "address": arena.address,
                             "nbytes": arena.nbytes})  # fmt: skip
    return registration


@dataclass(frozen=True, slots=True)
class ArenaRoute:
    """Where an arena lies, as a source's `nixl` says (from the network: checked)."""

    instance: str
    """The vision instance: whom the metadata is asked of."""
    agent: str
    address: int
    nbytes: int

    @classmethod
    def parse(cls, text: str) -> "ArenaRoute":
        """ValueError unless text describes an arena within bounds."""
        try:
            d = json.loads(text)
            route = cls(check_token(str(d["instance"])), str(d["agent"]), int(d["address"]), int(d["nbytes"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"unreadable NIXL arena description: {exc}") from None
        if not valid_agent_name(route.agent):
            raise ValueError(f"NIXL agent name {route.agent[:80]!r} out of bounds")
        if not 0 < route.nbytes <= MAX_ARENA_BYTES or not 0 < route.address < (1 << 64) - route.nbytes:
            raise ValueError("a NIXL arena out of range")
        return route


class NixlArenaReader:
    """The prefill (and decode) side: entries READ through the process's agent into a
    landing buffer of its own, one read at a time (a few per request, off the event loop)."""

    def __init__(self, agent: NixlAgent, fetch_metadata: Callable[[str], bytes], timeout_s: float) -> None:
        """fetch_metadata(instance_id): that instance's agent metadata (over NATS; raises
        when it does not answer), called from the reading thread. timeout_s: a transfer
        not done within it is abandoned (the image comes from kvcache)."""
        self.agent = agent
        self._fetch = fetch_metadata
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._buffer: LandingBuffer | None = None
        self.num_bytes_read = 0

    def read(self, key: bytes, source: EmbeddingSource) -> tuple[str, bytes]:
        """(layout, data) of key's embeddings, as kvcache's blob would be; ValueError when
        the arena cannot be reached or no longer holds them."""
        if not source.nixl:
            raise ValueError("the vision instance offers no NIXL path")
        route = ArenaRoute.parse(source.nixl)
        entry = HEADER.size + source.nbytes
        if source.offset + entry > route.nbytes:
            raise ValueError("the embedding source lies past the arena's end")
        try:
            self.agent.ensure_peer(route.agent, lambda: self._metadata(route.instance))
        except Exception as exc:  # no answer, none to give, a restarted instance: kvcache has them
            raise ValueError(f"no NIXL metadata from {route.instance}: {exc}") from None
        with self._lock:
            buffer = self._landing(entry + HEADER.size)
            # The entry at the buffer's start, the header read after it behind.
            at = route.address + source.offset
            local = np.array([[buffer.address, entry, 0], [buffer.address + entry, HEADER.size, 0]], dtype=np.uint64)
            remote = np.array([[at, entry, 0], [at, HEADER.size, 0]], dtype=np.uint64)
            try:
                for k in range(2):  # two transfers: the second starts once the first's bytes are here
                    self.num_bytes_read += self.agent.read(route.agent, local[k : k + 1], remote[k : k + 1], "DRAM",
                                                           "DRAM", b"", self._timeout_s)  # fmt: skip
            except NixlTransferError as exc:
                self.agent.forget_peer(route.agent)  # gone or restarted: its metadata is asked for anew
                self._retire()  # a late write of the abandoned transfer lands in memory nobody reads
                raise ValueError(f"the NIXL read from {route.instance} failed: {exc}") from None
            view = buffer.buffer
            check_entry(key, source, bytes(view[: HEADER.size]), after=False)
            check_entry(key, source, bytes(view[entry : entry + HEADER.size]), after=True)
            return source.layout, bytes(view[HEADER.size : entry])

    def _metadata(self, instance_id: str) -> bytes:
        metadata = self._fetch(instance_id)
        if not 0 < len(metadata) <= MAX_METADATA_BYTES:
            raise ValueError(f"agent metadata of {len(metadata)} bytes, not 1 to {MAX_METADATA_BYTES}")
        return metadata

    def _landing(self, size: int) -> LandingBuffer:
        """The buffer, grown to at least size (a power of two from MIN_TARGET_BYTES)."""
        if self._buffer is None or self._buffer.size < size:
            if self._buffer is not None:
                self._buffer.close(retired=False)
            self._buffer = None
            self._buffer = LandingBuffer(self.agent, max(MIN_TARGET_BYTES, 1 << (size - 1).bit_length()))
        return self._buffer

    def _retire(self) -> None:
        if self._buffer is not None:
            self._buffer.close(retired=True)
            self._buffer = None

    def close(self) -> None:
        with self._lock:
            if self._buffer is not None:
                self._buffer.close(retired=False)
                self._buffer = None
