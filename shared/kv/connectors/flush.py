"""The saves a connector writes behind, kept until stored, so a stopping worker can
flush them: wait for every store still on its way, for at most a bound, and count
the blocks of those that did not land in time.

A save written behind is reported to the engine once its blocks are read, long
before kvcache holds them. Without this, a worker stopped right after answering
(SIGTERM from `infermesh up`, a pod's deletion) closed its connector with those
stores in flight and the prompt missed the cache after a restart (issue 32). Torch-
free, no gRPC: the connector adds each store's future, the worker's drain calls
`flush` (worker.kv_flush_timeout_s).
"""

import concurrent.futures
import threading
import time


class StoresBehind:
    """Stores written behind that have not ended yet: their futures and block counts
    (added on the engine's thread, ended on the connector's or the writer's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[concurrent.futures.Future[None], int] = {}
        self.num_blocks_unflushed = 0
        """Blocks of stores a flush gave up on (they may still land; counted as lost)."""

    def add(self, stored: "concurrent.futures.Future[None]", num_blocks: int) -> None:
        """Track a store until its future ends (however it ends: a failed store is
        counted where it fails, not here)."""
        with self._lock:
            self._pending[stored] = num_blocks
        stored.add_done_callback(self._ended)

    def _ended(self, stored: "concurrent.futures.Future[None]") -> None:
        with self._lock:
            self._pending.pop(stored, None)

    @property
    def num_pending_blocks(self) -> int:
        with self._lock:
            return sum(self._pending.values())

    def flush(self, timeout_s: float) -> int:
        """Wait up to timeout_s for every store on its way to end; returns the blocks of
        those still on their way then (0: all ended), and adds them to
        num_blocks_unflushed. Stores added meanwhile are waited for too, within the
        same bound."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            with self._lock:  # a future may be done before its callback has dropped it
                pending = [f for f in self._pending if not f.done()]
            if not pending:
                return 0
            left = deadline - time.monotonic()
            if left <= 0:
                break
            concurrent.futures.wait(pending, timeout=left)
        with self._lock:
            given_up = sum(n for f, n in self._pending.items() if not f.done())
            self._pending.clear()  # counted once: a second flush does not count them again
            self.num_blocks_unflushed += given_up
        return given_up
