"""Recovery from a NATS outage (the server restarted, the balancer's link dropped).

An outage is nobody's fault and loses whatever was in flight: chunks the server
held when it died, and those a worker that reconnected before the balancer sent
to nobody. The registry does not read the balancer's own outage as every
instance's death (registry.py); here, a stream that misses a seq while later
ones come, or says nothing for a while once the bus is back (LOST_AFTER_S,
LOST_BEFORE_FIRST_S), counts as lost and moves like a failure (cause "lost"),
charged to nobody. Requests that arrive while the bus is down, or find no
instance that answers while it recovers, wait for it and retry (up to
OUTAGE_WAIT_S) instead of failing. A handoff that decode did not take while the
bus recovers is the same case one hop later (decode may not be back on the bus
yet: each service reconnects in its own time, and prefill's "no responders" comes
at once): the request waits a moment and moves, uncounted, up to OUTAGE_WAIT_S
(handoff_retry). Other moves while the bus recovers do not count against
migration_limit: up to OUTAGE_MOVES are allowed on top (migration.py).
"""

import asyncio
import time

from opentelemetry.trace import Span

from services.balancer.generation import GenerationError
from services.balancer.router.registry import Instance, Registry
from services.balancer.router.route import Route
from shared.runtime.bus import Bus, StreamReader

LOST_AFTER_S = 2.0
"""Once the bus is back, a stream that had started must say something within this
(a decode instance streams every step; its reconnect may trail ours by a reconnect
wait, 0.5 s), else it is lost: its last chunks, the final one maybe, died with the server."""
LOST_BEFORE_FIRST_S = 10.0
"""The same for a request that had no chunk yet: it may be queued in prefill, and
a handoff lost in the outage is reported by prefill only after its request timeout.
Sooner when its prefill instance says, in a heartbeat after the outage, that it
has nothing running nor waiting: then the request is past prefill, and decode,
which streams the first token as soon as it takes a request, gets LOST_AFTER_S."""
OUTAGE_WAIT_S = 10.0
"""How long a request waits for the bus to come back, or for an instance that
answers while it recovers, before it fails with 503."""
OUTAGE_WINDOW_S = 10.0
"""How long after the bus came back a failure is still counted as the outage's."""
OUTAGE_MOVES = 2
"""Moves a request may make, on top of migration_limit, while the bus recovers."""


class OutageRecovery:
    def __init__(self, bus: Bus, registry: Registry) -> None:
        self.bus = bus
        self._streaming: dict[StreamReader, Route] = {}
        """The streams of dispatched attempts: checked for losses when the bus comes back."""
        registry.on_beat.append(self._on_beat)
        bus.on_reconnected.append(self._on_bus_reconnected)

    def track(self, reader: StreamReader, route: Route) -> None:
        """A dispatched attempt's stream: expected to speak soon after the bus comes back."""
        self._streaming[reader] = route

    def untrack(self, reader: StreamReader) -> None:
        self._streaming.pop(reader, None)

    def recovering(self) -> bool:
        """The bus is down, or came back less than OUTAGE_WINDOW_S ago."""
        bus = self.bus
        back = bus.reconnected_at
        return bus.down_since is not None or (back is not None and time.monotonic() - back < OUTAGE_WINDOW_S)

    def _on_bus_reconnected(self) -> None:
        """The bus is back: whatever was in flight may be gone. Every dispatched stream
        must now say something soon, or it moves."""
        now = time.monotonic()
        for reader in self._streaming:
            reader.expect_by(now + (LOST_AFTER_S if reader.started else LOST_BEFORE_FIRST_S))

    def _on_beat(self, inst: Instance) -> None:
        """An idle prefill instance after an outage: the requests it had that have not
        started streaming are past it (with decode, or lost): LOST_AFTER_S for them."""
        if inst.stage != "prefill" or inst.load.num_running or inst.load.num_waiting:
            return
        deadline = time.monotonic() + LOST_AFTER_S
        for reader, route in self._streaming.items():
            if route.prefill == inst.instance_id and reader.expecting and not reader.started:
                reader.expect_by(deadline)

    async def wait_for_bus(self, span: Span) -> None:
        """Wait for the bus, when it is down, up to OUTAGE_WAIT_S; 503 if it is not back."""
        if self.bus.connected:
            return
        span.add_event("wait_for_bus")
        if not await self.bus.wait_connected(OUTAGE_WAIT_S):
            raise GenerationError("The mesh's message bus is down; retry later.", status=503)

    async def handoff_retry(self, first_failed: float, span: Span) -> bool:
        """A handoff decode did not take, the request's first such since first_failed
        (monotonic): while the bus recovers and for OUTAGE_WAIT_S from then, wait a
        moment and say to move it again without counting the move; else False.
        Without the wait, a prefill that is back before decode fails each handoff in
        milliseconds, and a request burns every move it has before decode reconnects."""
        return await self.retry(first_failed + OUTAGE_WAIT_S, span)

    async def retry(self, deadline: float, span: Span) -> bool:
        """While the bus recovers and before the deadline: wait a moment (and for the bus)
        and say to try again; else False (no instance: fail as usual)."""
        if not self.recovering() or time.monotonic() >= deadline:
            return False
        span.add_event("outage_retry")
        await asyncio.sleep(0.2)
        await self.wait_for_bus(span)
        return True
