"""The KV connector over the kvcache service (gRPC + LMDB).

The engine calls it from its step thread and must never wait on the network,
so the gRPC client lives on an event loop of the connector's own thread; every
call is a coroutine submitted there, and `poll` collects the finished ones.
Each call runs in the trace context of its request, so the kvcache spans join
the request's trace. A call that fails counts as a miss (lookup: 0 blocks;
load: no payloads, with the error): the engine recomputes, and says so.

A save written behind is reported as soon as its blocks have been copied to
host memory, so the engine's blocks are not held while the store runs; what is
on its way to the store is bounded (MAX_BYTES_BEHIND), and a save beyond that
is dropped, counted like one that fails. A stopping worker flushes them (`flush`,
flush.py): it waits, up to a bound, until kvcache holds every one, and counts the
blocks of those it gave up on. Where the engine's cache can be mapped
by another process (a prefill worker's), saves run in a writer process of their
own (kvcache_writer.py), so their byte work never takes the GIL from the engine.

kvcache is a cache, so a worker computes without it rather than waits for it.
A lookup that does not answer within lookup_timeout_s counts as a miss; a call
that fails or times out marks the service down, and while it is down lookups
answer 0 at once and saves fail at once (nothing is sent). A probe on a channel
of its own (every probe_interval_s) notices when it is back, replaces the
client's channel (which gRPC would otherwise leave in reconnect backoff for up to
two minutes) and marks it up: its use resumes within about one interval. `up`
is the worker's view for /metrics and gRPC health; `take_outcome(request)` says
what kvcache did for a request's lookup ("ok", "down", "failed", "slow", or
"recompute": it held blocks, but loading them would be slower than recomputing
them, load_cost.py).

Loads on the service's host come through the client's shared-memory segment
(shared/kv/wire/client.py): each batch the service lands there is written into the
engine's cache as one copy per cache tensor, off the connector's event loop (a
thread: torch's copy releases the GIL). On a GPU the segment is pinned
(cudaHostRegister) when it is made, so that copy runs at PCIe speed. Elsewhere
(another container, pod or node), with kv_transfer.nixl on, the service WRITEs
the batches into the client's NIXL landing buffer (host memory registered with
the process's NIXL agent, the engine's NIXL link's when it has one; pinned the
same way), else they come off the gRPC stream; either is written the same way.
A load's LoadResult.plane says which ("shm", "nixl", "stream"): the worker's
span attribute kv.kvcache_plane and metric kvcache_load_bytes_total{plane}.
"""

import asyncio
import concurrent.futures
import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from opentelemetry import context

from shared.kv.block_hash import BlockHash
from shared.kv.connectors.base import BlockIds, KVConnector, LoadResult, SaveResult, TraceCarrier
from shared.kv.connectors.flush import StoresBehind
from shared.kv.connectors.kvcache_writer import KVWriter
from shared.kv.connectors.load_cost import LoadCost
from shared.kv.memory.region import KVRegion
from shared.kv.transfer import KVTransferParams, persistent_ids
from shared.kv.wire.client import DEFAULT_SHM_BYTES, KVCacheClient, LandedBatch
from shared.kv.wire.targets import AgentFactory
from shared.runtime.telemetry import extract_context

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_BYTES_BEHIND = 1 << 30
"""Bytes of saves written behind that may be on their way to the store at once; a save
beyond is dropped before anything is read (the store is slower than prefill: on an
H200 an 8B model prefills ~4.5 GB of KV a second, kvcache stores ~0.3)."""
MAX_OUTCOMES = 4096
"""Lookup outcomes kept for take_outcome (those of requests nobody asked about go first)."""


class LookupOutcome(enum.StrEnum):
    """What kvcache did for a request's lookup (the span's kv.kvcache, the label of
    kvcache_bypassed_total)."""

    OK = "ok"
    DOWN = "down"
    """Known down: not asked."""
    FAILED = "failed"
    SLOW = "slow"
    """No answer within lookup_timeout_s."""
    RECOMPUTE = "recompute"
    """A hit not worth loading: recomputing it is faster (load_cost.py)."""


class KVCacheDown(ConnectionError):
    """kvcache is unreachable: nothing was sent."""


@dataclass(slots=True)
class _Save:
    num_blocks: int
    waited_for: bool
    read: "concurrent.futures.Future[None]"
    """Done once the blocks are in host memory (the engine may reuse them)."""
    stored: "concurrent.futures.Future[None]"


