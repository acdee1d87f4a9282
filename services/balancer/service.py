"""The balancer service: registry fed by NATS, the mesh generator, and the
OpenAI-compatible app served by uvicorn on the service's event loop.

Heartbeats are read per stage and instance subject (`im.heartbeat.<stage>.<instance>`;
one whose body names another stage or instance is refused, as are KV events
naming another instance than `im.kv.events.<instance>`), swept for silent instances every
registry.SWEEP_INTERVAL_S (their requests fail over at once), and counted when
refused. An instance whose NATS connection closes leaves at once
(services/balancer/router/departures.py). While the balancer's own NATS connection is
down, and for two heartbeat intervals after it is back, neither applies: the
registry is paused (router/registry.py), and requests wait for the bus
(router/outage.py). Chunks on the old stream subject form (`im.stream.<request>`) are
counted as forged: no worker publishes there.

/ready: 200 with {"ready": true} once at least one prefill and one decode
instance are live, 503 otherwise. kvcache is a cache, not a dependency: while it
is unreachable (health checked every kvcache.probe_interval_s) the mesh computes
what it would have loaded, so /ready stays 200 and says {"status": "degraded",
"kvcache": "down"}; "kvcache": "up" and "status": "ok" otherwise.
"""

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import uvicorn
from nats.aio.msg import Msg
from prometheus_client import Gauge
from fastapi.responses import JSONResponse

from services.balancer.frontend.api import create_app
from services.balancer.frontend.errors import APIError
from services.balancer.frontend.images import ModelImages
from services.balancer.response_kv import open_response_store
from services.balancer.router.departures import instance_departed, parse_advisory
from services.balancer.router.orchestrator import MeshGenerator
from services.balancer.router.prefix_reset import reset_prefix_caches
from services.balancer.router.registry import STAGES, SWEEP_INTERVAL_S, Registry
from services.balancer.router.wire import ImageLayout
from shared.kv.block_hash import kv_fingerprint
from shared.model.config import ModelConfig
from shared.model.fingerprint import model_fingerprint
from shared.model.models import arch_traits
from shared.multimodal.grid import PatchGrid
from shared.proto import mesh_pb2
from shared.recipe import Recipe
from shared.runtime.vllm_metrics import served_model_names
from shared.runtime import subjects
from shared.runtime.bus import CONNECTION_HEADER, Bus
from shared.runtime.rpc import check_health
from shared.runtime.service import ServiceContext

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn inside our service skeleton: the skeleton owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _sweep(registry: Registry, bus: Bus) -> None:
    """Notice silent instances promptly: their requests fail over when they leave.
    Before dropping one, read what NATS has delivered (a round trip to the server,
    then a moment for the handlers): when this loop lags, its heartbeat may be there."""
    while True:
        await asyncio.sleep(SWEEP_INTERVAL_S)
        try:
            if registry.silent():
                with contextlib.suppress(Exception):
                    await bus.nc.flush(timeout=1)
                await asyncio.sleep(0.01)
                registry.sweep()
        except Exception:
            log.exception("sweeping the registry failed")


def _model_images(model_dir: str, model_config: ModelConfig) -> ModelImages:
    """Whether the model takes images (its architecture's trait) and its image processor's
    settings as transformers keeps them (preprocessor_config.json), which every image's hash covers."""
    accepts = arch_traits(model_config.architecture).accepts_images
    path = Path(model_dir) / "preprocessor_config.json"
    processor = json.loads(path.read_text()) if accepts and path.is_file() else {}
    vl = model_config.vision_language
    return ModelImages(accepts, processor, vl.image_token_id if accepts and vl is not None else None)


def _image_layout(model: ModelImages) -> ImageLayout | None:
    """Where the mesh places a request's images in its prompt (routing keys), by the
    front door's arithmetic; None for a model that takes none."""
    if not model.accepts or model.image_token_id is None:
        return None
    return ImageLayout(model.image_token_id, PatchGrid.from_settings(model.processor_settings))


class _KVCacheProbe:
    """kvcache's health as the balancer sees it (grpc.health.v1, which needs no token)."""

    def __init__(self, address: str, interval_s: float, gauge: Gauge) -> None:
        self.address = address
        self.interval_s = interval_s
        self.gauge = gauge
        self.up: bool | None = None
        """None until the first check."""

    async def run(self) -> None:
        while True:
            up = await check_health(self.address, timeout_s=min(self.interval_s, 1.0))
            if up != self.up:
                if up:
                    log.info("kvcache is up")
                else:
                    log.warning("kvcache is unreachable: workers compute without it")
            self.up = up
            self.gauge.set(1 if up else 0)
            await asyncio.sleep(self.interval_s)


