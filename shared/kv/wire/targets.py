"""Where a kvcache client's Gets land, and how its calls moved their data.

Three planes, tried in this order: the shared-memory segment (shm.py: the
service's host and PID namespace), the NIXL landing buffer (nixl_plane.py:
another container, pod or node), the gRPC byte stream (always). Each landing
place is made at first use and reused; a call on it that does not end cleanly
retires it (the service may still be writing it) and the next call makes a
fresh one; a place the service refuses is not tried again until reconnect()
(the service may have moved), and the refusal is counted. The client holds
one Targets; its counters are the client's `shm` and `nixl`.
"""

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

from shared.kv.wire.nixl import NixlAgent, agent_name
from shared.kv.wire.nixl_plane import LandingBuffer, check_target_bytes
from shared.kv.wire.shm import Segment, check_segment_bytes

log = logging.getLogger(__name__)

OnSegment = Callable[[memoryview], Callable[[], None] | None]
"""Called with a new segment's or landing buffer's whole memory (e.g. to pin it for
CUDA copies); may return the undo, called before it is retired."""
AgentFactory = Callable[[], NixlAgent]
"""The process's NIXL agent for the landing buffer (called once, in a thread, at the
first Get through NIXL); raises NixlUnavailable where NIXL cannot start."""


class Plane(enum.StrEnum):
    """How a Get's bytes reached the client (the worker's span attribute kv.kvcache_plane)."""

    SHM = "shm"
    NIXL = "nixl"
    STREAM = "stream"


@dataclass(slots=True)
class ShmCounters:
    """How this client's calls moved their data."""

    num_shm_calls: int = 0
    """Get and Put calls whose data went through the segment."""
    num_byte_calls: int = 0
    """Get and Put calls whose data went over the gRPC stream (whatever plane was refused)."""
    num_refused: int = 0
    """Times the service could not use the segment (the calls then went over the stream)."""
    num_retired: int = 0
    """Segments given up after a call on them did not end cleanly."""
    refused_because: str | None = None
    """The service's reason, while the client keeps to the stream (until reconnect())."""


@dataclass(slots=True)
class NixlCounters:
    """How this client's Gets used NIXL."""

    num_nixl_calls: int = 0
    """Gets some of whose blocks the service wrote into the landing buffer."""
    num_nixl_bytes: int = 0
    """Block bytes that arrived that way."""
    num_refused: int = 0
    """Times the service could not use the buffer, or its write failed (the blocks not
    landed then came over the stream), or no buffer could be made here."""
    num_retired: int = 0
    """Buffers given up after a call on them did not end cleanly (a refusal included)."""
    refused_because: str | None = None
    """Why, while the client keeps to the stream (until reconnect())."""


def own_agent() -> NixlAgent:
    """An agent of the client's own (where the process has none to share)."""
    return NixlAgent(agent_name("kvcache-client"))


class Targets:
    def __init__(self, shm_bytes: int, nixl_bytes: int, on_segment: OnSegment | None,
                 nixl_agent: AgentFactory | None) -> None:  # fmt: skip
        """shm_bytes, nixl_bytes: the places' sizes (0: that plane is off). nixl_agent:
        where the agent comes from (None: one of the client's own, closed with it)."""
        if shm_bytes:
            check_segment_bytes(shm_bytes)
        if nixl_bytes:
            check_target_bytes(nixl_bytes)
        self.shm_bytes = shm_bytes
        self.nixl_bytes = nixl_bytes
        self.shm = ShmCounters()
        self.nixl = NixlCounters()
        self._on_segment = on_segment
        self._agent_factory = nixl_agent or own_agent
        self._owns_agent = nixl_agent is None
        self._agent: NixlAgent | None = None
        self.segment: Segment | None = None
        self.segment_confirmed = False
        """The service said it can use the segment (a Get landed in it, or an empty PutShm)."""
        self.buffer: LandingBuffer | None = None
        self._undo: dict[Plane, Callable[[], None]] = {}

    def shm_usable(self) -> bool:
        return self.shm_bytes > 0 and self.shm.refused_because is None

    def nixl_usable(self) -> bool:
        return self.nixl_bytes > 0 and self.nixl.refused_because is None

    def get_plane(self) -> Plane:
        """The plane a Get tries now."""
        if self.shm_usable():
            return Plane.SHM
        return Plane.NIXL if self.nixl_usable() else Plane.STREAM

    def the_segment(self) -> Segment | None:
        """The segment, made at first use; None (and no shared memory until reconnect())
        when this host cannot make one."""
        if self.segment is None:
            try:
                self.segment = Segment(self.shm_bytes)
            except OSError as exc:
                self.refuse(Plane.SHM, f"no shared-memory segment here: {exc}")
                return None
            self._made(Plane.SHM, self.segment.buffer)
        return self.segment

    def the_buffer(self) -> LandingBuffer | None:
        """The NIXL landing buffer, made at first use (blocking: the agent may start
        now; call it in a thread); None (and no NIXL until reconnect()) when it cannot
        be made here."""
        if self.buffer is None:
            try:
                if self._agent is None:
                    self._agent = self._agent_factory()
                self.buffer = LandingBuffer(self._agent, self.nixl_bytes)
            except Exception as exc:  # NixlUnavailable, or NIXL refusing the registration
                self.refuse(Plane.NIXL, f"no NIXL landing buffer here: {type(exc).__name__}: {exc}")
                return None
            self._made(Plane.NIXL, self.buffer.buffer)
        return self.buffer

    def _made(self, plane: Plane, memory: memoryview) -> None:
        if self._on_segment is not None:
            undo = self._on_segment(memory)
            if undo is not None:
                self._undo[plane] = undo

    def refuse(self, plane: Plane, why: str) -> None:
        counters = self.shm if plane is Plane.SHM else self.nixl
        counters.num_refused += 1
        counters.refused_because = why
        log.info("kvcache plane %s unavailable (%s): using %s until reconnect()", plane.value, why,
                 self.get_plane().value)

    def retire(self, plane: Plane, counted: bool = True) -> None:
        """Give up the plane's landing place: the service may still be writing it."""
        undo = self._undo.pop(plane, None)
        if plane is Plane.SHM:
            segment, self.segment = self.segment, None
            self.segment_confirmed = False
            if segment is None:
                return
            if counted:
                self.shm.num_retired += 1
            if undo is not None:
                undo()
            segment.close()
            return
        buffer, self.buffer = self.buffer, None
        if buffer is None:
            return
        if counted:
            self.nixl.num_retired += 1
        if undo is not None:
            undo()
        buffer.close(retired=counted)

    def reset_refusals(self) -> None:
        self.shm.refused_because = None
        self.nixl.refused_because = None

    def close(self) -> None:
        self.retire(Plane.SHM, counted=False)
        self.retire(Plane.NIXL, counted=False)
        if self._agent is not None and self._owns_agent:
            self._agent.close()
        self._agent = None
