"""What the two links that copy out of a peer's cache share (peer.py: the peer's
cache mapped into this process; nixl.py: read through NIXL): a request's blocks
held by a peer under a lease, copied on a thread of the link's own.

The lookup answers at once from the handoff's description (`PeerSource`) when the
link can reach that peer (`_reach`); every other load, and every save, goes to the
link behind. No copy starts when the lease is about to run out, and a copy that
outlived the lease is thrown away (its tokens recomputed, counted): the peer may
have reused the blocks, so stale KV is never used. Each link says how the bytes
move (`_move`) and what it tells the peer when they have (`_done`).
"""

import concurrent.futures
import logging
import time
from abc import abstractmethod
from typing import Any

from shared.kv.block_hash import BlockHash
from shared.kv.connectors.base import BlockIds, InFrontConnector, KVConnector, LoadResult, SaveResult, TraceCarrier
from shared.kv.transfer import KVTransferParams, PeerSource, copy_plan

log = logging.getLogger(__name__)

LEASE_MARGIN_S = 1.0
"""A copy starts only this long before the lease's end, at the latest."""


class PeerLink(InFrontConnector):
    path: str
    """LoadResult.path of this link's loads."""
    copy_name: str
    """What a failed load's error calls the copy ("direct copy", "NIXL read")."""

    def __init__(self, behind: KVConnector, thread_name: str) -> None:
        super().__init__(behind)
        self._routes: dict[str, tuple[PeerSource, Any]] = {}
        self._copies: dict[str, concurrent.futures.Future[tuple[int, float]]] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self.num_direct_blocks = 0
        self.num_failures = 0
        self.copy_seconds = 0.0
        """Time spent in copies (with num_direct_blocks, their bandwidth)."""

    @abstractmethod
    def _reach(self, source: PeerSource) -> Any | None:
        """How this link reaches the peer holding `source` (its layout agrees and its
        lease has time left); None when it cannot: the link behind serves the load."""

    @abstractmethod
    def _move(self, request_id: str, source: PeerSource, route: Any, src: BlockIds, dst: BlockIds) -> None:
        """Copy the peer's blocks src (per group) into our blocks dst, on the link's thread."""

    def _done(self, request_id: str, source: PeerSource) -> None:
        """The copy arrived within the lease: tell the peer its blocks may go, if the
        copy did not already. Nothing by default."""

    def _usable(self, source: PeerSource) -> bool:
        return (source.layout == self.region.layout and source.num_blocks > 0
                and time.time() <= source.lease_deadline - LEASE_MARGIN_S)  # fmt: skip

    def lookup(
        self, request_id: str, hashes: list[BlockHash], params: KVTransferParams, trace: TraceCarrier | None = None
    ) -> int | None:
        source = params.source
        if source is not None and request_id not in self._routes and self._usable(source):
            route = self._reach(source)
            if route is not None:
                self._routes[request_id] = (source, route)
        if request_id in self._routes:
            return min(self._routes[request_id][0].num_blocks, len(hashes))
        return self.behind.lookup(request_id, hashes, params, trace)

    def start_load(
        self,
        request_id: str,
        first_block: int,
        hashes: list[BlockHash],
        block_ids: BlockIds,
        params: KVTransferParams,
        trace: TraceCarrier | None = None,
    ) -> None:
        entry = self._routes.pop(request_id, None)
        if entry is None:
            self.behind.start_load(request_id, first_block, hashes, block_ids, params, trace)
            return
        source, route = entry
        num = min(len(hashes), source.num_blocks - first_block)
        self._copies[request_id] = self._executor.submit(
            self._copy, request_id, source, route, first_block, block_ids, num
        )

    def _copy(
        self, request_id: str, source: PeerSource, route: Any, first: int, block_ids: BlockIds, num: int
    ) -> tuple[int, float]:
        """(blocks copied, the copy's seconds)."""
        if time.time() > source.lease_deadline - LEASE_MARGIN_S:
            raise TimeoutError("the peer's lease ran out before the copy could start")
        # The peer holds the prompt's blocks from 0; we lack them from `first` on (and its window).
        src, dst = copy_plan(source, first, num, block_ids)
        started = time.perf_counter()
        self._move(request_id, source, route, src, dst)
        seconds = time.perf_counter() - started
        self.copy_seconds += seconds
        if time.time() > source.lease_deadline:
            raise TimeoutError("the peer's lease ran out during the copy: its blocks may have been reused")
        self._done(request_id, source)
        return num, seconds

    def start_save(
        self,
        request_id: str,
        hashes: list[BlockHash],
        block_ids: BlockIds,
        params: KVTransferParams,
        trace: TraceCarrier | None = None,
    ) -> None:
        self.behind.start_save(request_id, hashes, block_ids, params, trace)

    def poll(self) -> tuple[list[LoadResult], list[SaveResult]]:
        loads, saves = self.behind.poll()
        for request_id, future in [(r, f) for r, f in self._copies.items() if f.done()]:
            del self._copies[request_id]
            try:
                num, seconds = future.result()
                self.num_direct_blocks += num
                loads.append(LoadResult(request_id, num, path=self.path, copy_seconds=seconds))
            except Exception as exc:
                self.num_failures += 1
                log.warning("%s of %s's KV failed: %s", self.copy_name, request_id, exc)
                error = f"{self.copy_name}: {type(exc).__name__}: {exc}"
                loads.append(LoadResult(request_id, 0, error, path=self.path))
        return loads, saves

    def forget(self, request_id: str) -> None:
        self._routes.pop(request_id, None)
        super().forget(request_id)

    @property
    def num_pending(self) -> int:
        return len(self._copies) + self.behind.num_pending

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        super().close()
