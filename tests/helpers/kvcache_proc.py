"""kvcache as a real service process for tests: started on free ports against a
given nats-server (LMDB, traces and its log under a work folder), restarted with
the same settings, waited for until its gRPC health says SERVING, and served for
the length of a with block (serving_kvcache: what the `kvcache` fixtures yield)."""

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared.runtime.rpc import check_health
from tests.helpers.mesh_procs import free_port, start_service, stop_process


@dataclass
class KVCacheProc:
    """A running kvcache process, its addresses and the settings it was started with."""

    proc: subprocess.Popen
    address: str
    metrics_port: int
    env: dict[str, str]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def start_kvcache(nats_url: str, workdir: Path, port: int | None = None, env: dict[str, str] | None = None,
                  **kvcache: str) -> KVCacheProc:
    """One service process; kvcache holds extra INFERMESH_KVCACHE__* settings, env any
    other variables (e.g. INFERMESH_KV_TRANSFER__NIXL)."""
    port = port or free_port()
    metrics_port = free_port()
    env = {
        **(env or {}),
        "INFERMESH_NATS__URL": nats_url,
        "INFERMESH_KVCACHE__PATH": str(workdir / "lmdb"),
        "INFERMESH_KVCACHE__ADDRESS": f"127.0.0.1:{port}",
        "INFERMESH_WORKER__METRICS_PORT": str(metrics_port),
        "INFERMESH_WORKER__DRAIN_TIMEOUT_S": "5",
        "INFERMESH_TELEMETRY__TRACE_DIR": str(workdir / "traces"),
        **{f"INFERMESH_KVCACHE__{k.upper()}": v for k, v in kvcache.items()},
    }
    log_path = workdir / "kvcache.log"
    return KVCacheProc(start_service("kvcache", env, log_path), f"127.0.0.1:{port}", metrics_port, env, log_path)


def restart(old: KVCacheProc) -> KVCacheProc:
    """The same service again (same settings, ports and LMDB folder), once the old one has stopped."""
    return KVCacheProc(start_service("kvcache", old.env, old.log_path), old.address, old.metrics_port,
                       old.env, old.log_path)


async def wait_serving(svc: KVCacheProc, timeout_s: float = 20.0) -> None:
    """Until the service says SERVING; a test failure (with its log) if it exits or takes longer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if svc.proc.poll() is not None:
            pytest.fail(f"kvcache exited with {svc.proc.returncode}:\n{svc.log()}")
        if await check_health(svc.address, timeout_s=0.5):
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"kvcache not SERVING after {timeout_s}s:\n{svc.log()}")


@contextlib.asynccontextmanager
async def serving(svc: KVCacheProc, killed: bool = False) -> AsyncIterator[KVCacheProc]:
    """A service of the test's own, once it serves. At the end it is stopped and must
    exit 0, unless the test kills it (killed): then it is stopped only if still running."""
    try:
        await wait_serving(svc)
        yield svc
    finally:
        if not killed:
            assert await asyncio.to_thread(stop_process, svc.proc) == 0, svc.log()
        elif svc.proc.poll() is None:
            stop_process(svc.proc)


@contextlib.contextmanager
def serving_kvcache(nats_url: str, workdir: Path) -> Iterator[KVCacheProc]:
    """A kvcache process, SERVING, for the block; at its end the process must exit 0
    (continued first: a test may leave it stopped with SIGSTOP)."""
    svc = start_kvcache(nats_url, workdir)
    try:
        asyncio.run(wait_serving(svc))
        yield svc
    finally:
        svc.proc.send_signal(signal.SIGCONT)
        code = stop_process(svc.proc)
    assert code == 0, svc.log()
