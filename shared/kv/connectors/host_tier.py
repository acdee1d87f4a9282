"""The host tier: a connector that keeps saved blocks in host memory (pinned on a
GPU machine, so they come back at PCIe speed) in front of a slower connector
(kvcache). A prefix evicted from the device cache is found here first.

Loads take the leading blocks this tier holds and ask the connector behind for
the rest; saves land here and go on behind. The memory is one pool of
block-sized slots allocated (and pinned) once, at the byte capacity: least
recently used blocks give their slots up. Copies run on the tier's own thread,
one gather (or scatter) on the device and one copy per run of consecutive
slots: the step thread never copies KV, and no copy allocates host memory. The
save's blocks stay referenced by the engine until both this tier and the
connector behind have read them (and, for a save the request waits for, until
the connector behind has stored them).
"""

import concurrent.futures
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from shared.kv.block_hash import BlockHash
from shared.kv.connectors.base import BlockIds, InFrontConnector, KVConnector, LoadResult, SaveResult, TraceCarrier
from shared.kv.memory.region import KVRegion
from shared.kv.transfer import KVTransferParams, persistent_ids


@dataclass(slots=True)
class _Load:
    host: "concurrent.futures.Future[int]"
    """The copy of the leading blocks this tier holds."""
    num_here: int
    """How many the lookup found here."""
    asks_behind: bool
    """The connector behind was asked for the rest."""
    behind: LoadResult | None = None
    """What the connector behind reported for the rest."""


