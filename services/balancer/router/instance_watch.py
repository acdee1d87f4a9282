"""Failover from the registry: which attempts' streams depend on which instance,
and which dispatches wait for an instance's Ack. When an instance leaves the
registry (missed heartbeats, a restart, its NATS connection closed) each is told
at once, rather than waiting for its stream or its request to time out."""

import asyncio

from services.balancer.router.failures import InstanceFailed
from services.balancer.router.registry import Instance, Registry
from shared.runtime.bus import StreamReader


class InstanceWatch:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._watchers: dict[str, set[StreamReader]] = {}
        """Per instance id, the streams of the attempts that depend on it."""
        self._leaving: dict[str, set[asyncio.Future[str]]] = {}
        """Per instance id, dispatches waiting for its Ack: told when it leaves."""
        registry.on_removed.append(self._on_instance_removed)

    def watch(self, reader: StreamReader, instance_id: str) -> None:
        """Fail reader's stream when the instance leaves (at once if it left while we dispatched)."""
        self._watchers.setdefault(instance_id, set()).add(reader)
        if self.registry.get(instance_id) is None:  # it left while we dispatched
            self._fail(reader, instance_id, "left the mesh")

    def unwatch(self, reader: StreamReader, instance_id: str) -> None:
        readers = self._watchers.get(instance_id)
        if readers is not None:
            readers.discard(reader)
            if not readers:
                del self._watchers[instance_id]

    def leaving(self, instance_id: str) -> asyncio.Future[str]:
        """A future set to why the instance left, when it does; forget it once answered."""
        gone: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._leaving.setdefault(instance_id, set()).add(gone)
        return gone

    def forget(self, instance_id: str, gone: asyncio.Future[str]) -> None:
        waiting = self._leaving.get(instance_id)
        if waiting is not None:
            waiting.discard(gone)
            if not waiting:
                del self._leaving[instance_id]

    def _on_instance_removed(self, inst: Instance, why: str) -> None:
        for reader in self._watchers.pop(inst.instance_id, set()):
            self._fail(reader, inst.instance_id, why)
        for gone in self._leaving.pop(inst.instance_id, set()):
            if not gone.done():
                gone.set_result(why)

    @staticmethod
    def _fail(reader: StreamReader, instance_id: str, why: str) -> None:
        reader.fail(InstanceFailed(f"instance {instance_id} {why}", instance_id, cause="left_mesh"))
