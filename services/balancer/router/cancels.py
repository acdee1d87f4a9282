"""Cancels: publish a request's cancel, which every worker applies, from a task of
its own (an attempt that ends unfinished, or a dispatch to an instance that left)."""

import asyncio
import logging

from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import Bus

log = logging.getLogger(__name__)


class Cancels:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._background: set[asyncio.Task] = set()

    def soon(self, request_id: str) -> None:
        """Publish the cancel from a task of its own: this may run while the
        request's task is being cancelled, where an await could be cut short."""
        task = asyncio.get_running_loop().create_task(self._cancel(request_id, "cancelled by the balancer"))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel(self, request_id: str, reason: str) -> None:
        try:
            await self.bus.publish(subjects.CANCEL, mesh_pb2.Cancel(request_id=request_id, reason=reason))
        except Exception:
            log.exception("could not publish the cancel of %s", request_id)
