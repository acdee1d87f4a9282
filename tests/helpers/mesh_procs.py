"""Real processes for integration tests: a nats-server and InferMesh services,
each on free ports, stopped (SIGTERM, then SIGKILL) when the test ends."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tools.launch.trace_view import request_span
from tools.launch.up import find_nats_server, free_port

ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""


def wait_for_port(port: int, timeout_s: float = 10.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port} after {timeout_s}s")


class NatsServer:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [find_nats_server(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(workdir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, proc=self.proc)

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def start_service(stage: str, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """`python -m services.<stage>` with the given INFERMESH_* environment."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    log = log_path.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", f"services.{stage}"], cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT
    )


def span_attributes(trace_dir: Path, request_id: str, name: str, timeout_s: float = 30.0) -> dict:
    """The attributes of the span `name` in a request's trace, once written (a test failure if it never is)."""
    try:
        return request_span(trace_dir, request_id, name, timeout_s)
    except LookupError as exc:
        raise AssertionError(str(exc)) from None


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets pid listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                hex_addr, hex_port = cols[1].split(":")
                if width == 8:
                    addr = ".".join(str(b) for b in reversed(bytes.fromhex(hex_addr)))
                else:
                    raw = b"".join(bytes.fromhex(hex_addr[i:i + 8])[::-1] for i in range(0, 32, 8))
                    if raw[:12] == bytes(10) + b"\xff\xff":  # ::ffff:a.b.c.d, IPv4 on a dual-stack socket
                        addr = ".".join(str(b) for b in raw[12:])
                    else:
                        addr = "::1" if raw == bytes(15) + b"\x01" else raw.hex()
                found.append((addr, int(hex_port, 16)))
    return found