class KVCacheConnector(KVConnector):
    def __init__(
        self,
        address: str,
        timeout_s: float = 30.0,
        lookup_timeout_s: float = 1.0,
        probe_interval_s: float = 0.5,
        load_when_faster: bool = True,
        shm_bytes: int = DEFAULT_SHM_BYTES,
        nixl_bytes: int = 0,
        nixl_agent: AgentFactory | None = None,
    ) -> None:
        """load_when_faster: load a hit only when that is not much slower than
        recomputing it (load_cost.py); False loads every hit. shm_bytes: the
        client's shared-memory segment (kvcache.shm_bytes; 0: none). nixl_bytes:
        its NIXL landing buffer (kv_transfer.kvcache_nixl_bytes; 0: none), with the
        agent nixl_agent() gives (None: one of the client's own)."""
        self.shm_bytes = shm_bytes
        self.nixl_bytes = nixl_bytes
        self._nixl_agent = nixl_agent
        self.lookup_timeout_s = lookup_timeout_s
        self.cost = LoadCost() if load_when_faster else None
        self._block_size = 0
        self.probe_interval_s = probe_interval_s
        self._address, self._timeout_s = address, timeout_s
        self._writer: KVWriter | None = None
        self._writer_tried = False
        self.up = True
        """Whether kvcache answered lately (a failed call says no at once, the probe says yes again)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvcache-connector", daemon=True)
        self._thread.start()
        # The client's channel belongs to the loop it is made on.
        self._client: KVCacheClient = self._submit(self._make_client(address, timeout_s), None).result()
        self._probe = self._submit(self._probe_loop(), None)
        self._lookups: dict[str, tuple[concurrent.futures.Future[int], float]] = {}
        """Lookups in flight: the answer to come, and when it was asked (monotonic)."""
        self._outcomes: OrderedDict[str, LookupOutcome] = OrderedDict()
        self._outcomes_lock = threading.Lock()
        self._loads: dict[str, concurrent.futures.Future[tuple[int, str]]] = {}
        self._saves: dict[str, _Save] = {}
        self._bytes_behind = 0
        """Bytes of saves written behind on their way to the store (under _behind_lock)."""
        self._behind_lock = threading.Lock()  # reserved on the engine's thread, released on the loop's
        self._num_dropped = 0
        self._num_failed_behind = 0
        self._stores_behind = StoresBehind()
        """Saves written behind until kvcache holds them (or they failed): what `flush` waits for."""

    async def _make_client(self, address: str, timeout_s: float) -> KVCacheClient:
        return KVCacheClient(address, timeout_s=timeout_s, shm_bytes=self.shm_bytes, on_segment=self._pin,
                             nixl_bytes=self.nixl_bytes, nixl_agent=self._nixl_agent)

    @property
    def client(self) -> KVCacheClient:
        """The gRPC client (its counters: `shm`, `nixl`, `get_bytes`); its calls belong
        to the connector's loop."""
        return self._client

    def _pin(self, buffer: memoryview) -> "Callable[[], None] | None":
        """Page-lock a new segment when the engine's cache is on a GPU, so the copies
        out of it are DMA at PCIe speed; the undo runs before the segment is retired."""
        region = getattr(self, "region", None)
        if region is None or region.device.type != "cuda":
            return None
        return pin_host_memory(buffer)

    def _submit(self, coro: Coroutine[Any, Any, T], trace: TraceCarrier | None) -> "concurrent.futures.Future[T]":
        async def in_context() -> T:
            token = context.attach(extract_context(trace)) if trace else None
            try:
                return await coro
            finally:
                if token is not None:
                    context.detach(token)

        return asyncio.run_coroutine_threadsafe(in_context(), self._loop)

    # -- kvcache's state ----------------------------------------------------

    def _mark_down(self, why: str) -> None:
        if self.up:
            log.warning("kvcache unreachable (%s): computing without it until it is back", why)
        self.up = False

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                # As slow as a lookup may be: a probe stricter than lookups would mark
                # down a cache whose lookups still answer in time (a loaded host).
                ok = await self._client.probe(timeout_s=self.lookup_timeout_s)
            except Exception:
                ok = False
            if not ok:
                self._mark_down("health check")
            elif not self.up:
                await self._client.reconnect()  # the old channel may sit in reconnect backoff
                self.up = True
                log.info("kvcache is back: using it again")

    def _record(self, request_id: str, outcome: LookupOutcome) -> None:
        with self._outcomes_lock:
            self._outcomes[request_id] = outcome
            while len(self._outcomes) > MAX_OUTCOMES:
                self._outcomes.popitem(last=False)

    def take_outcome(self, request_id: str) -> LookupOutcome | None:
        """What kvcache did for the request's lookup; None when it was not asked (any thread)."""
        with self._outcomes_lock:
            return self._outcomes.pop(request_id, None)

    # -- the interface -------------------------------------------------------

    def lookup(
        self, request_id: str, hashes: list[BlockHash], params: KVTransferParams, trace: TraceCarrier | None = None
    ) -> int | None:
        pending = self._lookups.get(request_id)
        if pending is None:
            if not self.up:  # known down: a miss at once, the request computes
                self._record(request_id, LookupOutcome.DOWN)
                return 0
            lookup = self._client.lookup(hashes, timeout_s=self.lookup_timeout_s)
            self._lookups[request_id] = (self._submit(lookup, trace), time.monotonic())
            return None
        future, asked = pending
        if not future.done():
            if time.monotonic() - asked < self.lookup_timeout_s:
                return None
            del self._lookups[request_id]  # too slow: a miss; the request does not wait for the cache
            future.cancel()
            self._record(request_id, LookupOutcome.SLOW)
            self._mark_down(f"a lookup took over {self.lookup_timeout_s} s")
            return 0
        del self._lookups[request_id]
        try:
            held = future.result()
        except Exception as exc:  # the cache is down or slow: nothing to load, compute
            log.info("kvcache lookup for %s failed: %s", request_id, exc)
            self._record(request_id, LookupOutcome.FAILED)
            self._mark_down(type(exc).__name__)
            return 0
        if self.cost is not None and not self.cost.worth_loading(held, self.region.block_bytes, self._block_size):
            self._record(request_id, LookupOutcome.RECOMPUTE)  # held, but recomputing is faster than loading
            return 0
        self._record(request_id, LookupOutcome.OK)
        return held

    def register_recompute_rate(self, tokens_per_s: float, block_size: int) -> None:
        if self.cost is not None:
            self.cost.recompute_tokens_per_s = tokens_per_s
        self._block_size = block_size

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
        self._loads[request_id] = self._submit(self._fetch(hashes, block_ids), trace)

    async def _fetch(self, hashes: list[BlockHash], block_ids: BlockIds) -> tuple[int, str]:
        """Fetch the blocks and write them into the engine's cache, a batch at a
        time, each batch in one copy per cache tensor on a thread (torch's copies
        release the GIL): no KV byte is touched on the connector's event loop.
        (Blocks written, the planes that carried them: LoadResult.plane.)"""
        region = self.region
        written = 0
        planes: list[str] = []
        started = time.monotonic()
        async for batch in self._client.iter_landed(hashes):
            if batch.plane.value not in planes:
                planes.append(batch.plane.value)
            good = 0
            for block in batch.blocks:  # another chain, another model's layout or size: the rest is recomputed
                if (block.block_hash != hashes[written + good] or block.layout != region.layout
                        or block.num_bytes != region.block_bytes):
                    break
                good += 1
            if good:
                ids = {g: b[written : written + good] for g, b in block_ids.items()}
                await asyncio.to_thread(_write_batch, region, ids, batch, good)
                written += good
            if good < len(batch.blocks):
                break
        if self.cost is not None:
            self.cost.observe_load(written * region.block_bytes, time.monotonic() - started)
        return written, "+".join(planes)

    def start_save(
        self,
        request_id: str,
        hashes: list[BlockHash],
        block_ids: BlockIds,
        params: KVTransferParams,
        trace: TraceCarrier | None = None,
    ) -> None:
        read: concurrent.futures.Future[None] = concurrent.futures.Future()
        if not self.up:  # known down: fail at once, nobody waits for a store that cannot happen
            read.set_exception(KVCacheDown("kvcache is unreachable"))
            stored: concurrent.futures.Future[None] = read
            if not params.wait_for_save:
                self._num_failed_behind += 1
        elif not params.wait_for_save and not self._reserve_behind(len(hashes) * self.region.block_bytes):
            self._num_dropped += 1  # the store falls behind: this prefix only misses the cache later
            read.set_result(None)
            stored = read
        elif (writer := self._the_writer()) is not None:
            read, stored = writer.submit(hashes, block_ids)
            if not params.wait_for_save:
                size = len(hashes) * self.region.block_bytes
                stored.add_done_callback(lambda done: self._stored_behind(done, size))
        else:
            stored = self._submit(self._store(hashes, block_ids, read, params.wait_for_save), trace)
        if not params.wait_for_save:  # what a stopping worker's flush waits for (a store already ended leaves at once)
            self._stores_behind.add(stored, len(hashes))
        self._saves[request_id] = _Save(len(hashes), params.wait_for_save, read, stored)

    def _the_writer(self) -> KVWriter | None:
        """The writer process, started at the first save where the cache can be mapped."""
        if not self._writer_tried:
            self._writer_tried = True
            try:
                description = self.region.share()
            except ValueError:
                return None  # a cache only this process sees: saves run here
            region = self.region
            self._writer = KVWriter(
                description, region.kv_layout, str(region.device), self._address, self._timeout_s
            )
        return self._writer if self._writer is not None and self._writer.alive else None

    def _stored_behind(self, stored: "concurrent.futures.Future[None]", size: int) -> None:
        """A save written behind by the writer ended (the writer's reply thread)."""
        self._release_behind(size)
        if stored.exception() is not None:
            self._num_failed_behind += 1
            log.warning("storing blocks written behind failed: %s", stored.exception())

    def _reserve_behind(self, size: int) -> bool:
        with self._behind_lock:
            if self._bytes_behind + size > MAX_BYTES_BEHIND:
                return False
            self._bytes_behind += size
            return True

    async def _store(
        self, hashes: list[BlockHash], block_ids: BlockIds, read: "concurrent.futures.Future[None]", waited_for: bool
    ) -> None:
        layout = self.region.layout
        size = len(hashes) * self.region.block_bytes
        try:
            # Off the loop: lookups and loads of other requests go on meanwhile.
            payloads = await asyncio.to_thread(self.region.read_blocks, block_ids)
        except BaseException as exc:
            read.set_exception(exc)
            if not waited_for:
                self._release_behind(size)
            raise
        read.set_result(None)
        if waited_for:
            await self._client.put_blocks([(h, layout, data) for h, data in zip(hashes, payloads)])
            return
        try:
            await self._client.put_blocks([(h, layout, data) for h, data in zip(hashes, payloads)])
        except Exception as exc:
            self._num_failed_behind += 1
            log.warning("storing %d blocks written behind failed: %s", len(hashes), exc)
        finally:
            self._release_behind(size)

    def _release_behind(self, size: int) -> None:
        with self._behind_lock:
            self._bytes_behind -= size

    def poll(self) -> tuple[list[LoadResult], list[SaveResult]]:
        loads: list[LoadResult] = []
        for request_id, future in [(r, f) for r, f in self._loads.items() if f.done()]:
            del self._loads[request_id]
            try:
                written, plane = future.result()
                loads.append(LoadResult(request_id, written, plane=plane))
            except Exception as exc:
                loads.append(LoadResult(request_id, 0, f"{type(exc).__name__}: {exc}"))
        saves: list[SaveResult] = []
        for request_id, save in list(self._saves.items()):
            # A save written behind is reported once read (or once its read failed); its store runs on.
            future = save.stored if save.waited_for else save.read
            if not future.done():
                continue
            del self._saves[request_id]
            try:
                future.result()
                saves.append(SaveResult(request_id, save.num_blocks))
            except Exception as exc:
                saves.append(SaveResult(request_id, 0, f"{type(exc).__name__}: {exc}"))
        return loads, saves

    def forget(self, request_id: str) -> None:
        pending = self._lookups.pop(request_id, None)
        if pending is not None:
            pending[0].cancel()

    @property
    def num_pending(self) -> int:
        return len(self._lookups) + len(self._loads) + len(self._saves)

    @property
    def num_saves_dropped(self) -> int:
        return self._num_dropped

    @property
    def num_save_failures_behind(self) -> int:
        return self._num_failed_behind

    def flush(self, timeout_s: float) -> int:
        """Wait (any thread but the connector's) until every save written behind so far
        is stored or has failed, for at most timeout_s; returns the blocks of those still
        on their way then, which are counted (num_blocks_unflushed) and may be lost.
        A stopping worker calls it after its engine stopped, before close."""
        return self._stores_behind.flush(timeout_s)

    @property
    def num_blocks_unflushed(self) -> int:
        """Blocks of saves written behind that a flush gave up waiting for."""
        return self._stores_behind.num_blocks_unflushed

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if not self._loop.is_running():
            return
        self._loop.call_soon_threadsafe(self._probe.cancel)
        asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


