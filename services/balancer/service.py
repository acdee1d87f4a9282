"""The balancer service: registry fed by NATS, the mesh generator, and the
OpenAI-compatible app served by uvicorn on the service's event loop."""

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import uvicorn
from fastapi.responses import JSONResponse

from services.balancer.api import create_app
from services.balancer.orchestrator import MeshGenerator
from services.balancer.registry import Registry
from shared.kv.block_hash import kv_fingerprint
from shared.model.config import ModelConfig
from shared.model.fingerprint import model_fingerprint
from shared.proto import mesh_pb2
from shared.recipe import Recipe
from shared.runtime import subjects
from shared.runtime.service import ServiceContext

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn inside our service skeleton: the skeleton owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def setup(ctx: ServiceContext, stack: AsyncExitStack) -> None:
    settings = ctx.settings
    model_dir = settings.engine.model
    model_config = ModelConfig.from_pretrained(model_dir)
    recipe = Recipe.from_pretrained(model_dir)
    registry = Registry(misses=settings.balancer.heartbeat_misses)

    async def on_heartbeat(hb: mesh_pb2.Heartbeat) -> None:
        registry.on_heartbeat(hb)

    async def on_kv_event(ev: mesh_pb2.KvEvent) -> None:
        registry.on_kv_event(ev)

    for subject, msg_type, handler in (
        (subjects.HEARTBEAT_ALL, mesh_pb2.Heartbeat, on_heartbeat),
        (subjects.KV_EVENTS, mesh_pb2.KvEvent, on_kv_event),
    ):
        sub = await ctx.bus.subscribe(subject, msg_type, handler)
        stack.push_async_callback(sub.unsubscribe)

    generator = MeshGenerator(
        ctx.bus,
        registry,
        ctx.tracer,
        settings.balancer,
        block_size=settings.engine.block_size,
        kv_fingerprint=kv_fingerprint(model_fingerprint(model_dir), settings.engine.dtype),
    )
    max_model_len = settings.engine.max_model_len or model_config.max_position_embeddings
    app = create_app(
        generator=generator,
        recipe=recipe,
        model_name=settings.balancer.model_name or Path(model_dir).name,
        max_model_len=max_model_len,
        settings=settings.balancer,
        metrics=ctx.metrics,
        tracer=ctx.tracer,
    )
    g_instances = ctx.metrics.gauge("live_instances", "Live instances per stage", ("stage",))

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """200 once the mesh can serve: at least one prefill and one decode instance."""
        counts = registry.counts()
        for stage in ("prefill", "decode"):
            g_instances.labels(stage).set(counts.get(stage, 0))
        ok = counts.get("prefill", 0) > 0 and counts.get("decode", 0) > 0
        return JSONResponse({"ready": ok, "instances": counts}, status_code=200 if ok else 503)

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
