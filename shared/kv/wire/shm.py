"""The shared-memory data plane between a kvcache client and the service on one host.

The client owns one segment, made once and reused: an anonymous memory file
(memfd) named ``infermesh-kvshm-<random>``, sealed against shrinking and
growing, whose first page holds a header (magic, a random nonce, the size) and
whose data area follows. A Get names the segment and the service copies the
verified blocks straight from LMDB's buffer into it; a PutShm names blocks the
client copied in, and the service stores them from there. gRPC carries only the
headers and the status.

How the service opens it, and why that proves co-location:

- by ``/proc/<pid>/fd/<fd>`` only (the client's open memfd; no other path form is
  accepted, so a client's name can never make the service open a file of its
  choosing). The kernel lets a process open another's fd there only in the same
  PID namespace, for the same user; a service in another container (compose,
  Helm) sees no such process, or another one;
- the file it got must be a memfd of the mesh's name (read off its own fd, after
  opening: no race), a regular file of exactly the announced size, sealed
  against shrinking (so no truncation can turn the service's accesses into a
  SIGBUS), whose header holds the magic, the size and the nonce the request
  carries (compared in constant time).

Anything else raises ShmUnavailable with the reason; the service answers that,
and the client moves the bytes over gRPC instead (counted). Every offset the
service writes or reads is checked against the segment's size first.

A memfd needs no /dev/shm (docker gives containers 64 MiB of it) and leaves
nothing behind: its memory goes with the last process that maps it. The pages
are allocated as first touched, so a client pays for what it lands, at most
its segment's size.
"""

import fcntl
import hmac
import mmap
import os
import re
import stat
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

NAME_PREFIX = "infermesh-kvshm-"
MAGIC = b"IMKVSHM1"
NONCE_BYTES = 16
_HEADER = struct.Struct("<8s16sQ")  # magic, nonce, size
DATA_OFFSET = 4096
"""Where the data area starts: the header has the first page to itself."""
ALIGN = 64
"""Blocks are placed at multiples of this (a cache line): blocks whose size is a
multiple of it (every KV block) lie back to back, so a batch is one array."""
DEFAULT_SHM_BYTES = 256 << 20
"""A client's segment by default (kvcache.shm_bytes): 128 blocks of 2 MiB (an 8B
model's 16-token block) per batch."""
MIN_SEGMENT_BYTES = DATA_OFFSET + 4096
MAX_SEGMENT_BYTES = 1 << 40
_PROC_FD = re.compile(r"^/proc/([1-9][0-9]{0,9})/fd/([0-9]{1,9})$")
_MEMFD_LINK = re.compile(r"^/memfd:" + NAME_PREFIX + r"[0-9a-f]{16} \(deleted\)$")
MAX_OPEN_SEGMENTS = 64
"""Segments the service keeps mapped (one per client process); the least recently
used is dropped beyond it (its client's next call maps it again)."""


class ShmUnavailable(Exception):
    """The service cannot use the segment a request names (the message says why)."""


@dataclass(slots=True, frozen=True)
class SegmentRef:
    """What a request says about a segment (the proto's ShmSegment)."""

    path: str
    size: int
    nonce: bytes


