"""A KV connector over a store in this process's memory: engines of one process
share blocks through it (offline tools, tests). It answers at the next `poll`,
as a remote store would, so the engine's waiting-for-KV path is the same.
No torch here."""

from shared.kv.block_hash import BlockHash
from shared.kv.connectors.base import BlockIds, KVConnector, LoadResult, SaveResult, TraceCarrier
from shared.kv.transfer import KVTransferParams, persistent_ids


class MemoryKVStore:
    """Blocks by (layout, chain hash); shared by the connectors of several engines."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[str, BlockHash], bytes] = {}


class MemoryConnector(KVConnector):
    def __init__(self, store: MemoryKVStore) -> None:
        self.store = store
        self._loads: list[LoadResult] = []
        self._saves: list[SaveResult] = []

    def lookup(
        self, request_id: str, hashes: list[BlockHash], params: KVTransferParams, trace: TraceCarrier | None = None
    ) -> int | None:
        layout = self.region.layout
        return next((i for i, h in enumerate(hashes) if (layout, h) not in self.store.blocks), len(hashes))

    def start_load(
        self,
        request_id: str,
        first_block: int,
        hashes: list[BlockHash],
        block_ids: BlockIds,
        params: KVTransferParams,
        trace: TraceCarrier | None = None,
    ) -> None:
        payloads: list[bytes] = []
        for h in hashes:
            data = self.store.blocks.get((self.region.layout, h))
            if data is None:
                break
            payloads.append(data)
        block_ids = persistent_ids(block_ids, self.region.persistent_groups)  # a store keeps no window
        self._loads.append(LoadResult(request_id, self.region.write_blocks(block_ids, payloads), path="memory"))

    def start_save(
        self,
        request_id: str,
        hashes: list[BlockHash],
        block_ids: BlockIds,
        params: KVTransferParams,
        trace: TraceCarrier | None = None,
    ) -> None:
        for h, data in zip(hashes, self.region.read_blocks(block_ids)):
            self.store.blocks[(self.region.layout, h)] = data
        self._saves.append(SaveResult(request_id, len(hashes)))

    def poll(self) -> tuple[list[LoadResult], list[SaveResult]]:
        loads, saves = self._loads, self._saves
        self._loads, self._saves = [], []
        return loads, saves

    def forget(self, request_id: str) -> None:
        """Lookups answer at once here: nothing is pending."""

    @property
    def num_pending(self) -> int:
        return len(self._loads) + len(self._saves)
