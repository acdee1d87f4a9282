"""The vision stage as the balancer uses it (E/P/D): before a request with images is
dispatched, one vision instance encodes them and stores their embeddings in kvcache
(services/vision); the images then go to prefill marked `embedded`, and prefill and
decode fetch the embeddings by the images' identities instead of running the tower
(or copy them out of the instance's shared memory, where the reply says they lie:
ImageData.peer_source, shared/stage/embedding_share.py).

The instance is chosen by embedding-cache affinity and load (policies.choose_vision).
One that refuses, fails, does not answer within vision.encode_timeout_s or leaves the
mesh meanwhile (its NATS connection closed: a kill is heard within milliseconds) is
passed over and the next one asked; with none left, or none live, or vision.enabled
off, the request goes on as E/PD: prefill encodes its images from the PNGs it carries
anyway. So a vision fault costs time, never the request. A lone small image no
instance holds is left to prefill too (policies.encode_on_prefill, with
vision.prefill_max_image_tokens set): its tower run there is cheaper than the trip. An instance that refuses the
images themselves (one it cannot read: EncodeReply.code_param) ends the request at
once with a 400 naming the content part: every other instance, and prefill, would
refuse it the same way.

Once per request, before its first attempt: a migration resends the same messages,
whose embeddings kvcache still holds (or, evicted meanwhile, prefill encodes)."""

import asyncio
import logging
import random
from collections.abc import Sequence

import nats.errors
from opentelemetry.trace import Tracer

from services.balancer.router.instance_watch import InstanceWatch
from services.balancer.router.policies import choose_vision, encode_on_prefill
from services.balancer.router.registry import Registry
from services.balancer.router.reservations import Reservation
from services.balancer.generation import GenerationError
from services.balancer.router.wire import WireImages
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import Bus
from shared.runtime.metrics import Metrics
from shared.runtime.settings import VisionSettings

log = logging.getLogger(__name__)


