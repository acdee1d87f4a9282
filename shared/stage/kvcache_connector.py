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
is dropped, counted like one that fails.
"""

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from opentelemetry import context

from shared.engine.engine_request import KVTransferParams
from shared.engine.kv.connector import BlockIds, KVConnector, LoadResult, SaveResult, TraceCarrier
from shared.kv.block_hash import BlockHash
from shared.runtime.kvcache_client import KVCacheClient
from shared.runtime.telemetry import extract_context

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_BYTES_BEHIND = 2 << 30
"""Host bytes of saves written behind that may be on their way to the store at once."""


@dataclass(slots=True)
class _Save:
    num_blocks: int
    waited_for: bool
    read: "concurrent.futures.Future[None]"
    """Done once the blocks are in host memory (the engine may reuse them)."""
    stored: "concurrent.futures.Future[None]"


class KVCacheConnector(KVConnector):
    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvcache-connector", daemon=True)
        self._thread.start()
        # The client's channel belongs to the loop it is made on.
        self._client: KVCacheClient = self._submit(self._make_client(address, timeout_s), None).result()
        self._lookups: dict[str, concurrent.futures.Future[int]] = {}
        self._loads: dict[str, concurrent.futures.Future[int]] = {}
        self._saves: dict[str, _Save] = {}
        self._bytes_behind = 0
        """Bytes of saves written behind on their way to the store (the loop's thread only)."""
        self._num_dropped = 0
        self._num_failed_behind = 0

    @staticmethod
    async def _make_client(address: str, timeout_s: float) -> KVCacheClient:
        return KVCacheClient(address, timeout_s=timeout_s)

    def _submit(self, coro: Coroutine[Any, Any, T], trace: TraceCarrier | None) -> "concurrent.futures.Future[T]":
        async def in_context() -> T:
            token = context.attach(extract_context(trace)) if trace else None
            try:
                return await coro
            finally:
                if token is not None:
                    context.detach(token)

        return asyncio.run_coroutine_threadsafe(in_context(), self._loop)

    # -- the interface -------------------------------------------------------

    def lookup(
        self, request_id: str, hashes: list[BlockHash], params: KVTransferParams, trace: TraceCarrier | None = None
    ) -> int | None:
        future = self._lookups.get(request_id)
        if future is None:
            self._lookups[request_id] = self._submit(self._client.lookup(hashes), trace)
            return None
        if not future.done():
            return None
        del self._lookups[request_id]
        try:
            return future.result()
        except Exception as exc:  # the cache is down or slow: nothing to load, compute
            log.warning("kvcache lookup for %s failed: %s", request_id, exc)
            return 0

    def start_load(
        self,
        request_id: str,
        first_block: int,
        hashes: list[BlockHash],
        block_ids: BlockIds,
        params: KVTransferParams,
        trace: TraceCarrier | None = None,
    ) -> None:
        self._loads[request_id] = self._submit(self._fetch(hashes, block_ids), trace)

    async def _fetch(self, hashes: list[BlockHash], block_ids: BlockIds) -> int:
        """Fetch the blocks and write them into the engine's cache, here on the
        connector's thread (torch's copy releases the GIL)."""
        layout = self.region.layout
        payloads: list[bytes] = []
        async for block_hash, block_layout, data in self._client.iter_blocks(hashes):
            if block_hash != hashes[len(payloads)] or block_layout != layout:
                break  # another chain or another model's layout: the rest is recomputed
            payloads.append(data)
        return self.region.write_blocks(block_ids, payloads)

    def start_save(
        self,
        request_id: str,
        hashes: list[BlockHash],
        block_ids: BlockIds,
        params: KVTransferParams,
        trace: TraceCarrier | None = None,
    ) -> None:
        read: concurrent.futures.Future[None] = concurrent.futures.Future()
        stored = self._submit(self._store(hashes, block_ids, read, params.wait_for_save), trace)
        self._saves[request_id] = _Save(len(hashes), params.wait_for_save, read, stored)

    async def _store(
        self, hashes: list[BlockHash], block_ids: BlockIds, read: "concurrent.futures.Future[None]", waited_for: bool
    ) -> None:
        layout = self.region.layout
        try:
            payloads = self.region.read_blocks(block_ids)
        except BaseException as exc:
            read.set_exception(exc)
            raise
        read.set_result(None)
        if waited_for:
            await self._client.put_blocks([(h, layout, data) for h, data in zip(hashes, payloads)])
            return
        size = sum(len(data) for data in payloads)
        if self._bytes_behind + size > MAX_BYTES_BEHIND:
            self._num_dropped += 1  # the store falls behind: this prefix only misses the cache later
            return
        self._bytes_behind += size
        try:
            await self._client.put_blocks([(h, layout, data) for h, data in zip(hashes, payloads)])
        except Exception as exc:
            self._num_failed_behind += 1
            log.warning("storing %d blocks written behind failed: %s", len(hashes), exc)
        finally:
            self._bytes_behind -= size

    def poll(self) -> tuple[list[LoadResult], list[SaveResult]]:
        loads: list[LoadResult] = []
        for request_id, future in [(r, f) for r, f in self._loads.items() if f.done()]:
            del self._loads[request_id]
            try:
                loads.append(LoadResult(request_id, future.result()))
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
        future = self._lookups.pop(request_id, None)
        if future is not None:
            future.cancel()

    @property
    def num_pending(self) -> int:
        return len(self._lookups) + len(self._loads) + len(self._saves)

    @property
    def num_saves_dropped(self) -> int:
        return self._num_dropped

    @property
    def num_save_failures_behind(self) -> int:
        return self._num_failed_behind

    def close(self) -> None:
        if not self._loop.is_running():
            return
        asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
