"""An instance's heartbeats: what registers it with the balancer and keeps it there.

Every stage that takes work from the balancer (prefill and decode through
shared/stage/worker.py, vision through services/vision/service.py) beats the same
way, so it is written once here: a beat every worker.heartbeat_interval_s with a
rising seq, the time, the model and the interval, and the sender's NATS connection
as a header (a disconnect advisory naming another connection, closed before a
reconnect, does not make the balancer drop this instance); a beat at once when NATS
comes back; a failed publish logged and counted, never raised (NATS down: the
next beat retries; the first failure of a run of them is a warning with its cause,
the rest debug lines, and the first beat through again says how many failed). What
differs by stage is data: its load, whether it drains, the image identities its
cache holds (``BeatState``), and, for the engine stages, a duty after each beat."""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import CONNECTION_HEADER, Bus
from shared.runtime.service import ServiceContext

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BeatState:
    """What a stage says of itself in one beat."""

    load: mesh_pb2.Load
    draining: bool
    image_hashes: Sequence[bytes] = ()
    """A vision instance's cached image identities (the balancer's affinity); none elsewhere."""


@dataclass(frozen=True, slots=True)
class BeatIdentity:
    """Who beats, as every beat says it."""

    stage: str
    instance_id: str
    model: str
    interval_s: float

    @classmethod
    def of(cls, ctx: ServiceContext) -> "BeatIdentity":
        """The service's own: its stage, instance, model and worker.heartbeat_interval_s."""
        settings = ctx.settings
        return cls(ctx.stage, ctx.instance_id, settings.engine.model, settings.worker.heartbeat_interval_s)


class Heartbeats:
    """The beats of one instance on ``bus``. ``state`` is read at every beat (it may
    update the stage's gauges as it goes); ``after_beat`` runs after each periodic beat,
    its failures logged so that the beats go on."""

    def __init__(
        self, bus: Bus, identity: BeatIdentity, state: Callable[[], BeatState],
        after_beat: Callable[[], Awaitable[None]] | None = None,
    ) -> None:  # fmt: skip
        self.bus = bus
        self.identity = identity
        self.state = state
        self.after_beat = after_beat
        self.seq = 0
        self.registered = False
        """A beat reached NATS: the balancer can know this instance (readiness waits for it)."""
        self.num_failed = 0
        """Beats whose publish failed since the last that went through."""
        self._beats: set[asyncio.Task] = set()

    def start(self) -> asyncio.Task:
        """Beat on reconnects and every interval from now; the loop's task, which the
        owner cancels when it stops."""
        self.bus.on_reconnected.append(self._beat_now)
        return asyncio.create_task(self._loop(), name="heartbeat")

    async def send(self) -> None:
        """One beat now (a drain says so at once)."""
        self.seq += 1
        me, state = self.identity, self.state()
        hb = mesh_pb2.Heartbeat(
            stage=me.stage, instance_id=me.instance_id, seq=self.seq, unix_time=time.time(), load=state.load,
            model=me.model, interval_s=me.interval_s, draining=state.draining, image_hashes=state.image_hashes,
        )  # fmt: skip
        headers = {CONNECTION_HEADER: self.bus.connection_id()}
        subject = subjects.heartbeat(me.stage, me.instance_id)
        try:
            await self.bus.publish(subject, hb, headers=headers)
        except Exception as exc:  # NATS down: the next beat retries; say so once per outage, not every beat
            self.num_failed += 1
            if self.num_failed == 1:
                log.warning("%s: heartbeat %d not published on %s (retrying every %.1f s): %r",
                            me.instance_id, self.seq, subject, me.interval_s, exc)
            else:
                log.debug("%s: heartbeat %d not published either: %r", me.instance_id, self.seq, exc)
            return
        if self.num_failed:
            log.warning("%s: heartbeats published again after %d failed", me.instance_id, self.num_failed)
            self.num_failed = 0
        self.registered = True

    def _beat_now(self) -> None:
        """A beat at once (NATS is back: say which connection is ours now)."""
        task = asyncio.get_running_loop().create_task(self.send())
        self._beats.add(task)
        task.add_done_callback(self._beats.discard)

    async def _loop(self) -> None:
        while True:
            await self.send()
            if self.after_beat is not None:
                try:
                    await self.after_beat()
                except Exception:  # the beats go on; the duty's failure is not hidden
                    log.exception("%s: the duty after a heartbeat failed", self.identity.instance_id)
            await asyncio.sleep(self.identity.interval_s)