def align(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def place(sizes: list[int], segment_size: int, start: int = DATA_OFFSET) -> list[int]:
    """Offsets (from the segment's start) of the leading blocks of these sizes that
    fit the data area, back to back at ALIGN; fewer than sizes when the rest do not fit.
    start: where the data area begins (a NIXL landing buffer has no header: 0)."""
    offsets: list[int] = []
    offset = start
    for size in sizes:
        if offset + size > segment_size:
            break
        offsets.append(offset)
        offset = align(offset + size)
    return offsets


def check_segment_bytes(size: int) -> None:
    if not MIN_SEGMENT_BYTES <= size <= MAX_SEGMENT_BYTES:
        raise ValueError(f"a kvcache shm segment is {MIN_SEGMENT_BYTES} to {MAX_SEGMENT_BYTES} bytes, got {size} "
                         "(kvcache.shm_bytes; 0 turns shared memory off)")


class Segment:
    """The client's side: the memfd, mapped, with its header written."""

    def __init__(self, size: int) -> None:
        check_segment_bytes(size)
        self.size = size
        self.nonce = os.urandom(NONCE_BYTES)
        name = NAME_PREFIX + os.urandom(8).hex()
        # CLOEXEC: a child process (the KV writer) must not inherit it.
        self._fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, size)
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._mmap = mmap.mmap(self._fd, size)
        except BaseException:
            os.close(self._fd)
            raise
        _HEADER.pack_into(self._mmap, 0, MAGIC, self.nonce, size)
        self.buffer = memoryview(self._mmap)
        """The whole segment (offsets in requests and replies count from its start)."""
        self.ref = SegmentRef(f"/proc/{os.getpid()}/fd/{self._fd}", size, self.nonce)

    def close(self) -> None:
        """Close the file: the service can no longer open it (and drops its mapping at
        its next prune). The mapping lives on while views of it exist."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class MappedSegment:
    """The service's side: a client's segment, checked and mapped."""

    def __init__(self, ref: SegmentRef) -> None:
        match = _PROC_FD.match(ref.path)
        if match is None:
            raise ShmUnavailable(f"segment path {ref.path[:80]!r} is not /proc/<pid>/fd/<fd>")
        if not MIN_SEGMENT_BYTES <= ref.size <= MAX_SEGMENT_BYTES:
            raise ShmUnavailable(f"segment size {ref.size} outside [{MIN_SEGMENT_BYTES}, {MAX_SEGMENT_BYTES}]")
        if len(ref.nonce) != NONCE_BYTES:
            raise ShmUnavailable(f"nonce of {len(ref.nonce)} bytes, not {NONCE_BYTES}")
        try:
            # Looked at before opening, so the service never opens a device or a fifo
            # (an open can have effects); checked again on the fd it got, below.
            if not _MEMFD_LINK.match(os.readlink(ref.path)) or not stat.S_ISREG(os.stat(ref.path).st_mode):
                raise ShmUnavailable(f"{ref.path} is not a kvcache segment")
            # NONBLOCK: should a fifo be swapped in meanwhile, it must not hang the opening thread.
            fd = os.open(ref.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError as exc:
            raise ShmUnavailable(f"cannot open {ref.path}: {exc.strerror} (another host or container?)") from None
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")  # what we opened, not what the path named a moment ago
            if not _MEMFD_LINK.match(link):
                raise ShmUnavailable(f"{ref.path} is not a kvcache segment ({link[:80]!r})")
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != ref.size:
                raise ShmUnavailable(f"{ref.path} holds {st.st_size} bytes, not the {ref.size} announced")
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if not seals & fcntl.F_SEAL_SHRINK:
                raise ShmUnavailable(f"{ref.path} is not sealed against shrinking")
            mapped = mmap.mmap(fd, ref.size)
        finally:
            os.close(fd)
        magic, nonce, size = _HEADER.unpack_from(mapped, 0)
        if magic != MAGIC or size != ref.size or not hmac.compare_digest(nonce, ref.nonce):
            mapped.close()
            raise ShmUnavailable(f"{ref.path}: the segment's header does not match the request's nonce")
        self.ref = ref
        self.identity = (st.st_dev, st.st_ino)
        self._mmap = mapped
        self.buffer = memoryview(mapped)

    def window(self, offset: int, num_bytes: int) -> memoryview:
        """The bytes [offset, offset + num_bytes) of the data area; ValueError outside it."""
        if offset < DATA_OFFSET or num_bytes < 0 or offset + num_bytes > self.ref.size:
            raise ValueError(f"bytes [{offset}, {offset + num_bytes}) outside the segment's data area "
                             f"[{DATA_OFFSET}, {self.ref.size})")
        return self.buffer[offset : offset + num_bytes]

    def alive(self) -> bool:
        """The client still holds the file open under the same fd."""
        try:
            st = os.stat(self.ref.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.identity


class SegmentCache:
    """The segments the service has mapped, by (path, nonce): a client's calls map
    its segment once. Any thread may call it."""

    def __init__(self, max_segments: int = MAX_OPEN_SEGMENTS) -> None:
        self.max_segments = max_segments
        self._segments: OrderedDict[tuple[str, bytes], MappedSegment] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, ref: SegmentRef) -> MappedSegment:
        key = (ref.path, bytes(ref.nonce))
        with self._lock:
            segment = self._segments.get(key)
            if segment is not None and segment.ref.size == ref.size:
                self._segments.move_to_end(key)
                return segment
        segment = MappedSegment(ref)  # raises ShmUnavailable
        with self._lock:
            self._segments[key] = segment
            while len(self._segments) > self.max_segments:
                self._segments.popitem(last=False)  # unmapped once no call uses it
        return segment

    def prune(self) -> int:
        """Drop the segments whose client closed them or died (their memory is freed
        once no call uses them). Returns how many were dropped."""
        with self._lock:
            segments = list(self._segments.items())
        dead = [key for key, segment in segments if not segment.alive()]
        with self._lock:
            for key in dead:
                self._segments.pop(key, None)
        return len(dead)

    def __len__(self) -> int:
        return len(self._segments)
