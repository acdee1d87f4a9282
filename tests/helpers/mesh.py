"""The mesh of real processes the integration tests run against (nats-server,
kvcache, prefill, decode and the balancer, started as `infermesh up` starts them),
and what tests ask its kvcache.

The meshes of a test session share one set of gRPC tokens (GRPC_TOKENS, one per
identity); the root conftest gives this process's own clients the prefill
identity's (GRPC_TOKEN): a test's KVCacheClient(mesh.kv_address) stores and reads
blocks as a prefill instance does. A mesh makes its NATS users itself: tests reach its NATS as
mesh.nats_url's operator (admin)."""

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shared.kv.wire.client import KVCacheClient
from shared.runtime.rpc_auth import peers_setting
from tools.launch.nats_auth import grpc_tokens
from tools.launch.up import Mesh, StartFailed, free_port

GRPC_TOKENS = grpc_tokens()
"""The gRPC token of each identity (prefill, decode, vision, balancer), in every mesh of the session."""
GRPC_TOKEN = GRPC_TOKENS["prefill"]
"""This process's clients' token: the prefill identity's (it may store and read blocks)."""
GRPC_PEERS = peers_setting(GRPC_TOKENS)
"""worker.grpc_peers of a service a test starts by hand that should know the session's identities."""


def mesh_key(model_dir: str, options: dict[str, Any]) -> str:
    """What makes two meshes the same: the model folder and Mesh's options (a module's
    MESH), as one string. Modules whose meshes have the same key may share one."""
    return json.dumps([model_dir, options], sort_keys=True)


@contextmanager
def running_mesh(model_dir: str, state_dir: Path, timeout_s: float = 240.0, **options: Any) -> Iterator[Mesh]:
    """nats-server, kvcache, prefill, decode and the balancer as real processes,
    started as `infermesh up` starts them (NATS users and gRPC tokens on); stopped on
    exit, also when the start fails. options: Mesh's num_prefill, num_decode, extra_env,
    supervise."""
    for attempt in (1, 2):
        mesh = Mesh(model_dir, port=free_port(), state_dir=state_dir, grpc_tokens=GRPC_TOKENS, **options)
        try:
            mesh.start(timeout_s=timeout_s)
            break
        except StartFailed as exc:
            mesh.stop()
            # A free port is picked, then bound by the service: another process on the
            # machine may take it in between. Once, with fresh ports, then it is a failure.
            if attempt == 2 or not any(m in str(exc) for m in ("Failed to bind", "ddress already in use")):
                raise
    try:
        yield mesh
    finally:
        mesh.stop()


def kv_stats(mesh: Mesh) -> Any:
    """kvcache's stats (KVCacheStats) through a client of its own."""
    async def go():
        client = KVCacheClient(mesh.kv_address)
        try:
            return await client.stats()
        finally:
            await client.close()

    return asyncio.run(go())


def kv_blocks_settled(mesh: Mesh, at_least: int, timeout_s: float = 15.0) -> int:
    """kvcache's block count once it reaches at_least and stops moving: prefill writes
    behind (off the time to first token), so a store may land after the response."""
    deadline = time.monotonic() + timeout_s
    last = kv_stats(mesh).num_blocks
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = kv_stats(mesh).num_blocks
        if now >= at_least and now == last:
            return now
        last = now
    return last


def live_instances(mesh: Mesh) -> dict[str, int]:
    """Each stage's live instances, as the balancer's /ready counts them ({} while it
    does not answer; a 503 also says nothing here, as it means no full mesh yet)."""
    try:
        with urllib.request.urlopen(f"http://{mesh.host}:{mesh.port}/ready", timeout=2) as r:
            return json.loads(r.read())["instances"]
    except OSError:
        return {}
