"""The engine's side of its KV connector: which blocks a load or a save moves,
and who holds them meanwhile. It runs on the engine thread, between steps; the
bytes move on the connector's thread, straight into or out of the cache.

Loads: the scheduler reserved blocks for what the source holds; they are
handed to the connector with the chain hashes they must receive. When `poll`
reports the load, the blocks that arrived enter the prefix index and the
scheduler puts the request back in the queue. A request aborted meanwhile
keeps its reservation until the load reports, so a late write never lands in
a block somebody else was given.

Saves: a finished request's prompt blocks (those the source lacks) are
referenced before the next schedule can hand them out and handed to the
connector; the references go when the save reports.
"""

import logging
from dataclasses import dataclass

from shared.engine.kv.block_pool import KVBlock
from shared.engine.kv.connector import KVConnector
from shared.engine.kv.coordinator import KVCacheCoordinator
from shared.engine.request import Request
from shared.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SaveDone:
    request_id: str
    num_blocks: int
    error: str | None


class KVTransfer:
    def __init__(self, connector: KVConnector, scheduler: Scheduler, kv: KVCacheCoordinator) -> None:
        self.connector = connector
        self.scheduler = scheduler
        self.kv = kv
        self._loads: dict[str, tuple[Request, int, int]] = {}
        """Loads in flight: request, first block, number of blocks."""
        self._saves: dict[str, list[KVBlock]] = {}
        """Saves in flight: the blocks referenced until the connector has read them."""
        self.num_loaded_blocks = 0

    @property
    def busy(self) -> bool:
        """Whether anything is on its way (the step loop keeps polling)."""
        return bool(self._loads) or bool(self._saves) or self.connector.num_pending > 0

    def start_loads(self) -> None:
        """Ask the connector for the blocks the last schedule reserved."""
        for request, first, num in self.scheduler.loads_to_start:
            rid = request.request_id
            self._loads[rid] = (request, first, num)
            hashes = request.block_hashes[first : first + num]
            self.connector.start_load(rid, hashes, self.kv.reserved_block_ids(rid), request.trace_carrier)
        self.scheduler.loads_to_start = []

    def poll(self) -> list[SaveDone]:
        """Apply finished loads, release finished saves' blocks; return the finished saves."""
        loads, saves = self.connector.poll()
        for result in loads:
            entry = self._loads.pop(result.request_id, None)
            if entry is None:
                continue
            request, first, num = entry
            if result.request_id not in self.scheduler.loading:
                self.kv.release_reserved(result.request_id)  # aborted meanwhile: only now are its blocks free
                continue
            if result.error is not None:
                log.warning("KV load of %s failed (%s): recomputing", result.request_id, result.error)
            arrived = min(result.num_blocks, num)
            if arrived:
                self.kv.index_loaded(request, first, arrived)
                self.num_loaded_blocks += arrived
            self.scheduler.finish_load(result.request_id, arrived, num)
        done: list[SaveDone] = []
        for result in saves:
            blocks = self._saves.pop(result.request_id, None)
            if blocks is not None:
                self.kv.pool.free(blocks[::-1])
            done.append(SaveDone(result.request_id, result.num_blocks, result.error))
        return done

    def start_saves(self) -> list[str]:
        """Hand the connector the prompt blocks of requests that just finished with a
        save; returns their ids (their last output waits for the save)."""
        started: list[str] = []
        for request in self.scheduler.kv_saves:
            first, blocks = self._prompt_blocks(request)
            hashes = request.block_hashes[first : first + len(blocks[0]) if blocks else first]
            ids = {g: [b.block_id for b in group] for g, group in zip(self.kv.layout.persistent_groups, blocks)}
            held = [b for group in blocks for b in group]
            self.kv.pool.touch(held)  # freed with the request: referenced until the connector has read them
            self._saves[request.request_id] = held
            self.connector.start_save(request.request_id, hashes, ids, request.trace_carrier)
            started.append(request.request_id)
        self.scheduler.kv_saves = []
        return started

    def _prompt_blocks(self, request: Request) -> tuple[int, list[list[KVBlock]]]:
        """The finished request's full prompt blocks the source lacks, per persistent
        group. They were just freed but keep their content until the next schedule."""
        first = request.num_external_blocks
        num = request.num_prompt_tokens // self.kv.block_size - first
        while num > 0:
            blocks = self.kv.persistent_blocks(request, first, num)
            if blocks is not None:
                return first, blocks
            num -= 1  # a block left the index (never computed here): save the run before it
        return first, [[] for _ in self.kv.layout.persistent_groups]
