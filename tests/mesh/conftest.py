"""How the mesh tier runs beside itself. `make test` runs it in two parts: the
modules in SERIAL one after another, alone on the machine, and the rest in parallel
workers (pytest-xdist, --dist loadgroup). In the parallel part each module is one
group, so its module-scoped mesh starts in one worker only; modules that share a mesh
(MESH_SHARED = True and the same model and MESH) are one group, so they share it in
one worker."""

import hashlib
from pathlib import Path

import pytest

from tests.helpers.mesh import mesh_key

SERIAL = {
    "test_failover.py": "moves requests within 2 s of a kill; no stream waits more than 5 s",
    "test_nats_outage.py": "bounds the stalls of a NATS restart under load",
    "test_mesh_faults.py": "a client sees an error quickly when an instance dies",
    "test_local_prefill.py": "heartbeats every 0.2 s decide where prefill runs; kills a decode",
    "test_mesh_seeded.py": "kills a decode instance mid-stream",
    "test_stream_integrity.py": "bounds on a heartbeat's timing",
    "test_trust.py": "runs `infermesh up` itself and kills it; counts what listens",
    "test_kvcache_shm.py": "an error, not a wait: under 5 s",
    "test_kvcache_write_behind.py": "the blocks come back while the store is slow, timed",
    "test_load_cost.py": "measured load and prefill speeds decide",
    "test_nats_instances.py": "waits bounded in time on nats-server under TLS",
    "test_nats_tls.py": "waits bounded in time on nats-server under TLS",
    "test_orchestrator_failover.py": "a failure charged long before a 10 s timeout",
}
"""Mesh modules kept out of the parallel run, and why (a timing bound a busy machine
could break)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the SERIAL modules' tests `serial`; groups the others' (xdist_group) by
    their module, or by their shared mesh."""
    here = Path(__file__).parent
    for item in items:
        if item.path.parent != here:
            continue
        if item.path.name in SERIAL:
            item.add_marker(pytest.mark.serial)
        elif getattr(item.module, "MESH_SHARED", False):
            # The model folder's path differs per worker: its fixture's name stands for it.
            own_model = "mesh_model_dir" in vars(item.module)
            key = mesh_key("own" if own_model else "made", getattr(item.module, "MESH", {}))
            item.add_marker(pytest.mark.xdist_group("shared-mesh-" + hashlib.sha1(key.encode()).hexdigest()[:8]))
        else:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
