"""Saves to kvcache from a process of their own.

Reading a prompt's KV into host bytes and streaming it through gRPC is byte work
that holds the GIL. In the engine's process it took the GIL from the engine
thread, which gives it up around every torch op and must win it back each time:
on an H200 an 8k prefill took 740-1015 ms instead of 238 while a Put ran beside
it (docs/perf/README.md, "The whole engine and the mesh on the H200").

The writer is a child process that maps the engine's KV cache the way a decode
instance does (CUDA IPC on a GPU, shared memory on the CPU), reads the blocks a
job names, says so (the engine may then reuse them), and stores them. The
engine's process sends a small job and reads two small replies per save.

Jobs and replies cross one socket pair as pickles of plain tuples:
  parent -> child   (job_id, hashes, block_ids)            or None to stop;
  child -> parent   ("read" | "stored", job_id, error)      error None when fine.
A writer that dies fails every job in flight (counted as failed saves) and the
connector saves in its own process from then on. The child ends when the
parent's end of the socket closes, so it never outlives the worker.
"""

import asyncio
import concurrent.futures
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection

from shared.kv.block_hash import BlockHash
from shared.kv.connectors.base import BlockIds

log = logging.getLogger(__name__)


class KVWriterDied(ConnectionError):
    """The writer process is gone: the save was not (fully) made."""


class KVWriter:
    """The parent's side: start the child, send jobs, resolve their futures."""

    def __init__(self, region_description: bytes, layout: object, device: str, address: str, timeout_s: float) -> None:
        """region_description: KVRegion.share(); layout: the engine's KVCacheLayout."""
        parent, child = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "shared.kv.connectors.kvcache_writer", str(child.fileno())],
            pass_fds=[child.fileno()],
            env=os.environ.copy(),
        )
        child.close()
        self._conn = Connection(parent.detach())
        self._conn.send((region_description, layout, device, address, timeout_s))
        self._lock = threading.Lock()  # the futures, between the engine thread and the reader
        self._jobs: dict[int, tuple[concurrent.futures.Future[None], concurrent.futures.Future[None]]] = {}
        self._next_id = 0
        self._dead: str | None = None
        self._closing = False  # close() asked the child to stop: its EOF is no death
        self._reader = threading.Thread(target=self._read_replies, name="kv-writer-replies", daemon=True)
        self._reader.start()

    def submit(
        self, hashes: Sequence[BlockHash], block_ids: BlockIds
    ) -> tuple["concurrent.futures.Future[None]", "concurrent.futures.Future[None]"]:
        """(read, stored): done once the writer has read the blocks, and once kvcache holds them."""
        read: concurrent.futures.Future[None] = concurrent.futures.Future()
        stored: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if self._dead is not None:
                error = KVWriterDied(self._dead)
                read.set_exception(error)
                stored.set_exception(error)
                return read, stored
            job_id = self._next_id
            self._next_id += 1
            self._jobs[job_id] = (read, stored)
        try:
            self._conn.send((job_id, list(hashes), block_ids))
        except OSError as exc:
            self._fail_all(f"the KV writer is gone: {exc}")
        return read, stored

    def _read_replies(self) -> None:
        try:
            while True:
                kind, job_id, error = self._conn.recv()
                with self._lock:
                    futures = self._jobs.get(job_id)
                    if futures is not None and kind == "stored":
                        del self._jobs[job_id]
                if futures is None:
                    continue
                future = futures[0] if kind == "read" else futures[1]
                if kind == "read" and error is not None:  # nothing read: nothing stored either
                    with self._lock:
                        self._jobs.pop(job_id, None)
                    futures[1].set_exception(RuntimeError(error))
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(RuntimeError(error))
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            self._fail_all(f"the KV writer is gone ({type(exc).__name__})")

    def _fail_all(self, why: str) -> None:
        with self._lock:
            if self._dead is None and not self._closing:
                log.warning("%s: saves to kvcache run in the worker's own process from now on", why)
            self._dead = why
            jobs, self._jobs = self._jobs, {}
        for read, stored in jobs.values():
            for future in (read, stored):
                if not future.done():
                    future.set_exception(KVWriterDied(why))

    @property
    def alive(self) -> bool:
        return self._dead is None

    def close(self) -> None:
        with self._lock:
            self._closing = True
        try:
            self._conn.send(None)
        except OSError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()
        self._reader.join(timeout=5)


# -- the child -----------------------------------------------------------------------


def _child_region(description: bytes, layout, device: str):  # noqa: ANN001, ANN202
    """The engine's cache (every rank's, for a multi-rank instance), mapped here as a
    KVRegion (its read_blocks gives the payloads)."""
    import torch

    from shared.kv.memory.ranked_region import open_region

    return open_region(description, layout, torch.device(device))


async def _serve(conn: Connection) -> None:
    from shared.kv.wire.client import KVCacheClient
    from shared.runtime import rpc
    from shared.runtime.settings import load_settings

    description, layout, device, address, timeout_s = conn.recv()
    settings = load_settings()
    rpc.configure_from(settings.worker)  # the worker's token and TLS files, from its env
    region = _child_region(description, layout, device)
    # Its own shared-memory segment (the service copies the blocks out of it), as big as the worker's.
    client = KVCacheClient(address, timeout_s=timeout_s, shm_bytes=settings.kvcache.shm_bytes)
    loop = asyncio.get_running_loop()
    stores: set[asyncio.Task[None]] = set()

    async def store(job_id: int, hashes: list[BlockHash], payloads: list[bytes]) -> None:
        try:
            await client.put_blocks([(h, region.layout, data) for h, data in zip(hashes, payloads)])
            conn.send(("stored", job_id, None))
        except Exception as exc:
            conn.send(("stored", job_id, f"{type(exc).__name__}: {exc}"))
            # kvcache may have restarted: dial again at once rather than sit out gRPC's backoff.
            await client.reconnect()

    try:
        while (job := await loop.run_in_executor(None, _recv_or_none, conn)) is not None:
            job_id, hashes, block_ids = job
            try:
                payloads = region.read_blocks(block_ids)
            except Exception as exc:
                conn.send(("read", job_id, f"reading the blocks: {type(exc).__name__}: {exc}"))
                continue
            conn.send(("read", job_id, None))
            task = asyncio.create_task(store(job_id, hashes, payloads))
            stores.add(task)
            task.add_done_callback(stores.discard)
        if stores:
            await asyncio.wait(stores, timeout=timeout_s)
    finally:
        await client.close()


def _recv_or_none(conn: Connection) -> object:
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None  # the worker is gone: stop


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kv-writer %(levelname)s %(message)s")
    conn = Connection(int(argv[0]))
    try:
        asyncio.run(_serve(conn))
    except (EOFError, OSError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
