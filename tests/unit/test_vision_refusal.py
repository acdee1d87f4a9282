"""An image no vision instance can read (a damaged PNG, another size than its message
says) is the request's fault, the same on every instance: the instance that meets it
replies "refused" (EncodeReply.code_param, nothing of the request left in its tower's
queue, nothing stored), and the balancer answers 400 at once, naming the content part,
without asking another instance or letting prefill try. Any other failure (kvcache
would not take the embeddings) is the instance's: it replies an error without
code_param, and the balancer asks the next instance."""

import asyncio
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from opentelemetry import trace

from services.balancer.generation import GenerationError
from services.balancer.router.instance_watch import InstanceWatch
from services.balancer.router.registry import Registry
from services.balancer.router.vision import VisionStage
from services.balancer.router.wire import WireImages
from services.vision.service import Encoder, VisionService
from shared.kv.block_hash import ImageSpan
from shared.proto import mesh_pb2
from shared.runtime.metrics import Metrics
from shared.runtime.service import ServiceContext
from shared.runtime.settings import Settings, VisionSettings
from shared.stage.convert import image_to_proto
from tests.helpers.clock import Clock
from tests.helpers.vision_heartbeats import beat

PARTS = ["messages[0].content[0]", "messages[0].content[2]"]


def images(damaged: int | None = None) -> list[mesh_pb2.ImageData]:
    rng = np.random.default_rng(0)
    out = [image_to_proto(rng.integers(0, 256, (14 * (k + 2), 28, 3), dtype=np.uint8), bytes([k + 1]) * 32)
           for k in range(2)]
    if damaged is not None:
        out[damaged].png = out[damaged].png[: len(out[damaged].png) // 2]  # truncated: no decoder reads it
    return out


class FakeKVCache:
    def __init__(self, fail_put: bool = False) -> None:
        self.fail_put = fail_put
        self.stored: list[bytes] = []

    async def get_blobs(self, keys, timeout_s=None):  # noqa: ANN001, ANN201
        return {}

    async def put_blobs(self, blobs, ttl_s):  # noqa: ANN001, ANN201
        if self.fail_put:
            raise ConnectionError("kvcache unavailable")
        self.stored += [b[0] for b in blobs]


def vision_service(kvcache: FakeKVCache) -> tuple[VisionService, list[int]]:
    """A vision instance whose tower is a stand-in that counts the images it is given."""
    metrics, towered = Metrics("vision"), []

    def processor(pixels):  # noqa: ANN001, ANN202
        towered.append(len(pixels))
        return SimpleNamespace(grids=[(1, 2, 2)] * len(pixels))

    model = SimpleNamespace(encode_images=lambda inputs: [torch.zeros(1, 8) for _ in inputs.grids])
    encoder = Encoder(model, processor, max_batch=4, wait_s=0.0, metrics=metrics)
    ctx = ServiceContext(stage="vision", instance_id="vision-0", settings=Settings(), bus=None,  # type: ignore[arg-type]
                         tracer=trace.get_tracer("test"), metrics=metrics, stop=asyncio.Event())
    return VisionService(ctx, encoder, kvcache), towered  # type: ignore[arg-type]


def outcome(service: VisionService, what: str) -> float:
    return service.ctx.metrics.registry.get_sample_value("infermesh_vision_requests_total", {"outcome": what}) or 0.0


async def test_a_vision_instance_refuses_an_image_it_cannot_read_and_queues_nothing_of_the_request() -> None:
    kvcache = FakeKVCache()
    service, towered = vision_service(kvcache)
    runner = asyncio.create_task(service.encoder.run())
    try:
        reply = await service.on_encode(mesh_pb2.EncodeRequest(request_id="r1", images=images(damaged=1)))
        assert not reply.ok and reply.code_param == "invalid_image:images.1"
        assert reply.error.startswith("images.1: ")
        # Image 0 was fine, but nothing of the refused request reaches the tower or kvcache.
        await asyncio.sleep(0.05)
        assert towered == [] and service.encoder.queue.qsize() == 0 and not service._in_flight
        assert kvcache.stored == [] and outcome(service, "refused") == 1
        # The same images undamaged: encoded and stored.
        reply = await service.on_encode(mesh_pb2.EncodeRequest(request_id="r2", images=images()))
        assert reply.ok and reply.num_encoded == 2 and not reply.code_param
        assert sum(towered) == 2 and len(kvcache.stored) == 2
        # The instance's own failure (kvcache refuses the embeddings) is an error, not a refusal.
        kvcache.fail_put = True
        fresh = image_to_proto(np.zeros((28, 28, 3), dtype=np.uint8), bytes([9]) * 32)  # in no cache yet
        reply = await service.on_encode(mesh_pb2.EncodeRequest(request_id="r3", images=[fresh]))
        assert not reply.ok and reply.error and not reply.code_param
    finally:
        runner.cancel()


class FakeBus:
    """Answers each vision instance's encode subject with its canned reply, and records who was asked."""

    def __init__(self, replies: dict[str, mesh_pb2.EncodeReply]) -> None:
        self.replies = replies
        self.asked: list[str] = []

    async def request(self, subject, message, reply_type, timeout=None):  # noqa: ANN001, ANN201
        instance = subject.split(".")[2]
        self.asked.append(instance)
        return self.replies[instance]


def stage(replies: dict[str, mesh_pb2.EncodeReply], settings: VisionSettings | None = None) -> tuple[
    VisionStage, FakeBus, Metrics
]:
    registry = Registry(clock=Clock())
    beat(registry, "v0", [bytes([1]) * 32, bytes([2]) * 32])  # holds the images: asked first (cache affinity)
    beat(registry, "v1", [])
    bus, metrics = FakeBus(replies), Metrics("balancer")
    vision = VisionStage(bus, registry, trace.get_tracer("test"), settings or VisionSettings(), InstanceWatch(registry),  # type: ignore[arg-type]
                         metrics, random.Random(0))
    return vision, bus, metrics


async def test_the_balancer_answers_a_refused_image_with_a_400_naming_the_part_and_asks_no_other_instance() -> None:
    refused = mesh_pb2.EncodeReply(instance_id="v0", error="images.1: the PNG is cut short",
                                   code_param="invalid_image:images.1")
    vision, bus, metrics = stage({"v0": refused, "v1": mesh_pb2.EncodeReply(ok=True, instance_id="v1")})
    wire = WireImages(tuple(images()))
    with pytest.raises(GenerationError) as info:
        await vision.encode("r1", wire, PARTS)
    err = info.value
    assert (err.status, err.error_type, err.param, err.code) == (400, "invalid_request_error", PARTS[1], "invalid_image")
    assert str(err) == f"{PARTS[1]}: the PNG is cut short"
    assert bus.asked == ["v0"]  # not retried on v1, and no fallback to prefill
    get = metrics.registry.get_sample_value
    assert get("infermesh_balancer_vision_refused_total") == 1
    assert not get("infermesh_balancer_vision_encodes_total", {"site": "prefill"})


async def test_an_instance_that_fails_otherwise_is_passed_over_for_the_next() -> None:
    failed = mesh_pb2.EncodeReply(instance_id="v0", error="kvcache unavailable")
    vision, bus, metrics = stage({"v0": failed, "v1": mesh_pb2.EncodeReply(ok=True, instance_id="v1")})
    out = await vision.encode("r1", WireImages(tuple(images())), PARTS)
    assert bus.asked == ["v0", "v1"] and all(m.embedded for m in out.messages)
    # What the planner and the profile read: the request's 2 images encoded on the vision stage, one
    # successful ask timed, and the stage busy for both asks (the failed one too).
    get = metrics.registry.get_sample_value
    assert get("infermesh_balancer_vision_images_total", {"site": "vision"}) == 2
    assert get("infermesh_balancer_vision_encode_seconds_count") == 1
    assert get("infermesh_balancer_vision_busy_seconds_total") >= get("infermesh_balancer_vision_encode_seconds_sum")


async def test_reuse_embeddings_off_encodes_every_image_again() -> None:
    """vision.reuse_embeddings off (the benchmark's no-cache baseline): a repeat is encoded again."""
    service, towered = vision_service(FakeKVCache())
    runner = asyncio.create_task(service.encoder.run())
    try:
        first = await service.on_encode(mesh_pb2.EncodeRequest(request_id="r1", images=images()))
        again = await service.on_encode(mesh_pb2.EncodeRequest(request_id="r2", images=images()))
        assert (first.num_encoded, again.num_encoded, again.num_cache_hits) == (2, 0, 2)
        service.ctx.settings.vision.reuse_embeddings = False
        third = await service.on_encode(mesh_pb2.EncodeRequest(request_id="r3", images=images()))
        assert third.ok and (third.num_encoded, third.num_cache_hits, third.num_kvcache_hits) == (2, 0, 0)
        assert sum(towered) == 4
    finally:
        runner.cancel()


async def test_a_lone_small_image_is_left_to_prefill_when_the_crossover_is_set() -> None:
    """vision.prefill_max_image_tokens (policies.encode_on_prefill): a lone image of at
    most that many tokens that no instance holds is not sent to the vision stage."""
    ok = {v: mesh_pb2.EncodeReply(ok=True, instance_id=v) for v in ("v0", "v1")}
    fresh = image_to_proto(np.zeros((28, 28, 3), dtype=np.uint8), bytes([9]) * 32)  # held by neither instance
    lone = WireImages((fresh,), (ImageSpan(fresh.hash, 3, 16),))
    vision, bus, metrics = stage(ok, VisionSettings(prefill_max_image_tokens=16))
    out = await vision.encode("r1", lone, PARTS[:1])
    assert out is lone and not out.messages[0].embedded and bus.asked == []
    assert metrics.registry.get_sample_value("infermesh_balancer_vision_encodes_total", {"site": "prefill"}) == 1
    assert metrics.registry.get_sample_value("infermesh_balancer_vision_images_total", {"site": "prefill_small"}) == 1
    # One token more than the crossover, or the setting's default (off): the vision stage encodes it.
    for settings, tokens in ((VisionSettings(prefill_max_image_tokens=16), 17), (VisionSettings(), 16)):
        vision, bus, _ = stage(ok, settings)
        out = await vision.encode("r2", WireImages((fresh,), (ImageSpan(fresh.hash, 3, tokens),)), PARTS[:1])
        assert out.messages[0].embedded and len(bus.asked) == 1