def _write_batch(region: KVRegion, block_ids: BlockIds, batch: LandedBatch, num_blocks: int) -> None:
    """The batch's first num_blocks blocks into the engine's blocks. Blocks back to back
    (always, in a segment, for same-sized blocks) are one [n, block_bytes] view of the
    batch's memory, copied from where they lie; otherwise they are gathered first."""
    block_bytes = region.block_bytes
    first = batch.blocks[0].offset
    contiguous = all(b.offset == first + i * block_bytes for i, b in enumerate(batch.blocks[:num_blocks]))
    if contiguous:
        payloads = torch.frombuffer(batch.data, dtype=torch.uint8, count=num_blocks * block_bytes, offset=first)
    else:
        payloads = torch.stack([torch.frombuffer(batch.block_data(i), dtype=torch.uint8) for i in range(num_blocks)])
    region.write_payloads(block_ids, payloads.view(num_blocks, block_bytes))


def pin_host_memory(buffer: memoryview) -> Callable[[], None] | None:
    """cudaHostRegister the buffer (page-locks it: copies to the GPU run as DMA);
    returns the unregister, or None when CUDA refused (copies then stage through
    pageable memory: slower, still correct)."""
    address = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(address, len(buffer), 0)) != 0:
        log.warning("could not pin the kvcache segment (%d bytes): loads copy from pageable memory", len(buffer))
        return None
    return lambda: cudart.cudaHostUnregister(address)
