"""The NIXL data plane between a kvcache client and the service: for a client the
shared-memory segment (shm.py) cannot serve, because it runs in another
container, pod or node.

The client owns one landing buffer, made at its first Get and reused: anonymous
host memory registered with the process's NIXL agent (shared with the engine's
NIXL link where there is one: one agent per process). A Get names it (a
NixlTarget: the agent's name, metadata describing this buffer alone, its
address and size, and the agent's token); the service adds the metadata once
per agent name, reads and verifies the blocks from LMDB into staging memory of
its own and WRITEs them into the buffer, back to back (the placement rule of
shm.py, from the buffer's start), then announces each block `landed`: a block
the client saw landed has its bytes. gRPC carries the headers, the status and,
as ever, the credentials; UCX's data plane carries none.

What bounds the service:

- it only WRITEs, and only into [address, address + size) of the target: the
  offsets it picks are checked against the size here (`place`), and NIXL itself
  refuses a descriptor outside the memory the metadata describes (the client
  sends metadata of its landing buffer only, never of its KV cache);
- the first request naming an agent binds the agent's token to its name; a
  later request naming it with another token is refused, so one client cannot
  aim the service's writes at another client's buffer;
- metadata, sizes and names are bounded before NIXL sees them.

A buffer a call did not end cleanly on (an error, a timeout, a refusal: the
service may still be writing) is retired: deregistered at once, its memory kept
mapped for RETIRED_GRACE_S (so a late write lands in memory nobody uses) and
freed after; the next call makes a fresh one.
"""

import logging
import mmap
import re
import threading
import time
from dataclasses import dataclass

import numpy as np

from shared.kv.wire.nixl import TOKEN_BYTES, MemoryRegion, NixlAgent, Registration

log = logging.getLogger(__name__)

DEFAULT_NIXL_BYTES = 64 << 20
"""A client's landing buffer by default (kv_transfer.kvcache_nixl_bytes): 32 blocks of
2 MiB per Get; the service writes a Get in pieces of WRITE_BYTES as it reads them."""
DEFAULT_STAGING_BYTES = 256 << 20
"""The service's staging memory by default (kvcache.nixl_staging_bytes)."""
MIN_TARGET_BYTES = 1 << 20
MAX_TARGET_BYTES = 1 << 40
MAX_METADATA_BYTES = 64 << 10
"""A landing buffer's metadata is a few hundred bytes."""
MAX_AGENT_NAME = 200
_AGENT_NAME = re.compile(r"^[A-Za-z0-9._:@-]{1,200}$")
RETIRED_GRACE_S = 120.0
"""A retired buffer stays mapped this long: longer than a service's write may take
(kv_transfer.nixl_transfer_timeout_s, 30 s by default)."""


def valid_agent_name(name: str) -> bool:
    """A NIXL agent's name as a peer may send it (any reader of names off the network checks it)."""
    return bool(_AGENT_NAME.match(name))


class NixlRefused(Exception):
    """The service cannot use the target a request names (the message says why)."""


@dataclass(slots=True, frozen=True)
class TargetRef:
    """What a Get says about the client's landing buffer (the proto's NixlTarget)."""

    agent: str
    metadata: bytes
    address: int
    size: int
    token: bytes

    def check(self) -> None:
        """NixlRefused unless every field is within bounds."""
        if not valid_agent_name(self.agent):
            raise NixlRefused(f"agent name {self.agent[:80]!r} is not 1 to {MAX_AGENT_NAME} of [A-Za-z0-9._:@-]")
        if not 0 < len(self.metadata) <= MAX_METADATA_BYTES:
            raise NixlRefused(f"agent metadata of {len(self.metadata)} bytes, not 1 to {MAX_METADATA_BYTES}")
        if not MIN_TARGET_BYTES <= self.size <= MAX_TARGET_BYTES:
            raise NixlRefused(f"target size {self.size} outside [{MIN_TARGET_BYTES}, {MAX_TARGET_BYTES}]")
        if not 0 < self.address < (1 << 64) - self.size:
            raise NixlRefused(f"target address {self.address:#x} of {self.size} bytes does not fit 64 bits")
        if len(self.token) != TOKEN_BYTES:
            raise NixlRefused(f"token of {len(self.token)} bytes, not {TOKEN_BYTES}")


def check_target_bytes(size: int) -> None:
    if not MIN_TARGET_BYTES <= size <= MAX_TARGET_BYTES:
        raise ValueError(f"a kvcache NIXL landing buffer is {MIN_TARGET_BYTES} to {MAX_TARGET_BYTES} bytes, got "
                         f"{size} (kv_transfer.kvcache_nixl_bytes; kv_transfer.nixl off turns NIXL off)")


class LandingBuffer:
    """The client's side: host memory registered with the agent, described to the
    service by metadata of this buffer alone."""

    def __init__(self, agent: NixlAgent, size: int) -> None:
        check_target_bytes(size)
        self.size = size
        self._mmap = mmap.mmap(-1, size)  # page aligned; pages taken as first written
        self.buffer = memoryview(self._mmap)
        self.address = int(np.frombuffer(self.buffer, dtype=np.uint8).ctypes.data)
        self._agent = agent
        self._registration: Registration | None = agent.register([MemoryRegion(self.address, size, 0)], "DRAM")
        self.ref = TargetRef(agent.name, agent.metadata(only=self._registration), self.address, size, agent.token)

    def close(self, retired: bool) -> None:
        """Deregister; free the memory now, or (retired: the service may still write
        into it) after RETIRED_GRACE_S."""
        if self._registration is not None:
            self._agent.deregister(self._registration)
            self._registration = None
        if retired:
            _graveyard.bury(self._mmap)
        else:
            _unmap(self._mmap)


def _unmap(mapped: mmap.mmap) -> None:
    try:
        mapped.close()
    except BufferError:  # a batch's view of it lives on: freed with the last view
        pass


class _Graveyard:
    """Retired buffers, freed once their grace is over (checked at each burial)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buried: list[tuple[float, mmap.mmap]] = []

    def bury(self, mapped: mmap.mmap, grace_s: float = RETIRED_GRACE_S) -> None:
        now = time.monotonic()
        with self._lock:
            due = [m for t, m in self._buried if t <= now]
            self._buried = [(t, m) for t, m in self._buried if t > now] + [(now + grace_s, mapped)]
        for old in due:
            _unmap(old)

    def __len__(self) -> int:
        return len(self._buried)


_graveyard = _Graveyard()
