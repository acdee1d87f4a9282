"""The engine's side of its KV connector: bytes between the connector and the
paged cache, on the engine thread, between steps.

The scheduler decides what to load (reserving blocks first) and which finished
requests to save; this moves the bytes. Loads: the connector fetches on its own
thread; when `poll` reports a load, its payloads are checked (one block of this
runner's layout each) and copied into the reserved blocks, which then enter the
prefix index, and the scheduler puts the request back in the queue. Saves: a
finished request's prompt blocks are read from the cache before the next
schedule can hand them out, and given to the connector. Nothing here waits for
the network.
"""

import logging
from dataclasses import dataclass

from shared.engine.kv.connector import KVConnector
from shared.engine.kv.coordinator import KVCacheCoordinator
from shared.engine.model_runner import ModelRunner
from shared.engine.request import Request
from shared.engine.scheduler import Scheduler
from shared.kv.block_hash import BlockHash

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SaveDone:
    request_id: str
    num_blocks: int
    error: str | None


class KVTransfer:
    def __init__(self, connector: KVConnector, scheduler: Scheduler, kv: KVCacheCoordinator, runner: ModelRunner) -> None:
        self.connector = connector
        self.scheduler = scheduler
        self.kv = kv
        self.runner = runner
        self.layout = runner.block_layout
        self.block_bytes = runner.persistent_block_bytes
        self._loads: dict[str, tuple[Request, int, int]] = {}
        """Loads in flight: request, first block, number of blocks."""
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0
        self.num_save_failures = 0

    @property
    def busy(self) -> bool:
        """Whether anything is on its way (the step loop keeps polling)."""
        return bool(self._loads) or self.connector.num_pending > 0

    def start_loads(self) -> None:
        """Ask the connector for the blocks the last schedule reserved."""
        for request, first, num in self.scheduler.loads_to_start:
            self._loads[request.request_id] = (request, first, num)
            hashes = request.block_hashes[first : first + num]
            self.connector.start_load(request.request_id, hashes, self.layout, request.trace_carrier)
        self.scheduler.loads_to_start = []

    def poll(self) -> list[SaveDone]:
        """Apply finished loads; return finished saves."""
        loads, saves = self.connector.poll()
        for result in loads:
            entry = self._loads.pop(result.request_id, None)
            if entry is None or result.request_id not in self.scheduler.loading:
                continue  # aborted meanwhile: its reservation is gone already
            request, first, num = entry
            if result.error is not None:
                log.warning("KV load of %s failed (%s): recomputing", request.request_id, result.error)
            good = 0
            for payload in result.payloads[:num]:
                if len(payload) != self.block_bytes:
                    log.warning("KV load of %s: a block of %d bytes, not %d", request.request_id, len(payload), self.block_bytes)
                    break
                good += 1
            if good:
                reserved = self.kv.reserved_block_ids(request.request_id)
                self.runner.write_blocks({g: ids[:good] for g, ids in reserved.items()}, result.payloads[:good])
                self.kv.index_loaded(request, first, good)
                self.num_loaded_blocks += good
            self.scheduler.finish_load(request.request_id, good, num)
        return [SaveDone(r.request_id, r.num_blocks, r.error) for r in saves]

    def forget(self, request_id: str) -> None:
        self._loads.pop(request_id, None)

    def start_saves(self) -> list[str]:
        """Give the connector the prompt blocks of requests that just finished with a
        save; returns their ids (their last output waits for the save)."""
        started: list[str] = []
        for request in self.scheduler.kv_saves:
            blocks = self._prompt_blocks(request)
            self.connector.start_save(request.request_id, blocks, self.layout, request.trace_carrier)
            started.append(request.request_id)
        self.scheduler.kv_saves = []
        return started

    def _prompt_blocks(self, request: Request) -> list[tuple[BlockHash, bytes]]:
        """The finished request's full prompt blocks the source lacks, as payloads. Its
        blocks were just freed but keep their content until the next schedule."""
        first = request.num_external_blocks
        num = request.num_prompt_tokens // self.kv.block_size - first
        while num > 0:
            ids = self.kv.persistent_block_ids(request, first, num)
            if ids is not None:
                return list(zip(request.block_hashes[first : first + num], self.runner.read_blocks(ids)))
            num -= 1  # a block left the index (never computed here): save the run before it
        return []
