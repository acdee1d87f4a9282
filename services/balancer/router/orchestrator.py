"""The mesh as a Generator: route a request to a prefill and a decode
instance, dispatch it over NATS, and turn the decode instance's token stream
into TokenEvents. MeshGenerator composes the parts, one file each:

  migration.py       the loop over attempts: a request that an instance fails after
                     accepting it moves, with its tokens so far, to other instances;
  attempt.py         one attempt: dispatch, then the stream, each failure charged to
                     the instance at fault;
  dispatch.py        choosing the instances (policies.py) and handing the request over,
                     retrying prefill instances that refuse or do not answer;
  reservations.py    the load a choice adds to an instance until its next heartbeat;
  instance_watch.py  failover from the registry: an instance that leaves fails its
                     attempts at once;
  outage.py          recovery from a NATS outage: lost streams move, charged to nobody,
                     and requests wait for the bus;
  cancels.py         the cancel every worker applies when an attempt ends unfinished.

Nothing waits forever. Errors that reach the client say what happened, never
where (no instance addresses or worker messages): those go to the log and the
trace.
"""

import random
from collections.abc import AsyncIterator

from opentelemetry.trace import Span, Tracer

from services.balancer.generation import GenerationRequest, TokenEvent, refuse_images
from services.balancer.router.attempt import Attempts
from services.balancer.router.cancels import Cancels
from services.balancer.router.dispatch import Dispatcher
from services.balancer.router.instance_watch import InstanceWatch
from services.balancer.router.migration import MigrationLoop
from services.balancer.router.outage import OutageRecovery
from services.balancer.router.registry import Registry
from shared.proto import mesh_pb2
from shared.runtime.bus import Bus
from shared.runtime.metrics import Metrics
from shared.runtime.settings import BalancerSettings


class MeshGenerator:
    def __init__(
        self,
        bus: Bus,
        registry: Registry,
        tracer: Tracer,
        settings: BalancerSettings,
        block_size: int,
        kv_fingerprint: str,
        rng: random.Random | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        metrics = metrics or Metrics("balancer")
        self._in_flight = 0
        watch = InstanceWatch(registry)
        outage = OutageRecovery(bus, registry)
        cancels = Cancels(bus)
        dispatcher = Dispatcher(
            bus, registry, tracer, settings, block_size, kv_fingerprint, rng or random.Random(), watch, outage,
            cancels, metrics,
        )  # fmt: skip
        self._attempts = Attempts(bus, registry, tracer, settings, dispatcher, watch, outage, cancels, metrics)
        self._migrations = MigrationLoop(self._attempts, outage, settings, metrics)

    def num_in_flight(self) -> int:
        return self._in_flight

    def reject_chunk(
        self, reason: str, chunk: mesh_pb2.TokenChunk, span: Span | None = None, tally: list[int] | None = None
    ) -> None:
        """Count a stream chunk nobody may send (see Attempts.reject_chunk)."""
        self._attempts.reject_chunk(reason, chunk, span, tally)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        # The mesh's messages carry token ids only: images stop here until the vision stage (issue 29).
        refuse_images(request)
        self._in_flight += 1
        try:
            async for event in self._migrations.run(request):
                yield event
        finally:
            self._in_flight -= 1
