"""The balancer's view of the mesh: live instances per stage (from heartbeats)
and which KV blocks each worker holds in memory (from its block events).

An instance that misses `misses` heartbeats in a row is dropped; a draining
one stays known but gets no new work. `in_flight` counts what this balancer
sent an instance since its last heartbeat, so that a burst between two
heartbeats does not all land on the instance that looked idlest.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.kv.block_hash import BlockHash
from shared.proto import mesh_pb2


@dataclass(slots=True)
class Instance:
    stage: str
    instance_id: str
    load: mesh_pb2.Load
    last_seen: float
    interval_s: float
    draining: bool = False
    in_flight: int = 0
    blocks: set[BlockHash] = field(default_factory=set)


class Registry:
    def __init__(self, misses: int = 3, clock: Callable[[], float] = time.monotonic) -> None:
        self.misses = misses
        self.clock = clock
        self._instances: dict[str, Instance] = {}
        self._kv_seq: dict[str, int] = {}
        self.num_dropped = 0

    def on_heartbeat(self, hb: mesh_pb2.Heartbeat) -> None:
        inst = self._instances.get(hb.instance_id)
        now = self.clock()
        if inst is None:
            inst = Instance(hb.stage, hb.instance_id, hb.load, now, hb.interval_s or 1.0)
            self._instances[hb.instance_id] = inst
        inst.load = hb.load
        inst.last_seen = now
        inst.interval_s = hb.interval_s or 1.0
        inst.draining = hb.draining
        inst.in_flight = 0  # the heartbeat's figures now include what we sent

    def on_kv_event(self, ev: mesh_pb2.KvEvent) -> None:
        inst = self._instances.get(ev.instance_id)
        if ev.cleared:
            self._kv_seq[ev.instance_id] = ev.seq
            if inst is not None:
                inst.blocks.clear()
        if inst is None:
            return  # events of an instance we have not heard from yet: its heartbeat comes first
        inst.blocks.difference_update(BlockHash(h) for h in ev.removed)
        inst.blocks.update(BlockHash(h) for h in ev.stored)

    def _expire(self) -> None:
        now = self.clock()
        dead = [i for i, inst in self._instances.items() if now - inst.last_seen > self.misses * inst.interval_s]
        for instance_id in dead:
            del self._instances[instance_id]
            self.num_dropped += 1

    def live(self, stage: str) -> list[Instance]:
        """Instances of the stage that take new work."""
        self._expire()
        return [i for i in self._instances.values() if i.stage == stage and not i.draining]

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def counts(self) -> dict[str, int]:
        self._expire()
        out: dict[str, int] = {}
        for inst in self._instances.values():
            if not inst.draining:
                out[inst.stage] = out.get(inst.stage, 0) + 1
        return out
