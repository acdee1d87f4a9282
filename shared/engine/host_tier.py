"""The host tier: a connector that keeps saved blocks in host memory (pinned on a
GPU machine, so they come back at PCIe speed) in front of a slower connector
(kvcache). A prefix evicted from the device cache is found here first.

Loads take the leading blocks this tier holds and ask the connector behind for
the rest; saves land here and go on behind. Bounded by a byte capacity, least
recently used first. Copies run on the tier's own thread: the step thread never
copies KV. The save's blocks stay referenced by the engine until both this tier
and the connector behind have read them (and, for a save the request waits for,
until the connector behind has stored them).
"""

import concurrent.futures
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from shared.engine.engine_request import KVTransferParams
from shared.engine.kv.connector import BlockIds, KVConnector, KVRegion, LoadResult, SaveResult, TraceCarrier
from shared.engine.kv_region import KVRegion as PagedKVRegion
from shared.kv.block_hash import BlockHash


@dataclass(slots=True)
class _Load:
    host: "concurrent.futures.Future[int]"
    """The copy of the leading blocks this tier holds."""
    asks_behind: bool
    behind: LoadResult | None = None
    """What the connector behind reported for the rest."""


class HostTierConnector(KVConnector):
    def __init__(self, behind: KVConnector, capacity_bytes: int) -> None:
        self.behind = behind
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()  # the index, between the engine thread and the copy thread
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-host-tier")
        self._loads: dict[str, _Load] = {}
        self._saves: dict[str, concurrent.futures.Future[None]] = {}
        self._behind_saves: dict[str, SaveResult] = {}
        self.num_hit_blocks = 0

    def register_kv_region(self, region: KVRegion) -> None:
        super().register_kv_region(region)
        self.behind.register_kv_region(region)

    @property
    def _pin(self) -> bool:
        """Pinned host memory where the cache is on a GPU (faster, asynchronous copies)."""
        return isinstance(self.region, PagedKVRegion) and self.region.device.type == "cuda"

    @property
    def num_bytes(self) -> int:
        return len(self._blocks) * self.region.block_bytes

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
        with self._lock:
            here = [self._blocks[h] for h in hashes[: self._leading_locked(hashes)]]
            for h in hashes[: len(here)]:
                self._blocks.move_to_end(h)
        n = len(here)
        future = self._executor.submit(self._write, {g: ids[:n] for g, ids in block_ids.items()}, here)
        self._loads[request_id] = _Load(future, asks_behind=n < len(hashes))
        if n < len(hashes):
            rest = {g: ids[n:] for g, ids in block_ids.items()}
            self.behind.start_load(request_id, first_block + n, hashes[n:], rest, params, trace)

    def _leading_locked(self, hashes: list[BlockHash]) -> int:
        return next((i for i, h in enumerate(hashes) if h not in self._blocks), len(hashes))

    def _write(self, block_ids: BlockIds, payloads: list[torch.Tensor]) -> int:
        if payloads:
            assert isinstance(self.region, PagedKVRegion)
            self.region.write_payloads(block_ids, torch.stack(payloads))
        return len(payloads)

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
        assert isinstance(self.region, PagedKVRegion)
        payloads = self.region.read_payloads(block_ids)
        if self._pin:
            payloads = payloads.pin_memory()
        capacity_blocks = self.capacity_bytes // max(self.region.block_bytes, 1)
        with self._lock:
            for h, data in zip(hashes, payloads):
                self._blocks[h] = data
                self._blocks.move_to_end(h)
            while len(self._blocks) > capacity_blocks:
                self._blocks.popitem(last=False)

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
            return LoadResult(request_id, 0, f"host tier: {type(exc).__name__}: {exc}")
        self.num_hit_blocks += here
        if load.behind is None:
            return LoadResult(request_id, here)
        # This tier wrote the leading blocks; what behind wrote follows them.
        return LoadResult(request_id, here + load.behind.num_blocks, load.behind.error, load.behind.direct)

    def forget(self, request_id: str) -> None:
        self.behind.forget(request_id)

    @property
    def num_pending(self) -> int:
        return len(self._loads) + len(self._saves) + self.behind.num_pending

    @property
    def num_saves_dropped(self) -> int:
        return self.behind.num_saves_dropped

    @property
    def num_save_failures_behind(self) -> int:
        return self.behind.num_save_failures_behind

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.behind.close()