class HostTierConnector(InFrontConnector):
    def __init__(self, behind: KVConnector, capacity_bytes: int) -> None:
        super().__init__(behind)
        self.capacity_bytes = capacity_bytes
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()
        """The blocks held, least recently used first, and the pool row of each."""
        self._free: list[int] = []
        self._pool = torch.empty(0, dtype=torch.uint8)
        """[slots, block_bytes], made when the engine registers its cache."""
        self._lock = threading.Lock()  # the index, between the engine thread and the copy thread
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-host-tier")
        self._loads: dict[str, _Load] = {}
        self._saves: dict[str, concurrent.futures.Future[None]] = {}
        self._behind_saves: dict[str, SaveResult] = {}
        self.num_hit_blocks = 0

    def register_kv_region(self, region: KVRegion) -> None:
        super().register_kv_region(region)
        # A model with no persistent group (every layer sliding) stores no blocks: no slots
        # (a 1-byte block made a billion of them, 10 GB of free list).
        num_slots = self.capacity_bytes // region.block_bytes if region.block_bytes > 0 else 0
        # Pinned where the cache is on a GPU: copies to and from it run asynchronously at PCIe speed.
        pin = region.device.type == "cuda"
        self._pool = torch.empty((num_slots, region.block_bytes), dtype=torch.uint8, pin_memory=pin)
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_bytes(self) -> int:
        return len(self._slots) * self.region.block_bytes

    def _leading(self, hashes: list[BlockHash]) -> int:
        with self._lock:
            return self._leading_locked(hashes)

    def lookup(
        self, request_id: str, hashes: list[BlockHash], params: KVTransferParams, trace: TraceCarrier | None = None
    ) -> int | None:
        here = self._leading(hashes)
        if here == len(hashes):
            self.behind.forget(request_id)  # a lookup behind may be pending from an earlier step
            return here
        behind = self.behind.lookup(request_id, hashes, params, trace)
        return None if behind is None else max(here, behind)

    def start_load(
        self,
        request_id: str,
        first_block: int,
        hashes: list[BlockHash],
        block_ids: BlockIds,
        params: KVTransferParams,
        trace: TraceCarrier | None = None,
    ) -> None:
        block_ids = persistent_ids(block_ids, self.region.persistent_groups)  # a store keeps no window
        n = self._leading(hashes)
        future = self._executor.submit(self._write, hashes[:n], {g: ids[:n] for g, ids in block_ids.items()})
        self._loads[request_id] = _Load(future, n, asks_behind=n < len(hashes))
        if n < len(hashes):
            rest = {g: ids[n:] for g, ids in block_ids.items()}
            self.behind.start_load(request_id, first_block + n, hashes[n:], rest, params, trace)

    def _leading_locked(self, hashes: list[BlockHash]) -> int:
        return next((i for i, h in enumerate(hashes) if h not in self._slots), len(hashes))

    def _write(self, hashes: list[BlockHash], block_ids: BlockIds) -> int:
        """On the tier's thread: the leading blocks still held (a save run since the
        lookup may have taken some slots) into the engine's blocks."""
        with self._lock:
            rows = [self._slots[h] for h in hashes[: self._leading_locked(hashes)]]
            for h in hashes[: len(rows)]:
                self._slots.move_to_end(h)
        if rows:
            self.region.copy_in({g: ids[: len(rows)] for g, ids in block_ids.items()}, self._pool, rows)
        return len(rows)

    def start_save(
        self,
        request_id: str,
        hashes: list[BlockHash],
        block_ids: BlockIds,
        params: KVTransferParams,
        trace: TraceCarrier | None = None,
    ) -> None:
        self._saves[request_id] = self._executor.submit(self._keep, hashes, block_ids)
        self.behind.start_save(request_id, hashes, block_ids, params, trace)

    def _keep(self, hashes: list[BlockHash], block_ids: BlockIds) -> None:
        """On the tier's thread: copy the blocks not held yet into slots, free ones first,
        then those of the least recently used blocks."""
        with self._lock:
            new = [i for i, h in enumerate(hashes) if h not in self._slots]
            for h in hashes:
                if h in self._slots:
                    self._slots.move_to_end(h)
            new = new[-len(self._pool) :] if len(self._pool) else []  # more than fit: keep the last
            rows = []
            for i in new:
                if self._free:
                    rows.append(self._free.pop())
                else:
                    rows.append(self._slots.popitem(last=False)[1])
        if not rows:
            return
        self.region.copy_out({g: [ids[i] for i in new] for g, ids in block_ids.items()}, self._pool, rows)
        with self._lock:  # indexed only once the copy is done: a lookup never finds a half-copied block
            for i, row in zip(new, rows):
                self._slots[hashes[i]] = row

    def drop_cached(self) -> int:
        """Every slot freed, on the tier's thread (after the copies queued before it, so
        no copy is left reading or writing a slot given up); then the links behind."""
        return self._executor.submit(self._drop).result() + self.behind.drop_cached()

    def _drop(self) -> int:
        with self._lock:
            num = len(self._slots)
            self._free += self._slots.values()
            self._slots.clear()
        return num

    def poll(self) -> tuple[list[LoadResult], list[SaveResult]]:
        behind_loads, behind_saves = self.behind.poll()
        for result in behind_loads:
            self._loads[result.request_id].behind = result
        loads: list[LoadResult] = []
        for request_id, load in list(self._loads.items()):
            if load.host.done() and (not load.asks_behind or load.behind is not None):
                del self._loads[request_id]
                loads.append(self._combined(request_id, load))
        for result in behind_saves:
            self._behind_saves[result.request_id] = result
        saves: list[SaveResult] = []
        for request_id, result in list(self._behind_saves.items()):
            if self._saves[request_id].done():  # both have read the blocks
                del self._saves[request_id], self._behind_saves[request_id]
                saves.append(result)
        return loads, saves

    def _combined(self, request_id: str, load: _Load) -> LoadResult:
        try:
            here = load.host.result()
        except Exception as exc:
            return LoadResult(request_id, 0, f"host tier: {type(exc).__name__}: {exc}", path="host")
        self.num_hit_blocks += here
        if load.behind is None or here < load.num_here:
            # Short here (slots taken since the lookup): what behind wrote does not follow on.
            return LoadResult(request_id, here, path="host")
        # This tier wrote the leading blocks; what behind wrote follows them.
        behind = load.behind
        path = f"host+{behind.path}" if here and behind.num_blocks else ("host" if here else behind.path)
        return LoadResult(request_id, here + behind.num_blocks, behind.error, path, behind.copy_seconds, behind.plane)

    @property
    def num_pending(self) -> int:
        return len(self._loads) + len(self._saves) + self.behind.num_pending

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        super().close()
