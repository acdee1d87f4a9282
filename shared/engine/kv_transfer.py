"""The engine's side of its KV connector: which blocks a load or a save moves,
and who holds them meanwhile. It runs on the engine thread, between steps; the
bytes move on the connector's thread, straight into or out of the cache.

Loads: the scheduler reserved blocks for what the source holds (and for the
sliding-window blocks a peer source holds); they are handed to the connector
with the chain hashes they must receive. When `poll` reports the load, the
blocks that arrived enter the prefix index, the window only when the whole
load was copied from the peer, and the scheduler puts the request back in the
queue. A request aborted meanwhile
keeps its reservation until the load reports, so a late write never lands in
a block somebody else was given.

Saves: a finished request's prompt blocks (those the source lacks) are
referenced before the next schedule can hand them out and handed to the
connector; the references go when the save reports. A save written behind
(nobody waits for it) is dropped, and counted, when too many are in flight.

Leases: a finished request that a peer will copy from keeps its prompt's
blocks referenced until the peer releases them or the lease runs out: the
persistent groups' and the sliding groups' window at the held boundary, so the
peer resumes with this engine's window rather than replaying it.
"""

import time

import logging

from shared.engine.outputs import RequestOutput
from shared.engine.request import Request
from shared.engine.scheduler import Scheduler
from shared.kv.connectors.base import KVConnector
from shared.kv.memory.block_pool import KVBlock
from shared.kv.memory.coordinator import KVCacheCoordinator
from shared.kv.transfer import HeldBlocks

log = logging.getLogger(__name__)


MAX_SAVES_BEHIND = 64
"""Saves written behind whose blocks the connector has yet to read; more are dropped
(counted). Once read, the connector bounds what is still on its way to the store."""


