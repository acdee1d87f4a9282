"""Two processes, one NIXL agent each, as two containers' services would hold them:
the reader READs the owner's registered host memory over UCX, with the UCX
environment a deployment file gives (UCX_TLS, UCX_NET_DEVICES, UCX_TCP_PORT_RANGE).
Agent metadata goes through a pipe here (NATS in the mesh). Bare NIXL, not the
project's connector: what the deployment files promise of the wheel and UCX.

    read_over_ucx(env) -> {"state", "intact", "notified", "owner_ports"}
"""

import multiprocessing as mp
import os
import time
from typing import Any

NUM_BYTES = 1 << 20
TIMEOUT_S = 30.0


def _listening_ports() -> set[int]:
    """TCP ports this process listens on (its sockets among /proc/self/net/tcp's LISTEN rows)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for row in list(f)[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def _agent(name: str, env: dict[str, str]) -> Any:
    os.environ.update(env)  # UCX reads its variables when the backend starts
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _owner(conn: Any, env: dict[str, str]) -> None:
    import numpy as np

    agent = _agent("owner", env)
    buf = np.arange(NUM_BYTES, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data, _listening_ports()))
    deadline, notes = time.monotonic() + TIMEOUT_S, {}
    while not notes and time.monotonic() < deadline:
        notes = agent.get_new_notifs()
        time.sleep(0.005)
    conn.send([m for messages in notes.values() for m in messages])


def _reader(conn: Any, env: dict[str, str]) -> None:
    import numpy as np

    agent = _agent("reader", env)
    metadata, address = conn.recv()
    dst = np.zeros(NUM_BYTES, dtype=np.uint8)
    agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    peer = agent.add_remote_agent(metadata)
    local = agent.get_xfer_descs(np.array([[dst.ctypes.data, NUM_BYTES, 0]], dtype=np.uint64), "DRAM")
    remote = agent.get_xfer_descs(np.array([[address, NUM_BYTES, 0]], dtype=np.uint64), "DRAM")
    handle = agent.initialize_xfer("READ", local, remote, peer, b"lease-end")
    state, deadline = agent.transfer(handle), time.monotonic() + TIMEOUT_S
    while state not in ("DONE", "ERR") and time.monotonic() < deadline:
        time.sleep(0.001)
        state = agent.check_xfer_state(handle)
    conn.send((state, bool(np.array_equal(dst, np.arange(NUM_BYTES, dtype=np.uint8)))))


def read_over_ucx(owner_env: dict[str, str], reader_env: dict[str, str]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    owner_conn, owner_end = ctx.Pipe()
    reader_conn, reader_end = ctx.Pipe()
    procs = [ctx.Process(target=_owner, args=(owner_end, owner_env), daemon=True),
             ctx.Process(target=_reader, args=(reader_end, reader_env), daemon=True)]
    for p in procs:
        p.start()

    def answer(conn: Any, proc: Any, what: str) -> Any:
        deadline = time.monotonic() + TIMEOUT_S * 2
        while not conn.poll(0.1):
            assert proc.is_alive(), f"{what}: the process exited with {proc.exitcode} (its stderr says why)"
            assert time.monotonic() < deadline, f"{what}: no answer in {TIMEOUT_S * 2:.0f}s"
        return conn.recv()

    try:
        metadata, address, ports = answer(owner_conn, procs[0], "the owner's NIXL agent")
        reader_conn.send((metadata, address))
        state, intact = answer(reader_conn, procs[1], "the reader's READ")
        notified = answer(owner_conn, procs[0], "the owner's notification")
        return {"state": state, "intact": intact, "notified": notified, "owner_ports": ports}
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
