"""The balancer's view of the mesh: live instances per stage (from heartbeats)
and which KV blocks each worker holds in memory (from its block events).

An instance that misses `misses` heartbeats in a row is dropped; a draining
one stays known but gets no new work. `in_flight` counts what this balancer
sent an instance since its last heartbeat, so that a burst between two
heartbeats does not all land on the instance that looked idlest.

Trust: a heartbeat is a claim. Its interval decides how long the instance
counts as alive, so the claim is bounded: above max_interval_s (or not a finite
positive number) the heartbeat is refused and counted, below MIN_INTERVAL_S it
is read as MIN_INTERVAL_S. A heartbeat whose seq goes back names a new process
under the old id (a restart): the old one's requests are gone with it, so it
leaves (its requests fail over) and the new one joins. Whoever watches
`on_removed` hears each instance that leaves, the moment the registry notices
(`sweep`, run every SWEEP_INTERVAL_S by the service): the orchestrator moves
that instance's requests at once instead of waiting for their streams to time out.

Silent and gone are two steps. A silent instance gets no new work (`live`
leaves it out); only `sweep` removes it, which the service runs after reading
what NATS already delivered, so a balancer whose own loop lags behind its
heartbeats does not fail over instances that are fine. A stream chunk that
passed the balancer's checks is proof of life too (`touch`): a decode instance
busy streaming is not dropped because its heartbeat came late.

A death needs no sweep: when a worker's NATS connection closes, the balancer
hears nats-server's advisory and the instance leaves at once (`leave`, see
services/balancer/router/departures.py), well before its heartbeats are missed.

The balancer's own outage is not its instances' death. While its NATS
connection is down it hears no heartbeat from anyone, so silence then says
nothing: `pause()` (called when the connection drops) stops the clock — no
instance is silent, `sweep` drops none, and a disconnect advisory makes none
leave (`accepts_departures`). `resume(grace_s)` (when it is back) counts
silence again from the reconnect plus grace_s, which gives the workers time to
reconnect themselves and beat again: an instance is dropped only after
grace_s + misses intervals without a heartbeat from the reconnect on. Departures
are heard again after the grace too. An advisory counts only for the connection
the instance beats on: each heartbeat names it (a header, see bus.CONNECTION_HEADER),
so the close of a connection the instance has since replaced (it reconnected, and
the server noticed the old one only later) makes nobody leave.

Names are checked against subjects: a heartbeat or KV event arrives on a subject
that names its instance (`im.heartbeat.<stage>.<instance>`, which only that
instance may publish under `infermesh up`); one whose body names another
instance is refused and counted ("instance_mismatch").
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.kv.block_hash import BlockHash
from shared.proto import mesh_pb2
from shared.runtime.subjects import check_token

MIN_INTERVAL_S = 0.05
"""A claimed heartbeat interval below this is read as this (a dead instance is
then noticed no sooner than misses * 50 ms)."""
SWEEP_INTERVAL_S = 0.1
"""How often the service looks for silent instances."""
STAGES = ("prefill", "decode", "vision")


@dataclass(slots=True)
class Instance:
    stage: str
    instance_id: str
    load: mesh_pb2.Load
    last_seen: float
    interval_s: float
    draining: bool = False
    in_flight: int = 0
    in_flight_tokens: int = 0
    """Prompt tokens of the requests in in_flight (a prefill instance's queue grows by them)."""
    blocks: set[BlockHash] = field(default_factory=set)
    seq: int = 0
    """The last heartbeat's seq (0: unnumbered)."""
    num_beats: int = 0
    """Heartbeats taken from this process: what was reserved on it before the last one is in its figures."""
    connection: str = ""
    """The NATS connection its last heartbeat came on (`<server id>/<client id>`; "": not said)."""
    images: frozenset[bytes] = frozenset()
    """A vision instance's embedding cache, by image identity (its last heartbeat's)."""


Removed = Callable[[Instance, str], None]
"""(instance, why): an instance left the registry."""


class Registry:
    def __init__(
        self, misses: int = 3, clock: Callable[[], float] = time.monotonic, max_interval_s: float = 5.0
    ) -> None:
        self.misses = misses
        self.clock = clock
        self.max_interval_s = max_interval_s
        self._instances: dict[str, Instance] = {}
        self._kv_seq: dict[str, int] = {}
        """Per instance, the sequence number of its last KV event taken."""
        self.num_kv_event_gaps = 0
        """KV events that did not follow their instance's last one (some were lost):
        its block view may be off until its next snapshot (shared/kv/events.py)."""
        self.num_dropped = 0
        self.num_refused: dict[str, int] = {}
        """Heartbeats refused, by reason."""
        self.on_removed: list[Removed] = []
        self.on_beat: list[Callable[[Instance], None]] = []
        """Called with the instance after each heartbeat taken."""
        self._paused = False
        self._quiet_until = -math.inf
        """Silence before this (monotonic) does not count: the balancer's own outage and its grace."""
        self.num_pauses = 0
        self.num_departures_ignored = 0
        """Disconnect advisories not acted on: heard while paused or in the grace after,
        or naming a connection the instance no longer beats on."""

    def pause(self) -> None:
        """The balancer's NATS connection is down: nobody counts as silent, nobody leaves."""
        if not self._paused:
            self._paused = True
            self.num_pauses += 1

    def resume(self, grace_s: float) -> None:
        """The connection is back: silence counts again from now + grace_s."""
        self._paused = False
        self._quiet_until = max(self._quiet_until, self.clock() + grace_s)

    @property
    def paused(self) -> bool:
        """Down, or in the grace after: silence and departures say nothing yet."""
        return self._paused or self.clock() < self._quiet_until

    def accepts_departures(self) -> bool:
        """Whether a disconnect advisory may make an instance leave now (not while paused)."""
        if self.paused:
            self.num_departures_ignored += 1
            return False
        return True

    def on_heartbeat(
        self, hb: mesh_pb2.Heartbeat, stage: str | None = None, instance_id: str | None = None,
        connection: str | None = None,
    ) -> str | None:
        """Take a heartbeat (stage, instance_id: those its subject names; connection: the
        NATS connection it names in its header); why it was refused, or None."""
        reason = self._refusal(hb, stage)
        if reason is None and instance_id is not None and hb.instance_id != instance_id:
            reason = "instance_mismatch"
        if reason is not None:
            self._count_refusal(reason)
            return reason
        interval = max(hb.interval_s or 1.0, MIN_INTERVAL_S)
        inst = self._instances.get(hb.instance_id)
        if inst is not None and ((hb.seq and hb.seq <= inst.seq) or hb.stage != inst.stage):
            self._remove(inst, "restarted")  # a new process under the old id: the old one's work is gone
            inst = None
        now = self.clock()
        if inst is None:
            inst = Instance(hb.stage, hb.instance_id, hb.load, now, interval)
            self._instances[hb.instance_id] = inst
        inst.load = hb.load
        inst.last_seen = now
        inst.interval_s = interval
        inst.draining = hb.draining
        inst.seq = hb.seq or inst.seq
        inst.images = frozenset(bytes(h) for h in hb.image_hashes)
        if connection:
            inst.connection = connection
        inst.in_flight = 0  # the heartbeat's figures now include what we sent
        inst.in_flight_tokens = 0
        inst.num_beats += 1
        for callback in self.on_beat:
            callback(inst)
        return None

    def _refusal(self, hb: mesh_pb2.Heartbeat, stage: str | None) -> str | None:
        if hb.stage not in STAGES or (stage is not None and hb.stage != stage):
            return "stage"
        try:
            check_token(hb.instance_id)
        except ValueError:
            return "instance_id"
        if not math.isfinite(hb.interval_s) or hb.interval_s < 0 or hb.interval_s > self.max_interval_s:
            return "interval"
        return None

    def _count_refusal(self, reason: str) -> None:
        self.num_refused[reason] = self.num_refused.get(reason, 0) + 1

    def on_kv_event(self, ev: mesh_pb2.KvEvent, instance_id: str | None = None) -> str | None:
        """Take a worker's block events (instance_id: the one its subject names); why refused, or None."""
        if instance_id is not None and ev.instance_id != instance_id:
            self._count_refusal("kv_instance_mismatch")
            return "kv_instance_mismatch"
        self._apply_kv_event(ev)
        return None

    def _apply_kv_event(self, ev: mesh_pb2.KvEvent) -> None:
        inst = self._instances.get(ev.instance_id)
        last = self._kv_seq.get(ev.instance_id)
        if not ev.cleared and last is not None and ev.seq != last + 1:
            self.num_kv_event_gaps += 1
        self._kv_seq[ev.instance_id] = ev.seq
        if ev.cleared and inst is not None:  # a snapshot follows: it replaces the view
            inst.blocks.clear()
        if inst is None:
            return  # events of an instance we have not heard from yet: its heartbeat comes first
        inst.blocks.difference_update(BlockHash(h) for h in ev.removed)
        inst.blocks.update(BlockHash(h) for h in ev.stored)

    def _remove(self, inst: Instance, why: str) -> None:
        if self._instances.get(inst.instance_id) is not inst:
            return
        del self._instances[inst.instance_id]
        self._kv_seq.pop(inst.instance_id, None)
        self.num_dropped += 1
        for callback in self.on_removed:
            callback(inst, why)

    def leave(self, instance_id: str, why: str) -> Instance | None:
        """The instance is gone (its process died): drop it now; returns it, or None if unknown."""
        inst = self._instances.get(instance_id)
        if inst is not None:
            self._remove(inst, why)
        return inst

    def touch(self, instance_id: str) -> None:
        """The instance was heard from (a checked stream chunk): it is alive."""
        inst = self._instances.get(instance_id)
        if inst is not None:
            inst.last_seen = max(inst.last_seen, self.clock())

    def _silent(self, inst: Instance, now: float) -> bool:
        if self._paused:
            return False
        return now - max(inst.last_seen, self._quiet_until) > self.misses * inst.interval_s

    def silent(self) -> list[Instance]:
        """The instances silent for more than `misses` intervals (not removed yet)."""
        now = self.clock()
        return [inst for inst in self._instances.values() if self._silent(inst, now)]

    def sweep(self) -> list[Instance]:
        """Drop the instances silent for more than `misses` intervals; returns them."""
        dead = self.silent()
        for inst in dead:
            self._remove(inst, f"missed {self.misses} heartbeats")
        return dead

    def live(self, stage: str, include_silent: bool = False) -> list[Instance]:
        """Instances of the stage that take new work: neither draining nor silent
        (include_silent: silent ones too, as long as the registry keeps them)."""
        now = self.clock()
        return [i for i in self._instances.values()
                if i.stage == stage and not i.draining and (include_silent or not self._silent(i, now))]

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def counts(self) -> dict[str, int]:
        now = self.clock()
        out: dict[str, int] = {}
        for inst in self._instances.values():
            if not inst.draining and not self._silent(inst, now):
                out[inst.stage] = out.get(inst.stage, 0) + 1
        return out