class KVTransfer:
    def __init__(
        self, connector: KVConnector, scheduler: Scheduler, kv: KVCacheCoordinator, lease_timeout_s: float,
        offsets: dict[int, int] | None = None,
    ) -> None:
        """offsets: per KV group, where this pool's block ids lie in the connector's region
        (a data-parallel rank's: shared/engine/dp_kv.py); None: they are the region's."""
        self.connector = connector
        self.scheduler = scheduler
        self.kv = kv
        self.lease_timeout_s = lease_timeout_s
        self.offsets = offsets or {}
        self._leases: dict[str, tuple[list[KVBlock], float]] = {}
        """Held blocks by request: referenced until released or past the deadline (unix time)."""
        self._behind: set[str] = set()
        """Saves in flight that nobody waits for."""
        self._awaiting_save: dict[str, RequestOutput] = {}
        """Last outputs held back until the connector has stored the request's blocks."""
        self._num_saves_dropped = 0
        self._num_save_failures = 0
        self.num_leases_expired = 0
        self._loads: dict[str, tuple[Request, int, int, float]] = {}
        """Loads in flight: request, first block, number of blocks, when asked (perf_counter)."""
        self._saves: dict[str, list[KVBlock]] = {}
        """Saves in flight: the blocks referenced until the connector has read them."""

    @property
    def num_saves_dropped(self) -> int:
        """Saves written behind that were dropped under pressure, here or in the connector."""
        return self._num_saves_dropped + self.connector.num_saves_dropped

    @property
    def num_save_failures(self) -> int:
        """Saves that failed to store, reported or written behind."""
        return self._num_save_failures + self.connector.num_save_failures_behind

    @property
    def busy(self) -> bool:
        """Whether anything is on its way (the step loop keeps polling)."""
        # Leases are not waited for: an idle engine lets them expire at its next step.
        return bool(self._loads) or bool(self._saves) or bool(self._awaiting_save) or self.connector.num_pending > 0

    def start_loads(self) -> None:
        """Ask the connector for the blocks the last schedule reserved."""
        for request, first, num in self.scheduler.loads_to_start:
            rid = request.request_id
            self._loads[rid] = (request, first, num, time.perf_counter())
            hashes = request.block_hashes[first : first + num]
            assert request.kv_transfer is not None
            reserved = self._in_region(self.kv.reserved_block_ids(rid))
            self.connector.start_load(rid, first, hashes, reserved, request.kv_transfer, request.trace_carrier)
        self.scheduler.loads_to_start = []

    def poll(self) -> list[RequestOutput]:
        """Apply finished loads, release finished saves' blocks; return the last outputs
        whose saves have now been stored."""
        loads, saves = self.connector.poll()
        for result in loads:
            entry = self._loads.pop(result.request_id, None)
            if entry is None:
                continue
            request, first, num, asked = entry
            request.kv_load_seconds += time.perf_counter() - asked
            request.kv_copy_seconds += result.copy_seconds
            if result.request_id not in self.scheduler.loading:
                self.kv.release_reserved(result.request_id)  # aborted meanwhile: only now are its blocks free
                continue
            if result.error is not None:
                log.warning("KV load of %s failed (%s): recomputing", result.request_id, result.error)
            arrived = min(result.num_blocks, num)
            # The window was written only by a direct copy, and is whole only if the load was.
            whole = result.error is None and result.direct and arrived == num
            if arrived:
                self.kv.index_loaded(request, first, arrived, window=whole)
            request.kv_loaded_direct = result.direct
            request.kv_load_path = result.path
            request.kv_load_plane = result.plane
            self.scheduler.finish_load(result.request_id, arrived, num)
        released: list[RequestOutput] = []
        for result in saves:
            rid = result.request_id
            blocks = self._saves.pop(rid, None)
            if blocks is not None:
                self.kv.pool.free(blocks[::-1])
            self._behind.discard(rid)
            if result.error is not None:
                self._num_save_failures += 1
                log.warning("storing %s's KV failed: %s", rid, result.error)
            out = self._awaiting_save.pop(rid, None)
            if out is not None and out.kv is not None:
                out.kv.num_saved_blocks = result.num_blocks if result.error is None else 0
                out.kv.save_error = result.error
            if out is not None:
                released.append(out)
        for request_id in self.connector.take_released():  # a peer's NIXL read of held blocks is done
            self.release(request_id)
        self._expire_leases()
        return released

    def finish(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Start the saves and leases of requests that just finished; hold back the last
        output of those whose save must be stored first (poll releases it)."""
        waiting, held = self.finish_requests()
        kept: list[RequestOutput] = []
        for out in outputs:
            if out.finished and out.kv is not None and out.request_id in held:  # another rank's may be in outputs
                out.kv.held = held[out.request_id]
            if out.finished and out.request_id in waiting:
                self._awaiting_save[out.request_id] = out
            else:
                kept.append(out)
        return kept

    def drop_output(self, request_id: str) -> None:
        """The request was aborted: nobody waits for its last output any more."""
        self._awaiting_save.pop(request_id, None)

    def release(self, request_id: str) -> bool:
        """A peer copied the request's held blocks: they may go. False if not held (any more)."""
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            self.kv.pool.free(lease[0][::-1])
        return lease is not None

    def _expire_leases(self) -> None:
        now = time.time()
        for request_id in [r for r, (_, deadline) in self._leases.items() if deadline <= now]:
            self.release(request_id)
            self.num_leases_expired += 1

    def finish_requests(self) -> tuple[set[str], dict[str, HeldBlocks]]:
        """For the requests that just finished with a save or a hold: start their saves
        and take their leases. Returns the ids whose last output waits for its save,
        and the blocks held per request."""
        waiting: set[str] = set()
        held: dict[str, HeldBlocks] = {}
        for request in self.scheduler.kv_finished:
            transfer = request.kv_transfer
            assert transfer is not None
            rid = request.request_id
            if transfer.hold:
                held[rid] = self._hold(request)
            if transfer.save:
                if not transfer.wait_for_save and len(self._behind) >= MAX_SAVES_BEHIND:
                    self._num_saves_dropped += 1  # under pressure a write-behind goes: only the store misses it
                    continue
                self._save(request)
                if transfer.wait_for_save:
                    waiting.add(rid)
                else:
                    self._behind.add(rid)
        self.scheduler.kv_finished = []
        return waiting, held

    def _hold(self, request: Request) -> HeldBlocks:
        """Reference the prompt's leading full blocks under a lease (a block that left the
        index, never computed here, ends the run), with the sliding groups' window a query
        at the end of that run sees (none if a block of it was handed out already)."""
        num, blocks = self.kv.persistent_blocks(request, 0, request.num_prompt_tokens // self.kv.block_size)
        if not num:
            return HeldBlocks({}, 0, 0.0)
        window_first, window = self.kv.window_blocks(request, num)
        flat = [b for group in blocks for b in group] + [b for group in window.values() for b in group]
        self.kv.pool.touch(flat)
        deadline = time.time() + self.lease_timeout_s
        self._leases[request.request_id] = (flat, deadline)
        ids = self._in_region(self._ids(blocks))
        window_ids = self._in_region({g: [b.block_id for b in group] for g, group in window.items()})
        return HeldBlocks(ids, num, deadline, window_first, window_ids)

    def _save(self, request: Request) -> None:
        """Store the finished request's full prompt blocks the source lacks (from
        num_external_blocks on, up to a block that left the index). They were just
        freed but keep their content until the next schedule."""
        first = request.num_external_blocks
        num, blocks = self.kv.persistent_blocks(request, first, request.num_prompt_tokens // self.kv.block_size - first)
        hashes = request.block_hashes[first : first + num]
        ids = self._in_region(self._ids(blocks))
        held = [b for group in blocks for b in group]
        self.kv.pool.touch(held)  # freed with the request: referenced until the connector has read them
        self._saves[request.request_id] = held
        assert request.kv_transfer is not None
        self.connector.start_save(request.request_id, hashes, ids, request.kv_transfer, request.trace_carrier)

    def _in_region(self, block_ids: dict[int, list[int]]) -> dict[int, list[int]]:
        """The pool's block ids as the connector's region names them (shifted by offsets)."""
        if not self.offsets:
            return block_ids
        return {g: [b + self.offsets[g] for b in ids] for g, ids in block_ids.items()}

    def _ids(self, blocks: list[list[KVBlock]]) -> dict[int, list[int]]:
        """Per persistent group, the ids of its blocks."""
        return {g: [b.block_id for b in group] for g, group in zip(self.kv.layout.persistent_groups, blocks)}