async def setup(ctx: ServiceContext, stack: AsyncExitStack) -> None:
    settings = ctx.settings
    model_dir = settings.engine.model
    model_config = ModelConfig.from_pretrained(model_dir)
    recipe = Recipe.from_pretrained(model_dir)
    model_images = _model_images(model_dir, model_config)
    registry = Registry(
        misses=settings.balancer.heartbeat_misses, max_interval_s=settings.balancer.max_heartbeat_interval_s
    )
    generator = MeshGenerator(
        ctx.bus,
        registry,
        ctx.tracer,
        settings.balancer,
        block_size=settings.engine.block_size,
        kv_fingerprint=kv_fingerprint(model_fingerprint(model_dir), settings.engine.dtype),
        metrics=ctx.metrics,
        image_layout=_image_layout(model_images),
        vision=settings.vision,
    )
    m_refused = ctx.metrics.counter(
        "heartbeats_refused_total", "Heartbeats refused: an interval beyond max_heartbeat_interval_s, another "
        "stage than their subject's, or an instance id that cannot be a subject token", ("reason",)
    )
    m_left = ctx.metrics.counter("instances_left_total", "Instances dropped from the registry", ("stage", "why"))
    # Our own NATS outage is not every instance's death: no sweep nor departure while
    # it lasts, and silence counts again only a grace after it (router/registry.py).
    grace_s = 2 * settings.worker.heartbeat_interval_s
    m_outages = ctx.metrics.counter("nats_outages_total", "Times the balancer's NATS connection dropped")

    def on_bus_down() -> None:
        registry.pause()
        m_outages.inc()
        log.warning("NATS connection lost: the registry holds every instance until %.1f s after it is back", grace_s)

    def on_bus_back() -> None:
        registry.resume(grace_s)
        log.info("NATS connection back: instances silent from now on for %.1f s + %d heartbeats leave",
                 grace_s, registry.misses)

    ctx.bus.on_disconnected.append(on_bus_down)
    ctx.bus.on_reconnected.append(on_bus_back)
    registry.on_removed.append(lambda inst, why: m_left.labels(inst.stage, why.split(" ")[0]).inc())

    m_kv_refused = ctx.metrics.counter(
        "kv_events_refused_total", "Worker KV events refused: the body names another instance than the subject"
    )

    def on_heartbeat_of(stage: str):  # noqa: ANN202
        async def on_heartbeat(hb: mesh_pb2.Heartbeat, subject: str, headers: dict[str, str]) -> None:
            reason = registry.on_heartbeat(hb, stage, subjects.last_token(subject), headers.get(CONNECTION_HEADER))
            if reason is not None:
                m_refused.labels(reason).inc()
                log.warning("refused a heartbeat of %r on %s (%s)", hb.instance_id, subject, reason)

        return on_heartbeat

    m_kv_gaps = ctx.metrics.counter(
        "kv_event_gaps_total", "Worker KV events that did not follow the last one taken (some were lost); "
        "the worker's next snapshot mends the block view"
    )

    async def on_kv_event(ev: mesh_pb2.KvEvent, subject: str) -> None:
        gaps = registry.num_kv_event_gaps
        if registry.on_kv_event(ev, subjects.last_token(subject)) is not None:
            m_kv_refused.inc()
            log.warning("refused KV events naming %r on %s", ev.instance_id, subject)
        elif registry.num_kv_event_gaps > gaps:
            m_kv_gaps.inc()

    async def on_old_stream_subject(chunk: mesh_pb2.TokenChunk, subject: str) -> None:
        generator.reject_chunk("old_subject", chunk)

    for stage in STAGES:
        sub = await ctx.bus.subscribe(subjects.heartbeats_of(stage), mesh_pb2.Heartbeat, on_heartbeat_of(stage),
                                      with_headers=True)
        stack.push_async_callback(sub.unsubscribe)
    routes = [
        (subjects.KV_EVENTS_ALL, mesh_pb2.KvEvent, on_kv_event),
        (subjects.STREAM_OLD_FORM, mesh_pb2.TokenChunk, on_old_stream_subject),
    ]
    for subject, msg_type, handler in routes:
        sub = await ctx.bus.subscribe(subject, msg_type, handler, with_subject=True)
        stack.push_async_callback(sub.unsubscribe)

    m_departures_ignored = ctx.metrics.counter(
        "departures_ignored_total", "Disconnect advisories naming an instance that did not make it leave: heard "
        "during the balancer's own NATS outage or its grace, or for a connection the instance no longer uses"
    )

    async def on_disconnect_advisory(msg: Msg) -> None:
        departure = parse_advisory(msg.data)
        if departure is None:
            return
        ignored = registry.num_departures_ignored
        if (inst := instance_departed(registry, departure)) is not None:
            log.warning("%s left: its NATS connection closed (%s)", inst.instance_id, departure.reason)
        elif registry.num_departures_ignored > ignored:
            m_departures_ignored.inc()
            log.info("%s's NATS connection %s closed (%s): not its current one, or heard around our own outage; "
                     "it stays", departure.name, departure.connection or "?", departure.reason)

    # Deaths, from nats-server at once (where its config imports the advisories: up, compose, Helm).
    sub = await ctx.bus.nc.subscribe(subjects.CLIENT_DISCONNECTED, cb=on_disconnect_advisory)
    stack.push_async_callback(sub.unsubscribe)

    kvcache = _KVCacheProbe(settings.kvcache.address, settings.kvcache.probe_interval_s,
                            ctx.metrics.gauge("kvcache_up", "1 while the balancer reaches kvcache's health check"))
    for name, coro in (("registry-sweep", _sweep(registry, ctx.bus)), ("kvcache-probe", kvcache.run())):
        task = asyncio.create_task(coro, name=name)
        stack.callback(task.cancel)
    max_model_len = settings.engine.max_model_len or model_config.max_position_embeddings
    names = served_model_names(settings.balancer.model_name, model_dir)
    app = create_app(
        generator=generator,
        recipe=recipe,
        model_name=names[0],
        aliases=names[1:],
        max_model_len=max_model_len,
        settings=settings.balancer,
        metrics=ctx.metrics,
        tracer=ctx.tracer,
        images=settings.images,
        model_images=model_images,
        response_store=await open_response_store(
            ctx.bus.nc, settings.balancer.responses_bucket, settings.balancer.responses_ttl_s
        ),
    )
    g_instances = ctx.metrics.gauge("live_instances", "Live instances per stage", ("stage",))

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """200 once the mesh can serve: at least one prefill and one decode instance.
        kvcache down is "degraded", still ready: the workers compute without it."""
        counts = registry.counts()
        for stage in STAGES:
            g_instances.labels(stage).set(counts.get(stage, 0))
        ok = counts.get("prefill", 0) > 0 and counts.get("decode", 0) > 0
        kv_state = {None: "unknown", True: "up", False: "down"}[kvcache.up]
        status = "ok" if kv_state == "up" else "degraded"
        body = {"ready": ok, "status": status if ok else "unavailable", "instances": counts, "kvcache": kv_state}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        """Every live prefill and decode instance forgets the KV it keeps for reuse
        (router/prefix_reset.py); 200 with what each dropped, 503 naming those that did not answer;
        403 unless balancer.prefix_cache_reset is on."""
        if not settings.balancer.prefix_cache_reset:
            raise APIError(403, "The prefix-cache reset is off on this mesh: an operator turns it on with "
                                "INFERMESH_BALANCER__PREFIX_CACHE_RESET=true.", type="permission_error",
                           param="balancer.prefix_cache_reset")  # fmt: skip
        outcome = await reset_prefix_caches(registry, ctx.bus, settings.worker.kv_flush_timeout_s + 10.0)
        return JSONResponse(outcome.body(), status_code=503 if outcome.failed else 200)

    config = uvicorn.Config(
        app, host=settings.balancer.host, port=settings.balancer.port, log_level="warning", lifespan="off"
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(), name="uvicorn")

    async def stop_http() -> None:
        server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(task, timeout=settings.worker.drain_timeout_s)

    stack.push_async_callback(stop_http)
    while not server.started:
        if task.done():
            task.result()  # raises why uvicorn could not start (port taken, ...)
            raise RuntimeError("uvicorn stopped before it started")
        await asyncio.sleep(0.05)
    log.info("OpenAI API on http://%s:%d/v1", settings.balancer.host, settings.balancer.port)
