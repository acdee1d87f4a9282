"""The direct prefill -> decode KV path: a connector that copies a request's
prompt KV straight out of the prefill engine's cache on this host (CUDA IPC on
a GPU, shared memory on the CPU), and hands every other load, and every save,
to the connector behind it (kvcache).

Prefill holds the blocks under a lease and says so in the handoff
(`KVTransferParams.source`), with the sliding-window blocks a query at the held
boundary sees. Here the lookup answers at once from that description; the copy
runs on a thread of its own, device to device, one gather per cache tensor and
group, persistent groups and window alike (`copy_plan`). A copy is not started when the lease is about to run
out, and its result is thrown away (the tokens are recomputed, counted) when
the lease ran out while it ran: the peer may have reused the blocks, so stale
KV is never used. When the copy is done the peer is told to let the blocks go.
A peer that cannot be mapped (another host, a dead process) sends the request
to the connector behind.
"""

import concurrent.futures
import logging
import time
from collections.abc import Callable

import torch

from shared.kv.block_hash import BlockHash
from shared.kv.connectors.base import BlockIds, InFrontConnector, KVConnector, LoadResult, SaveResult, TraceCarrier
from shared.kv.memory.share import open_peer
from shared.kv.transfer import KVTransferParams, PeerSource, copy_plan

log = logging.getLogger(__name__)

LEASE_MARGIN_S = 1.0
"""A copy starts only this long before the lease's end, at the latest."""


class PeerConnector(InFrontConnector):
    def __init__(self, behind: KVConnector, release: Callable[[str, str], None]) -> None:
        """release(instance_id, request_id): tell the peer its held blocks may go."""
        super().__init__(behind)
        self._release = release
        self._peers: dict[bytes, list[torch.Tensor]] = {}
        self._routes: dict[str, PeerSource] = {}
        self._copies: dict[str, concurrent.futures.Future[tuple[int, float]]] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-peer-copy")
        self.num_direct_blocks = 0
        self.num_failures = 0
        self.copy_seconds = 0.0
        """Time spent in direct copies (with num_direct_blocks, their bandwidth)."""

    def lookup(
        self, request_id: str, hashes: list[BlockHash], params: KVTransferParams, trace: TraceCarrier | None = None
    ) -> int | None:
        source = params.source
        if source is not None and request_id not in self._routes and self._usable(source):
            self._routes[request_id] = source
        if request_id in self._routes:
            return min(self._routes[request_id].num_blocks, len(hashes))
        return self.behind.lookup(request_id, hashes, params, trace)

    def _usable(self, source: PeerSource) -> bool:
        if not source.region or source.layout != self.region.layout or source.num_blocks == 0:
            return False  # no mappable region (a NIXL-only source): for the link behind
        if time.time() > source.lease_deadline - LEASE_MARGIN_S:
            return False
        try:
            self._open(source)
        except ValueError as exc:
            log.info("no direct KV path to %s (%s): through kvcache", source.instance_id, exc)
            return False
        return True

    def _open(self, source: PeerSource) -> list[torch.Tensor]:
        tensors = self._peers.get(source.region)
        if tensors is None:
            layout, tensors = open_peer(source.region, self.region.device)
            if layout != self.region.layout:
                raise ValueError(f"the peer's layout {layout} is not ours ({self.region.layout})")
            self._peers[source.region] = tensors
        return tensors

    def start_load(
        self,
        request_id: str,
        first_block: int,
        hashes: list[BlockHash],
        block_ids: BlockIds,
        params: KVTransferParams,
        trace: TraceCarrier | None = None,
    ) -> None:
        source = self._routes.pop(request_id, None)
        if source is None:
            self.behind.start_load(request_id, first_block, hashes, block_ids, params, trace)
            return
        num = min(len(hashes), source.num_blocks - first_block)
        self._copies[request_id] = self._executor.submit(self._copy, request_id, source, first_block, block_ids, num)

    def _copy(self, request_id: str, source: PeerSource, first: int, block_ids: BlockIds, num: int) -> tuple[int, float]:
        """(blocks copied, the copy's seconds)."""
        if time.time() > source.lease_deadline - LEASE_MARGIN_S:
            raise TimeoutError("the peer's lease ran out before the copy could start")
        # The peer holds the prompt's blocks from 0; we lack them from `first` on (and its window).
        src, dst = copy_plan(source, first, num, block_ids)
        peer = self._open(source)
        started = time.perf_counter()
        self.region.copy_from_peer(peer, src, dst)
        seconds = time.perf_counter() - started
        self.copy_seconds += seconds
        if time.time() > source.lease_deadline:
            raise TimeoutError("the peer's lease ran out during the copy: its blocks may have been reused")
        self._release(source.instance_id, request_id)
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
                loads.append(LoadResult(request_id, num, path="peer", copy_seconds=seconds))
            except Exception as exc:
                self.num_failures += 1
                log.warning("direct KV copy for %s failed: %s", request_id, exc)
                loads.append(LoadResult(request_id, 0, f"direct copy: {type(exc).__name__}: {exc}", path="peer"))
        return loads, saves

    def forget(self, request_id: str) -> None:
        self._routes.pop(request_id, None)
        super().forget(request_id)

    @property
    def num_pending(self) -> int:
        return len(self._copies) + self.behind.num_pending

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._peers.clear()
        super().close()
