"""Handing a KV cache's memory (its file descriptors) to a peer process over a unix
socket, so that the peer can map it from another PID namespace: another container or
pod on the same host, given a directory both see (a shared volume).

The owner listens on `<dir>/kv-<random>.sock` (mode 0600). A peer connects and sends
the secret that came with the cache's description (in the handoff, over the mesh's
credentialed NATS); the owner answers a JSON header and the descriptors (SCM_RIGHTS),
or closes the connection. A file descriptor names the memory itself, not a path or a
PID, so nothing here depends on the peer's namespaces. Torch-free.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import socket
import threading

log = logging.getLogger(__name__)

_MAX_HEADER = 1 << 16


class FdServer:
    """Serves `fds` (with `header`, JSON-able) to peers that know the secret, on a thread."""

    def __init__(self, directory: str, fds: list[int], header: dict) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"kv-{secrets.token_hex(8)}.sock")
        self.secret = secrets.token_hex(16)
        self._fds = list(fds)
        self._header = json.dumps(header).encode()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file is 0600 from its first moment
        try:
            self._sock.bind(self.path)
        finally:
            os.umask(old)
        self._sock.listen(16)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-fd-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(5.0)
                    asked = conn.recv(256).strip()
                    if not hmac.compare_digest(asked, self.secret.encode()):
                        log.warning("a peer asked for the KV cache's memory with a wrong secret")
                        continue
                    socket.send_fds(conn, [self._header], self._fds)
                except OSError as exc:
                    log.info("handing the KV cache's memory to a peer failed: %s", exc)

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def fetch_fds(path: str, secret: str, count: int, timeout_s: float = 5.0) -> tuple[dict, list[int]]:
    """The header and the `count` descriptors an FdServer at `path` hands out; OSError
    when it cannot be reached (another host, a dead owner) or answers otherwise."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(path)
        sock.sendall(secret.encode())
        data, fds, _, _ = socket.recv_fds(sock, _MAX_HEADER, max(count, 1))
    try:
        if len(fds) != count or not data:
            raise OSError(f"the KV cache's owner at {path} handed {len(fds)} descriptors, not {count}")
        try:
            return json.loads(data), fds
        except ValueError:
            raise OSError(f"the KV cache's owner at {path} answered no header") from None
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
