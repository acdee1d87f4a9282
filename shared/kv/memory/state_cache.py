"""The host-memory state cache of sliding-window KV (DeepSeek's short-lived SWA cache).

Sliding-window KV is never persisted. When a request ends, the worker keeps the
sliding-window blocks that a query at its last full block boundary would see,
in host memory, keyed by the chain hash of that block: a conversation that
continues on the same worker resumes with no replay at all. Entries are bounded
by a byte capacity (least recently used go first) and expire after a TTL of
minutes. The payload is whatever the model runner saved (a host tensor); this
module only keeps the books. No torch here.
"""

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from shared.kv.block_hash import BlockHash


@dataclass(slots=True)
class SlidingState:
    num_blocks: int
    """The request's full blocks the state follows (the state resumes at num_blocks * block_size)."""
    first_block: int
    """Index of the first saved block: blocks first_block .. num_blocks - 1 of each sliding group."""
    payload: object
    """The saved KV of those blocks for every sliding group, as the runner wrote it."""
    nbytes: int
    expires_at: float = 0.0


class SlidingStateCache:
    def __init__(self, capacity_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity_bytes < 0 or ttl_s <= 0:
            raise ValueError(f"state cache needs capacity_bytes >= 0 and ttl_s > 0, got {capacity_bytes}, {ttl_s}")
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[BlockHash, SlidingState] = OrderedDict()
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, block_hash: BlockHash, state: SlidingState) -> None:
        """Keep a state; entries beyond the capacity go, least recently used first.
        A state larger than the whole capacity is not kept."""
        if state.nbytes > self.capacity_bytes:
            return
        self._drop(block_hash)
        state.expires_at = self._clock() + self.ttl_s
        self._entries[block_hash] = state
        self.num_bytes += state.nbytes
        while self.num_bytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))

    def get(self, block_hash: BlockHash) -> SlidingState | None:
        self._expire()
        state = self._entries.get(block_hash)
        if state is None:
            self.num_misses += 1
            return None
        self._entries.move_to_end(block_hash)
        self.num_hits += 1
        return state

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether get() would find it (counts nothing, reorders nothing)."""
        state = self._entries.get(block_hash)
        return state is not None and state.expires_at > self._clock()

    def clear(self) -> None:
        """Forget every state (a prefix-cache reset)."""
        for block_hash in list(self._entries):
            self._drop(block_hash)

    def _expire(self) -> None:
        now = self._clock()
        # Entries are in use order, not expiry order: a full scan, but states are few and large.
        for block_hash in [h for h, s in self._entries.items() if s.expires_at <= now]:
            self._drop(block_hash)

    def _drop(self, block_hash: BlockHash) -> None:
        state = self._entries.pop(block_hash, None)
        if state is not None:
            self.num_bytes -= state.nbytes
