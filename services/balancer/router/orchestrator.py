"""The mesh as a Generator: route a request to a prefill and a decode
instance, dispatch it over NATS, and turn the decode instance's token stream
into TokenEvents. MeshGenerator composes the parts, one file each:

  migration.py       the loop over attempts: a request that an instance fails after
                     accepting it moves, with its tokens so far, to other instances;
  move_budget.py     which moves count against migration_limit: not those off
                     instances that died without a fair chance at the request;
  attempt.py         one attempt: dispatch, then the stream, each failure charged to
                     the instance at fault;
  wire.py            the request's messages: its images as PNG, placed in the prompt for
                     routing, checked to fit a NATS message (once per request);
  vision.py          E/P/D: a vision instance encodes the images into kvcache first
                     (once per request); without one, prefill encodes them (E/PD);
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

from services.balancer.generation import GenerationRequest, TokenEvent
from services.balancer.router.attempt import Attempts
from services.balancer.router.cancels import Cancels
from services.balancer.router.dispatch import Dispatcher
from services.balancer.router.instance_watch import InstanceWatch
from services.balancer.router.migration import MigrationLoop
from services.balancer.router.move_budget import RecentDeaths
from services.balancer.router.outage import OutageRecovery
from services.balancer.router.registry import Registry
from services.balancer.router.vision import VisionStage
from services.balancer.router.wire import NO_IMAGES, ImageLayout, wire_images
from shared.proto import mesh_pb2
from shared.runtime.bus import Bus
from shared.runtime.metrics import Metrics
from shared.runtime.settings import BalancerSettings, VisionSettings


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
        image_layout: ImageLayout | None = None,
        vision: VisionSettings | None = None,
    ) -> None:
        """image_layout: how the served model lays images into a prompt (None: a text-only
        model, whose requests the front door lets no image through)."""
        metrics = metrics or Metrics("balancer")
        self._bus = bus
        self._block_size = block_size
        self._image_layout = image_layout
        self._in_flight = 0
        watch = InstanceWatch(registry)
        outage = OutageRecovery(bus, registry)
        cancels = Cancels(bus)
        dispatcher = Dispatcher(
            bus, registry, tracer, settings, block_size, kv_fingerprint, rng or random.Random(), watch, outage,
            cancels, metrics,
        )  # fmt: skip
        self._vision = VisionStage(bus, registry, tracer, vision or VisionSettings(), watch, metrics,
                                   rng or random.Random())
        self._attempts = Attempts(bus, registry, tracer, settings, dispatcher, watch, outage, cancels, metrics)
        self._migrations = MigrationLoop(self._attempts, outage, RecentDeaths(registry), settings, metrics)

    def num_in_flight(self) -> int:
        return self._in_flight

    def reject_chunk(
        self, reason: str, chunk: mesh_pb2.TokenChunk, span: Span | None = None, tally: list[int] | None = None
    ) -> None:
        """Count a stream chunk nobody may send (see Attempts.reject_chunk)."""
        self._attempts.reject_chunk(reason, chunk, span, tally)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        # Once per request, before any dispatch: a request too large for the mesh's messages is a 400 here.
        images = NO_IMAGES
        if request.images:  # in parts past the server's max_payload: the bound is the bus's (wire.MAX_REQUEST_BYTES)
            images = await wire_images(request, self._image_layout, self._block_size)
            images = await self._vision.encode(request.request_id, images, [image.param for image in request.images])
        self._in_flight += 1
        try:
            async for event in self._migrations.run(request, images):
                yield event
        finally:
            self._in_flight -= 1
