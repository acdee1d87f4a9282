"""One interface for every outside source and sink of KV, owned by the engine.

Every implementation is one file beside this one: a store in this process's
memory (memory.py), the kvcache service over gRPC + LMDB (kvcache.py), a
host-memory tier in front of it (host_tier.py) and a direct copy out of a
peer's GPU memory in front of both (peer.py); chain.py puts them in order. A
new tier or transport is a new file behind this interface. The engine drives
it, never a service (its side is shared/engine/kv_transfer.py):

- at admission the scheduler asks how many leading blocks of a request's chain
  the source holds (`lookup`: answered without blocking, None while the answer
  is on its way; the request then waits without holding up the others);
- blocks for the part the source holds are reserved in the pool before
  anything is fetched, so nothing can evict them, and the request waits in its
  own state (WAITING_FOR_KV) while the connector fetches on its own thread and
  writes straight into those blocks (`start_load`; the engine registered its
  cache as a `KVRegion` at start, so no copy runs on the step thread);
- a save names blocks the engine holds a reference on until the connector
  reports it, so a block is never reused while it is being read; a save the
  request waits for is reported once stored, one written behind as soon as its
  blocks have been read (the store then runs on from host memory, bounded, and
  what it drops or fails to store is counted by the connector);
- `poll`, called by the step loop between steps, reports finished loads and
  saves; a failed or short load frees what did not arrive and the request
  recomputes it, visibly (a counter, and a flag on the request's output),
  never silently and never a hang.

A block's payload is the persistent KV groups' bytes of one block
(KVRegion.layout); a store never holds sliding-window KV. Only a direct copy out
of a peer's cache moves it: the window a query at the held boundary sees, so the
request resumes without replaying it (shared/kv/transfer.py copy_plan).
No torch here: the region (shared/kv/memory/region.py, which holds the
tensors) is named for the type checker only.
"""

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.kv.block_hash import BlockHash
from shared.kv.transfer import KVTransferParams

if TYPE_CHECKING:  # the engine's paged cache; importing it here would load torch
    from shared.kv.memory.region import KVRegion

TraceCarrier = Mapping[str, str]
"""W3C trace headers of the request a call is for, so its spans join the request's trace."""


BlockIds = dict[int, list[int]]
"""Per KV group, block ids of the engine's cache: each persistent group's (the same count
in each) and, in a load for a peer source that holds the sliding window
(PeerSource.window), each sliding group's reserved window blocks too. copy_plan says which
goes where; a store writes the persistent groups' only (persistent_ids)."""


@dataclass(slots=True)
class LoadResult:
    request_id: str
    num_blocks: int
    """The leading blocks asked for that arrived and were written (fewer than asked on a miss)."""
    error: str | None = None
    path: str = "kvcache"
    """Where the blocks came from (the request span's kv.path): "peer" (a copy out of a
    peer's cache mapped into this process), "nixl" (read from a peer's cache through
    NIXL), "host" (the host tier), "kvcache" (the store), "memory" (an in-process store);
    "host+kvcache" when the host tier served the head and the store the rest."""
    copy_seconds: float = 0.0
    """A direct copy's own time, from its start to its end on the copy thread: without
    the wait for that thread or for the engine's next step (with num_blocks, the copy's
    bandwidth). 0 for other loads."""
    plane: str = ""
    """For a load from the kvcache service, how its bytes came (the span's
    kv.kvcache_plane): "shm" (the shared-memory segment), "nixl" (written into the
    client's landing buffer through NIXL), "stream" (the gRPC byte stream), planes
    joined by "+" when a load used several (a refused plane's rest came by stream);
    "" for other loads, or when nothing arrived."""

    @property
    def direct(self) -> bool:
        """Copied straight from a peer's cache (rather than from a store)."""
        return self.path in DIRECT_PATHS


DIRECT_PATHS = frozenset({"peer", "nixl"})
"""Load paths that copy straight out of a peer's cache."""


@dataclass(slots=True)
class SaveResult:
    request_id: str
    num_blocks: int
    error: str | None = None


