"""One interface for every outside source and sink of KV, owned by the engine.

The kvcache service (gRPC + LMDB) is one implementation
(shared/stage/kvcache_connector.py) and a store in this process's memory
another (memory_connector.py); a host-memory tier or a peer's GPU memory
(direct prefill -> decode transfer) will be more, each a new file behind this
interface. The engine drives it, never a service:

- at admission the scheduler asks how many leading blocks of a request's chain
  the source holds (`lookup`: answered without blocking, None while the answer
  is on its way; the request then waits without holding up the others);
- blocks for the part the source holds are reserved in the pool before
  anything is fetched, so nothing can evict them, and the request waits in its
  own state (WAITING_FOR_KV) while the connector fetches on its own thread
  (`start_load`);
- `poll`, called by the step loop between steps, reports finished loads and
  saves. The engine copies loaded bytes into the reserved blocks on its own
  thread; a failed or short load frees what did not arrive and the request
  recomputes it, visibly (a counter, and a flag on the request's output),
  never silently and never a hang.

Payloads are one block's bytes of the persistent KV groups
(ModelRunner.block_layout); sliding-window KV never goes through a connector.
No torch here.
"""

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

from shared.kv.block_hash import BlockHash

TraceCarrier = Mapping[str, str]
"""W3C trace headers of the request a call is for, so its spans join the request's trace."""


@dataclass(slots=True)
class LoadResult:
    request_id: str
    payloads: list[bytes]
    """The leading blocks asked for that arrived, in order (fewer than asked on a miss)."""
    error: str | None = None


@dataclass(slots=True)
class SaveResult:
    request_id: str
    num_blocks: int
    error: str | None = None


class KVConnector(ABC):
    @abstractmethod
    def lookup(
        self, request_id: str, hashes: list[BlockHash], layout: str, trace: TraceCarrier | None = None
    ) -> int | None:
        """How many leading blocks of `hashes` the source holds (in `layout`); None
        while the answer is not in yet (the scheduler asks again next step). Never blocks."""

    @abstractmethod
    def start_load(self, request_id: str, hashes: list[BlockHash], layout: str, trace: TraceCarrier | None = None) -> None:
        """Fetch these blocks' payloads in `layout` in the background; `poll` reports them."""

    @abstractmethod
    def start_save(
        self, request_id: str, blocks: list[tuple[BlockHash, bytes]], layout: str, trace: TraceCarrier | None = None
    ) -> None:
        """Store these blocks in the background; `poll` reports when they are stored."""

    @abstractmethod
    def poll(self) -> tuple[list[LoadResult], list[SaveResult]]:
        """Loads and saves finished since the last call. Never blocks."""

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """The request ended: drop whatever is pending for it (its results are discarded)."""

    @property
    @abstractmethod
    def num_pending(self) -> int:
        """Lookups, loads and saves in flight."""

    def close(self) -> None:
        """Stop the background work."""
