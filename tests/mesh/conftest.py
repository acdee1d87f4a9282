"""How the mesh tier runs beside itself. `make test` runs it in two parts: the
modules in SERIAL one after another, alone on the machine, and the rest in parallel
workers (pytest-xdist, --dist loadfile: a module's tests, and so its module-scoped
mesh, stay in one worker). Modules that share a mesh (MESH_SHARED) share it when they
run in the same process: always in a serial run, in the parallel run when their files
land on the same worker. (--dist loadgroup would keep them together, but
pytest-xdist 3.8.0 marks a group by assigning item._nodeid, which pytest 9.2 no longer
reads: it would spread a module's tests over both workers.)"""

from pathlib import Path

import pytest

SERIAL = {
    "test_failover.py": "the balancer knows of a kill within 1.5 s, moves its requests within seconds; no stream waits more than 5 s",
    "test_nats_outage.py": "bounds the stalls of a NATS restart under load",
    "test_mesh_faults.py": "a client sees an error quickly when an instance dies",
    "test_local_prefill.py": "heartbeats every 0.2 s decide where prefill runs; kills a decode",
    "test_mesh_seeded.py": "kills a decode instance mid-stream",
    "test_mesh_images.py": "kills a decode instance mid-stream",
    "test_mesh_vision.py": "kills a vision instance mid-request, with a bound",
    "test_stream_integrity.py": "bounds on a heartbeat's timing",
    "test_trust.py": "runs `infermesh up` itself and kills it; counts what listens",
    "test_kvcache_shm.py": "an error, not a wait: under 5 s",
    "test_kvcache_write_behind.py": "the blocks come back while the store is slow, timed",
    "test_load_cost.py": "measured load and prefill speeds decide",
    "test_nats_instances.py": "waits bounded in time on nats-server under TLS",
    "test_nats_tls.py": "waits bounded in time on nats-server under TLS",
    "test_orchestrator_failover.py": "a failure charged long before a 10 s timeout",
    "test_namespaces.py": "freezes and kills instances in their namespaces, with bounds; two meshes",
    "test_planner_profile.py": "compares the decode throughput of two batch sizes",
    "test_mesh_parallel.py": "instances of two ranks each (eight engine processes); kills a rank, with a bound",
    "test_node_death.py": "kills two and four instances 0.1 s apart under 32 streams (eight workers in one mesh)",
}
"""Mesh modules kept out of the parallel run, and why (a timing bound a busy machine
could break)."""


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the tests of the SERIAL modules `serial`."""
    here = Path(__file__).parent
    for item in items:
        if item.path.parent == here and item.path.name in SERIAL:
            item.add_marker(pytest.mark.serial)
