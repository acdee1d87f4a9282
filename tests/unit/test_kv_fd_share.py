"""A KV cache's memory handed to a peer in another PID namespace (another container on
the host) over a unix socket in a directory both see (kv_share_dir,
shared/kv/memory/fd_passing.py): the peer maps the owner's very memory, not a copy;
without the socket, or with a wrong secret, a /proc path from another namespace is
refused, never read as KV. Needs `unshare --pid` (root, as CI runs); skips without."""

import json
import os
import subprocess
import sys

import pytest
import torch

from shared.kv.memory.fd_passing import FdServer, fetch_fds
from shared.kv.memory.share import open_peer

OWNER = """
import sys, torch
from shared.kv.memory.share import SharedMemoryAllocator, describe
alloc = SharedMemoryAllocator(share_dir=sys.argv[1])
a, b = alloc((1, 2, 4, 8), torch.float32), alloc((3, 5), torch.float32)
a.fill_(7.0); b.fill_(2.0)
sys.stdout.write(describe([a, b], alloc, "float32:1x2x4x8").decode() + "\\n")
sys.stdout.flush()
sys.stdin.readline()  # the peer mapped it: write where it can see
a[0, 0, 0, 0] = 42.0
sys.stdout.write("written\\n")
sys.stdout.flush()
sys.stdin.readline()
"""

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]


def _unshare_allowed() -> bool:
    try:
        return subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_unshare = pytest.mark.skipif(not _unshare_allowed(), reason="unshare --pid is refused here (not root?)")


@pytest.fixture
def owner(tmp_path):
    """A cache owner in a PID namespace of its own, with its description."""
    share = tmp_path / "share"
    proc = subprocess.Popen([*UNSHARE, sys.executable, "-c", OWNER, str(share)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
    try:
        yield proc, proc.stdout.readline().encode()
    finally:
        proc.kill()
        proc.wait(10)


@needs_unshare
def test_a_peer_in_another_pid_namespace_maps_the_owners_memory_through_the_socket(owner):
    proc, description = owner
    desc = json.loads(description)
    # What a peer in another PID namespace would try alone: the owner's /proc/<its pid>/fd/<fd>,
    # which names some other process's file here (or nothing).
    assert os.stat(desc["socket"]).st_mode & 0o777 == 0o600
    alone = json.dumps({k: v for k, v in desc.items() if k not in ("socket", "secret")}).encode()
    with pytest.raises(ValueError):
        open_peer(alone, torch.device("cpu"))
    layout, (a, b) = open_peer(description, torch.device("cpu"))
    assert layout == "float32:1x2x4x8" and a.shape == (1, 2, 4, 8) and b.shape == (3, 5)
    assert float(a.sum()) == 7.0 * 64 and float(b.sum()) == 2.0 * 15
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "written\n"
    assert float(a[0, 0, 0, 0]) == 42.0  # the same memory, not a copy


@needs_unshare
def test_a_wrong_secret_gets_no_memory(owner):
    _, description = owner
    desc = json.loads(description)
    with pytest.raises(OSError):
        fetch_fds(desc["socket"], "0" * 32, 2)
    forged = json.dumps({**desc, "secret": "f" * 32}).encode()
    with pytest.raises(ValueError):
        open_peer(forged, torch.device("cpu"))


def test_the_server_hands_its_descriptors_and_leaves_no_socket(tmp_path):
    r, w = os.pipe()
    server = FdServer(str(tmp_path), [w], {"kind": "shm", "n": 1})
    try:
        header, (fd,) = fetch_fds(server.path, server.secret, 1)
        assert header == {"kind": "shm", "n": 1}
        os.write(fd, b"hi")  # the pipe's very write end
        os.close(fd)
        assert os.read(r, 2) == b"hi"
        with pytest.raises(OSError, match="2 descriptors|not 2"):
            fetch_fds(server.path, server.secret, 2)
    finally:
        server.close()
        os.close(r)
        os.close(w)
    assert not os.path.exists(server.path)
    with pytest.raises(OSError):
        fetch_fds(server.path, server.secret, 1)