class VisionStage:
    def __init__(self, bus: Bus, registry: Registry, tracer: Tracer, settings: VisionSettings, watch: InstanceWatch,
                 metrics: Metrics, rng: random.Random) -> None:  # fmt: skip
        self.bus = bus
        self.registry = registry
        self.tracer = tracer
        self.settings = settings
        self.watch = watch
        self.rng = rng
        self.m_encodes = metrics.counter(
            "vision_encodes_total", "Requests' images by where they were encoded (vision: a vision instance; "
            "prefill: no vision instance live, disabled, or every one failed)", ("site",)
        )
        self.m_failures = metrics.counter("vision_failures_total", "Encode requests a vision instance failed, "
                                          "by cause (error, timeout, left_mesh, no_responders)", ("cause",))
        self.m_refused = metrics.counter("vision_refused_total", "Requests whose images a vision instance "
                                         "could not read (a 400, not retried)")
        # The vision stage's load and speed, as the planner reads them (services/planner/observe.py)
        # and `infermesh profile` measures them (tools/planner/vision_round.py).
        self.m_images = metrics.counter(
            "vision_images_total", "Images of requests by where they were encoded (vision; prefill: no vision "
            "instance live, disabled, or every one failed; prefill_small: a lone small image, cheaper there)",
            ("site",))  # fmt: skip
        self.m_encode_s = metrics.histogram("vision_encode_seconds", "From asking a vision instance to its reply "
                                            "that the request's images are encoded and stored (successes)")
        self.m_busy_s = metrics.counter("vision_busy_seconds_total", "Seconds in which at least one encode "
                                        "request was out to a vision instance (images over it: the stage's rate)")
        self._asks_out = 0
        self._busy_since = 0.0

    async def encode(self, request_id: str, images: WireImages, parts: Sequence[str] = ()) -> WireImages:
        """The images, marked embedded when a vision instance encoded and stored them; as
        they were otherwise (prefill encodes them). parts: each image's content part (its
        param in a 400). GenerationError 400 when an instance refused an image itself."""
        if not images.messages or not self.settings.enabled or not self.registry.live("vision"):
            if images.messages:
                self.m_encodes.labels("prefill").inc()
                self.m_images.labels("prefill").inc(len(images.messages))
            return images
        hashes = [bytes(m.hash) for m in images.messages]
        tried: set[str] = set()
        with self.tracer.start_as_current_span("vision") as span:
            span.set_attribute("request.id", request_id)
            span.set_attribute("images.count", len(hashes))
            tokens = [s.length for s in images.spans]
            if encode_on_prefill(tokens, hashes, self.registry.live("vision"), self.settings.prefill_max_image_tokens):
                span.set_attribute("vision.site", "prefill")
                span.set_attribute("vision.reason", "small_image")
                self.m_encodes.labels("prefill").inc()
                self.m_images.labels("prefill_small").inc(len(hashes))
                return images
            while True:
                live = [i for i in self.registry.live("vision") if i.instance_id not in tried]
                if not live:
                    span.set_attribute("vision.site", "prefill")
                    self.m_encodes.labels("prefill").inc()
                    self.m_images.labels("prefill").inc(len(hashes))
                    log.warning("request %s: no vision instance encoded its images (tried %s): prefill encodes them",
                                request_id, sorted(tried))
                    return images
                choice = choose_vision(live, hashes, self.rng)
                vid = choice.instance.instance_id
                tried.add(vid)
                span.set_attribute("vision.candidates", list(choice.scores))
                span.set_attribute("vision.scores", list(choice.scores.values()))
                span.set_attribute("vision.choice", vid)
                span.set_attribute("vision.reason", choice.reason)
                sources: list[bytes] = []
                with Reservation(choice.instance, requests=len(hashes)):
                    cause = await self._timed_ask(vid, request_id, images, parts, sources)
                if cause is None:
                    span.set_attribute("vision.site", "vision")
                    self.m_encodes.labels("vision").inc()
                    self.m_images.labels("vision").inc(len(hashes))
                    if len(sources) != len(images.messages):  # an older instance: kvcache only
                        sources = [b""] * len(images.messages)
                    embedded = tuple(_embedded(m, s) for m, s in zip(images.messages, sources))
                    return WireImages(embedded, images.spans)
                self.m_failures.labels(cause).inc()
                span.add_event("vision_failed", {"instance": vid, "cause": cause})

    async def _timed_ask(self, vid: str, request_id: str, images: WireImages, parts: Sequence[str],
                         sources: list[bytes]) -> str | None:  # fmt: skip
        """_ask, timed: its latency when it succeeded, and the stage's busy time (the
        union of every ask's time out, so concurrent asks count once)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        if self._asks_out == 0:
            self._busy_since = started
        self._asks_out += 1
        try:
            cause = await self._ask(vid, request_id, images, parts, sources)
        finally:
            self._asks_out -= 1
            if self._asks_out == 0:
                self.m_busy_s.inc(loop.time() - self._busy_since)
        if cause is None:
            self.m_encode_s.observe(loop.time() - started)
        return cause

    async def _ask(self, vid: str, request_id: str, images: WireImages, parts: Sequence[str],
                   sources: list[bytes]) -> str | None:  # fmt: skip
        """None once vid encoded and stored the images (sources: where vid also offers
        each one on its host, EncodeReply.peer_sources); else why not. Stops waiting as soon
        as vid leaves the registry (its process died). GenerationError 400 when vid refused
        an image itself."""
        gone = self.watch.leaving(vid)
        msg = mesh_pb2.EncodeRequest(request_id=request_id, images=images.messages)
        ask = asyncio.ensure_future(self.bus.request(subjects.vision_encode(vid), msg, mesh_pb2.EncodeReply,
                                                     timeout=self.settings.encode_timeout_s))  # fmt: skip
        try:
            await asyncio.wait((ask, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.watch.forget(vid, gone)
            if not ask.done():
                ask.cancel()
        if not ask.done() or ask.cancelled():
            return "left_mesh"
        try:
            reply = ask.result()
        except nats.errors.NoRespondersError:
            return "no_responders"
        except nats.errors.TimeoutError:
            return "timeout"
        if not reply.ok and reply.code_param:
            self.registry.touch(vid)
            self.m_refused.inc()
            raise _refusal(reply, parts)
        if not reply.ok:
            log.warning("request %s: vision instance %s failed: %s", request_id, vid, reply.error)
            return "error"
        self.registry.touch(vid)
        sources.extend(reply.peer_sources)
        return None


def _refusal(reply: mesh_pb2.EncodeReply, parts: Sequence[str]) -> GenerationError:
    """The 400 of a refused image: code_param is `<code>:images.<k>`; the error names the
    request's k-th image part (reply.error starts with `images.<k>`, which becomes it)."""
    code, _, where = reply.code_param.partition(":")
    index = where.removeprefix("images.")
    part = parts[int(index)] if index.isdigit() and int(index) < len(parts) else "messages"
    message = reply.error.replace(where, part, 1) if where and reply.error.startswith(where) else f"{part}: {reply.error}"
    return GenerationError(message, 400, "invalid_request_error", param=part, code=code or None)


def _embedded(msg: mesh_pb2.ImageData, peer_source: bytes) -> mesh_pb2.ImageData:
    out = mesh_pb2.ImageData()
    out.CopyFrom(msg)
    out.embedded = True
    out.peer_source = peer_source
    return out