class KVConnector(ABC):
    region: "KVRegion"

    def register_kv_region(self, region: "KVRegion") -> None:
        """The engine's cache, once, before any load or save."""
        self.region = region

    def register_recompute_rate(self, tokens_per_s: float, block_size: int) -> None:
        """How fast the engine recomputes a prefix (prefill tokens per second, measured
        when it starts): a source slower than that may answer a lookup with fewer
        blocks than it holds. Nothing by default."""

    @abstractmethod
    def lookup(
        self, request_id: str, hashes: list[BlockHash], params: KVTransferParams, trace: TraceCarrier | None = None
    ) -> int | None:
        """How many leading blocks of `hashes` the source holds (in the region's layout);
        None while the answer is not in yet (the scheduler asks again next step). Never blocks."""

    @abstractmethod
    def start_load(
        self,
        request_id: str,
        first_block: int,
        hashes: list[BlockHash],
        block_ids: BlockIds,
        params: KVTransferParams,
        trace: TraceCarrier | None = None,
    ) -> None:
        """In the background, fetch the request's blocks first_block, first_block + 1, ...
        (chain hashes `hashes`) and write them into `block_ids` of the registered region;
        `poll` reports how many arrived. For a peer source with a window, `block_ids` also
        has the sliding groups' window blocks: a direct copy writes them too (copy_plan)
        and reports the load `direct`; the engine indexes the window only when such a load
        arrived whole. Any other source ignores them."""

    @abstractmethod
    def start_save(
        self,
        request_id: str,
        hashes: list[BlockHash],
        block_ids: BlockIds,
        params: KVTransferParams,
        trace: TraceCarrier | None = None,
    ) -> None:
        """In the background, read `block_ids` of the region and store them under
        `hashes`. `poll` reports the save when they are stored if
        params.wait_for_save, else as soon as they have been read (written behind)."""

    @abstractmethod
    def poll(self) -> tuple[list[LoadResult], list[SaveResult]]:
        """Loads and saves finished since the last call. Never blocks."""

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """The request ended: drop its pending lookup. A load or save under way still
        reports in `poll` (the engine holds its blocks until then)."""

    @property
    @abstractmethod
    def num_pending(self) -> int:
        """Lookups, loads and saves in flight."""

    @property
    def num_saves_dropped(self) -> int:
        """Saves written behind that were dropped (too many bytes on their way) after
        their blocks had been reported read."""
        return 0

    @property
    def num_save_failures_behind(self) -> int:
        """Saves written behind that failed to store after they had been reported."""
        return 0

    def take_released(self) -> list[str]:
        """Requests whose held blocks a peer has finished reading since the last call
        (a NIXL read's notification): their leases may end. None by default."""
        return []

    def drop_cached(self) -> int:
        """Forget the blocks this process keeps for reuse (a prefix-cache reset), those
        of a store behind it kept (kvcache is another process: a restart keeps it);
        returns how many. Nothing by default."""
        return 0

    def close(self) -> None:
        """Stop the background work."""


class InFrontConnector(KVConnector):
    """A connector in front of another (the host tier before kvcache, the direct peer
    path before both): what it does not serve goes to the one behind. The region, a
    forgotten request, the counters of saves written behind and closing pass through."""

    def __init__(self, behind: KVConnector) -> None:
        self.behind = behind

    def register_kv_region(self, region: "KVRegion") -> None:
        super().register_kv_region(region)
        self.behind.register_kv_region(region)

    def register_recompute_rate(self, tokens_per_s: float, block_size: int) -> None:
        self.behind.register_recompute_rate(tokens_per_s, block_size)

    def forget(self, request_id: str) -> None:
        self.behind.forget(request_id)

    def take_released(self) -> list[str]:
        return self.behind.take_released()

    @property
    def num_saves_dropped(self) -> int:
        return self.behind.num_saves_dropped

    @property
    def num_save_failures_behind(self) -> int:
        return self.behind.num_save_failures_behind

    def drop_cached(self) -> int:
        return self.behind.drop_cached()

    def close(self) -> None:
        self.behind.close()
