"""What the engine-running services (prefill, decode) share: building the
engine from settings, its thread, heartbeats with load figures, KV block
events, and the drain on shutdown.

kvcache is a soft dependency: while it is unreachable the engine computes what
it would have loaded (the connector answers misses at once). The worker stays
SERVING (overall gRPC health) and says where kvcache stands: the gRPC health
service "kvcache" (SERVING or NOT_SERVING, `grpc_health_probe -service=kvcache`),
the gauge kvcache_up, the counter kvcache_bypassed_total (requests whose lookup
kvcache did not answer, or whose hit was recomputed because loading it would be
slower: "recompute"), and each request's span attribute kv.kvcache ("ok",
"down", "failed", "slow", "recompute", or "unused" when kvcache was not asked).
A load from kvcache (kv.path "kvcache") also names the plane its bytes took:
the span attribute kv.kvcache_plane ("shm": the shared-memory segment on
kvcache's host; "nixl": written into the worker's landing buffer through NIXL;
"stream": the gRPC byte stream; "nixl+stream" when a refused plane's rest
streamed) and the counter kvcache_load_bytes_total{plane}."""

import asyncio
import contextlib
import logging
from contextlib import AsyncExitStack

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message
from opentelemetry.trace import Span

from shared.engine.async_engine import AsyncEngine
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import STEP_KINDS, KVTransferReport, StepCounts
from shared.engine.sampling_params import InvalidParam, SamplingParams
from shared.kv.connectors.chain import connector_chain
from shared.kv.connectors.kvcache import KVCacheConnector, LookupOutcome
from shared.kv.connectors.nixl import NixlConnector
from shared.kv.events import kv_event_messages
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import Bus, StreamPublisher
from shared.runtime.heartbeat import BeatIdentity, BeatState, Heartbeats
from shared.runtime.rpc import NOT_SERVING, SERVING, GrpcServer, start_grpc_server
from shared.runtime.service import ServiceContext
from shared.runtime.vllm_metrics import served_model_name
from shared.stage.convert import expert_load_to_proto, params_from_proto
from shared.stage.engine_metrics import EngineMetrics, cache_config_info
from shared.stage.expert_metrics import ExpertLoadMetrics
from shared.stage.images import StageImages
from shared.stage.spec_metrics import SpecMetrics

log = logging.getLogger(__name__)

KVCACHE_HEALTH = "kvcache"
"""The gRPC health service name under which a worker reports whether it reaches kvcache."""


def kv_path(report: KVTransferReport) -> str:
    """A request's span attribute kv.path: where its prompt KV came from. "recompute"
    when a load failed (the tokens were computed instead), "none" when nothing was
    loaded, else the load's path: "peer" (the same-namespace copy), "nixl", "host",
    "kvcache" (the store's stream or shared memory)."""
    if report.load_failed:
        return "recompute"
    if not report.num_loaded_blocks or not report.load_path:
        return "none"
    return report.load_path


class Worker:
    """An engine on its thread plus the mesh duties around it. Services make one
    in their setup and register its stop on the exit stack."""

    def __init__(
        self, ctx: ServiceContext, engine: LLMEngine, kvcache: KVCacheConnector | None = None,
        nixl: NixlConnector | None = None, images: StageImages | None = None,
    ) -> None:  # fmt: skip
        """nixl: the engine's NIXL link, when its agent started (peers read held blocks through it);
        images: the model's image processor where requests' images are made ready (none: a
        text-only model)."""
        self.ctx = ctx
        self.images = images or StageImages(None)
        self.kvcache = kvcache
        self.nixl = nixl
        self._kvcache_up: bool | None = None
        self.engine = AsyncEngine(engine, asyncio.get_running_loop(), on_crash=self._engine_crashed)
        self.grpc: GrpcServer | None = None
        self.draining = False
        self._tasks: list[asyncio.Task] = []
        self._inflight: set[asyncio.Task] = set()
        self._by_request: dict[str, asyncio.Task] = {}
        settings = ctx.settings
        self.heartbeats = Heartbeats(
            ctx.bus, BeatIdentity.of(ctx), lambda: BeatState(self.load(), self.draining), after_beat=self._report_kvcache
        )
        self._subscribed = False  # its dispatch subscription is up: work sent to it arrives
        self._kv_seq = 0
        m = ctx.metrics
        self.m_running = m.gauge("running_requests", "Requests in the engine's running batch")
        self.m_waiting = m.gauge("waiting_requests", "Requests queued in the engine")
        self.m_queued_tokens = m.gauge("queued_tokens", "Prompt tokens of admitted requests not past their prefill, cached ones included, and all the tokens of preempted ones not caught up (shared/engine/outputs.py queued_prompt_tokens)")
        self.m_kv_free = m.gauge("kv_free_blocks", "Free blocks of the paged KV cache")
        self.m_kv_total = m.gauge("kv_total_blocks", "Blocks of the paged KV cache")
        self.m_kv_usage = m.gauge("kv_usage_ratio", "Used fraction of the paged KV cache")
        self.m_kv_loaded_bytes = m.counter("kv_loaded_bytes_total", "KV bytes loaded from kvcache into the paged cache")
        self.m_kv_stored_bytes = m.counter("kv_stored_bytes_total", "KV bytes written to kvcache")
        self.m_kv_store_failures = m.gauge("kv_store_failures", "Stores to kvcache that failed since start")
        self.m_kv_stores_dropped = m.gauge(
            "kv_stores_dropped", "Stores to kvcache written behind that were dropped since start (too many in flight)"
        )
        self.m_kv_flush_lost = m.counter(
            "kv_flush_blocks_lost_total",
            "Blocks written behind to kvcache that a stopping worker's flush gave up on (worker.kv_flush_timeout_s): "
            "lost to the cache",
        )
        self.m_kv_load_failures = m.counter(
            "kv_load_failures_total", "Loads from kvcache that did not (fully) arrive: their tokens were recomputed"
        )
        self.m_kv_transfer_bytes = m.counter(
            "kv_transfer_bytes_total", "KV bytes loaded into the paged cache, by path (peer, nixl, host, kvcache)", ("path",)
        )
        self.m_kv_transfer_seconds = m.counter(
            "kv_transfer_seconds_total",
            "Seconds of KV loads, from asking for the blocks to their arrival in the engine (its next step), by path: "
            "kv_transfer_bytes_total over it is the path's rate (the planner's handoff_gb_s)",
            ("path",),
        )
        self.m_kv_transfer_failures = m.counter(
            "kv_transfer_failures_total",
            "Loads that did not (fully) arrive, by path: their tokens were recomputed",
            ("path",),
        )
        self.m_kvcache_load_bytes = m.counter(
            "kvcache_load_bytes_total", "KV bytes of loads from kvcache (a host-tier head's included), by the plane kvcache's bytes took "
            "(shm, nixl, stream, or several joined by +)",
            ("plane",),
        )
        self.m_images_encoded = m.counter(
            "images_encoded_total", "Images the vision tower ran on here: prompts computed here with images a vision "
            "instance did not encode (decode after a handoff only when it recomputes an image's rows)",
        )
        self._num_images_encoded = 0
        self.m_engine_steps = m.counter(
            "engine_steps_total", "The engine's steps that ran a forward, by how: overlapped (launched before the step "
            "before was read back), sampled_after_read_back (overlapped, but a row masked by the host made sampling "
            "wait), synchronous (async scheduling off, drafting, a prompt being scored)",
            ("how",),
        )
        for how in STEP_KINDS:  # every kind shows from the start, at 0
            self.m_engine_steps.labels(how)
        self._steps = StepCounts()
        self.m_kvcache_up = m.gauge("kvcache_up", "1 while this worker reaches kvcache, 0 while it computes without it")
        self.m_kvcache_bypassed = m.counter(
            "kvcache_bypassed_total",
            "Requests computed without kvcache: it was down, failed or slow to answer, or loading was slower (recompute)",
            ("outcome",),
        )
        self.vllm = EngineMetrics(
            m.registry, served_model_name(settings.balancer.model_name, settings.engine.model),
            engine.scheduler.step_tokens, cache_config_info(engine),
        )
        """vLLM's series of this engine (shared/runtime/vllm_metrics.py says who exports what)."""
        speculator = engine.speculator
        self.spec = (
            None
            if speculator is None
            else SpecMetrics(m, served_model_name(settings.balancer.model_name, settings.engine.model), speculator.num_tokens)
        )
        moe = engine.model.expert_counts is not None
        self.expert_metrics = ExpertLoadMetrics(m) if moe else None
        """An MoE engine's per-layer expert load (what the EP balancer routes by); None for a dense one."""

    async def start(self, stack: AsyncExitStack) -> None:
        self.engine.start()
        self.grpc = await start_grpc_server(self.ctx.settings.worker.grpc_port, [], [self.ctx.stage])
        await self._report_kvcache()
        await self._publish_kv_events(snapshot=True)
        self._tasks = [
            self.heartbeats.start(),
            asyncio.create_task(self._kv_event_loop(), name="kv-events"),
        ]
        stack.push_async_callback(self.stop)
        await self.grpc.set_serving(True)
        log.info("%s: gRPC health on :%d", self.ctx.instance_id, self.grpc.port)

    def _engine_crashed(self, error: BaseException) -> None:
        """The step loop died (a rank of the instance died, a bug): its requests were
        failed (the balancer moves them); the instance stops and exits non-zero rather
        than stay registered with no engine, so that no further request reaches it and
        a supervisor starts it again."""
        self.ctx.fail(f"the engine stopped: {type(error).__name__}: {error}")

    def not_ready(self) -> str | None:
        """/ready's answer (on the metrics port): None once the engine is loaded (a
        Worker exists only then), the instance is registered on the bus and listens
        for its work, and it is not draining; else why not."""
        if self.draining:
            return "draining"
        if not self.ctx.bus.nc.is_connected:
            return "not connected to NATS"
        if not (self.heartbeats.registered and self._subscribed):
            return "not registered on the bus yet"
        return None

    def mark_subscribed(self) -> None:
        self._subscribed = True

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine itself, for what it says of its model and cache (calls into it go
        through `engine`, the engine's thread)."""
        return self.engine.engine

    def admit(
        self,
        request_id: str,
        prompt: Sequence[int],
        sampling: mesh_pb2.SamplingParams,
        run: Callable[[SamplingParams], Coroutine[Any, Any, None]],
        on_invalid: Callable[[], None],
        *,
        check_vocab: bool = True,
        check: Callable[[], None] | None = None,
    ) -> mesh_pb2.Ack:
        """Take a request or refuse it in the Ack: SHUTTING_DOWN while draining;
        INVALID_REQUEST (counted by on_invalid) when its sampling parameters, its prompt,
        the token ids the parameters name (check_vocab) or its id are what the engine
        would refuse later, or when `check` raises ValueError; else run(params) as the
        request's task."""
        if self.draining:
            return mesh_pb2.Ack(accepted=False, code=mesh_pb2.ERROR_CODE_SHUTTING_DOWN, message="draining")
        engine = self.llm_engine
        try:
            params = params_from_proto(sampling)
            validate_prompt(engine, list(prompt), params)
            if check_vocab:
                params.check_vocab(engine.model.config.vocab_size)
            subjects.check_token(request_id)
            if check is not None:
                check()
        except ValueError as exc:
            on_invalid()
            # The field at fault travels beside the text, so the balancer never reads it out of the text.
            param = exc.param if isinstance(exc, InvalidParam) else ""
            code = mesh_pb2.ERROR_CODE_INVALID_REQUEST
            return mesh_pb2.Ack(accepted=False, code=code, message=str(exc), param=param)
        self.spawn(request_id, run(params))
        return mesh_pb2.Ack(accepted=True, instance_id=self.ctx.instance_id)

    def spawn(self, request_id: str, coro) -> asyncio.Task:  # noqa: ANN001
        """Run a request's handler as a task: counted for the drain, and
        cancelled by a Cancel message naming the request."""
        task = asyncio.create_task(coro)
        self._inflight.add(task)
        self._by_request[request_id] = task

        def done(_: asyncio.Task) -> None:
            self._inflight.discard(task)
            if self._by_request.get(request_id) is task:
                del self._by_request[request_id]

        task.add_done_callback(done)
        return task

    async def on_cancel(self, msg: mesh_pb2.Cancel) -> None:
        task = self._by_request.get(msg.request_id)
        if task is not None:
            task.cancel()  # leaving engine.generate() aborts the request and frees its blocks

    async def on_nixl_metadata(self, msg: mesh_pb2.NixlMetadataRequest) -> mesh_pb2.NixlMetadata:
        """A peer about to read blocks this engine holds asks for its NIXL agent (once per peer)."""
        if self.nixl is None or self.nixl.agent is None:
            return mesh_pb2.NixlMetadata()
        return mesh_pb2.NixlMetadata(agent=self.nixl.agent.name, metadata=self.nixl.metadata())

    async def on_kv_release(self, msg: mesh_pb2.KvRelease) -> None:
        """A decode instance copied a request's held blocks: they may go."""
        rid = msg.request_id
        await self.engine.call(lambda e: e.release_kv_lease(rid))

    async def on_reset_prefix_cache(self, msg: mesh_pb2.ResetPrefixCache) -> mesh_pb2.PrefixCacheReset:
        """The balancer's POST /reset_prefix_cache: what a restart does to this instance's
        caches, the process kept. The saves written behind are flushed to kvcache first
        (as a stopping worker's are), so what the instance forgets kvcache holds; then
        the device prefix cache and the host tier are dropped, between two steps (blocks in
        use, as those leased for decode's copy, keep their content but leave the index).
        The KV event loop tells the router of the removals."""
        unflushed = 0
        if self.kvcache is not None:  # not flush_kv(): saves still on their way here are late, not lost
            unflushed = await asyncio.to_thread(self.kvcache.flush, self.ctx.settings.worker.kv_flush_timeout_s)
        device, host = await self.engine.call(lambda e: e.reset_prefix_cache())
        log.info("%s: prefix cache reset: %d device blocks and %d host-tier blocks dropped",
                 self.ctx.instance_id, device, host)
        return mesh_pb2.PrefixCacheReset(instance_id=self.ctx.instance_id, num_device_blocks=device,
                                         num_host_blocks=host, num_unflushed=unflushed)

    async def stop(self) -> None:
        """Drain: say NOT_SERVING and draining, let in-flight requests finish
        under a timeout, stop the engine, then flush the KV written behind to
        kvcache under a timeout of its own (the engine's close, later, ends the
        connector: what is not stored by then would be lost silently)."""
        self.draining = True
        if self.grpc is not None:
            await self.grpc.set_serving(False)
        await self.heartbeats.send()
        if self._inflight:
            _, pending = await asyncio.wait(self._inflight, timeout=self.ctx.settings.worker.drain_timeout_s)
            for task in pending:
                task.cancel()
        for task in self._tasks:
            task.cancel()
        await self.engine.shutdown()
        await self.flush_kv()
        if self.grpc is not None:
            await self.grpc.stop(grace_s=1.0)

    async def flush_kv(self) -> int:
        """Wait up to worker.kv_flush_timeout_s for the saves written behind to reach
        kvcache; count (and log) the blocks of those that did not. Returns that count."""
        if self.kvcache is None:
            return 0
        timeout_s = self.ctx.settings.worker.kv_flush_timeout_s
        lost = await asyncio.to_thread(self.kvcache.flush, timeout_s)
        if lost:
            self.m_kv_flush_lost.inc(lost)
            log.warning("%s: %d KV blocks written behind were not stored in kvcache within %.1f s "
                        "(worker.kv_flush_timeout_s): a restart misses them", self.ctx.instance_id, lost, timeout_s)
        return lost

    async def _report_kvcache(self) -> None:
        """kvcache's state as this worker sees it: the gauge, and the "kvcache" health service."""
        up = self.kvcache is None or self.kvcache.up
        self.m_kvcache_up.set(1 if up else 0)
        if up != self._kvcache_up and self.grpc is not None:
            self._kvcache_up = up
            await self.grpc.health.set(KVCACHE_HEALTH, SERVING if up else NOT_SERVING)

    def record_kv_transfer(self, report: KVTransferReport, span: Span, request_id: str | None = None) -> None:
        """What the engine's connector moved for a request: metrics and span attributes."""
        if request_id is not None and self.kvcache is not None:
            outcome = self.kvcache.take_outcome(request_id)
            span.set_attribute("kv.kvcache", "unused" if outcome is None else outcome.value)
            if outcome is not None and outcome is not LookupOutcome.OK:
                self.m_kvcache_bypassed.labels(outcome.value).inc()
        block_bytes = self.llm_engine.kv_region.block_bytes
        loaded, stored = report.num_loaded_blocks * block_bytes, report.num_saved_blocks * block_bytes
        self.m_kv_loaded_bytes.inc(loaded)
        self.m_kv_stored_bytes.inc(stored)
        span.set_attribute("kv.loaded_blocks", report.num_loaded_blocks)
        span.set_attribute("kv.loaded_bytes", loaded)
        span.set_attribute("kv.load_failed", report.load_failed)
        span.set_attribute("kv.loaded_direct", report.loaded_direct)
        path = kv_path(report)
        span.set_attribute("kv.path", path)
        if report.load_plane:
            span.set_attribute("kv.kvcache_plane", report.load_plane)
            self.m_kvcache_load_bytes.labels(report.load_plane).inc(loaded)
        if report.load_path:
            self.m_kv_transfer_bytes.labels(report.load_path).inc(loaded)
            self.m_kv_transfer_seconds.labels(report.load_path).inc(report.load_seconds)
            if report.load_failed:
                self.m_kv_transfer_failures.labels(report.load_path).inc()
        span.set_attribute("kv.load_ms", round(report.load_seconds * 1e3, 3))
        if report.loaded_direct:
            span.set_attribute("kv.copy_ms", round(report.copy_seconds * 1e3, 3))
        if report.load_failed:
            self.m_kv_load_failures.inc()
        span.set_attribute("kv.replayed_tokens", report.num_replayed_tokens)
        span.set_attribute("kv.stored_blocks", report.num_saved_blocks)
        span.set_attribute("kv.stored_bytes", stored)
        if report.save_error is not None:
            span.set_attribute("kv.store_error", report.save_error)

    def load(self) -> mesh_pb2.Load:
        load = self.engine.last_load
        self.m_running.set(load.num_running)
        self.m_waiting.set(load.num_waiting)
        self.m_queued_tokens.set(load.num_queued_tokens)
        self.m_kv_free.set(load.num_free_kv_blocks)
        self.m_kv_total.set(load.num_total_kv_blocks)
        self.m_kv_usage.set(1 - load.num_free_kv_blocks / max(load.num_total_kv_blocks, 1))
        self.m_kv_store_failures.set(load.num_kv_save_failures)
        self.m_kv_stores_dropped.set(load.num_kv_saves_dropped)
        self.m_images_encoded.inc(load.num_images_encoded - self._num_images_encoded)
        self._num_images_encoded = load.num_images_encoded
        for how in STEP_KINDS:
            self.m_engine_steps.labels(how).inc(getattr(load.steps, how) - getattr(self._steps, how))
        self._steps = load.steps
        self.vllm.update(load)
        if self.spec is not None:
            self.spec.update(load)
        expert_load = load.expert_load
        if expert_load is not None and self.expert_metrics is not None:
            self.expert_metrics.update(expert_load)
        return mesh_pb2.Load(
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_free_kv_blocks=load.num_free_kv_blocks,
            num_total_kv_blocks=load.num_total_kv_blocks,
            num_queued_tokens=load.num_queued_tokens,
            expert_load=None if expert_load is None else expert_load_to_proto(expert_load),
        )

    async def _publish_kv_events(self, snapshot: bool = False) -> None:
        """What the prefix cache took in and let go since the last call or, with
        snapshot, all it holds (shared/kv/events.py says why both)."""
        if snapshot:
            stored, removed = await self.engine.call(lambda e: e.kv_snapshot()), []
        else:
            stored, removed = await self.engine.call(lambda e: e.drain_kv_events())
        for event in kv_event_messages(self.ctx.instance_id, self._kv_seq + 1, stored, removed, cleared=snapshot):
            self._kv_seq = event.seq
            await self.ctx.bus.publish(subjects.kv_events(self.ctx.instance_id), event)

    async def _kv_event_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.ctx.settings.worker.kv_snapshot_interval_s
        next_snapshot = loop.time() + interval
        while True:
            await asyncio.sleep(0.05)
            snapshot = loop.time() >= next_snapshot
            if snapshot:
                next_snapshot = loop.time() + interval
            try:
                await self._publish_kv_events(snapshot)
            except Exception:  # never let routing hints kill the worker
                log.exception("publishing KV events failed")


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A subject an engine stage takes work on, its message type and its handler
    (which answers with an Ack)."""

    subject: str
    message_type: type[Message]
    handle: Callable[[Any], Awaitable[Message | None]]


async def serve_engine_stage(
    ctx: ServiceContext,
    stack: AsyncExitStack,
    make_dispatch: Callable[[Worker], Sequence[Dispatch]],
    *,
    share_kv: bool = False,
) -> None:
    """The setup both engine stages share: the engine with its KV connector chain
    (shared/kv/connectors/chain.py; loaded off the event loop), the worker duties,
    the dispatch subscriptions and cancels. share_kv: peers may read held blocks
    straight out of this engine's cache (prefill): mapped into their process on
    this host (kv_transfer.peer_copy), or through NIXL from anywhere
    (kv_transfer.nixl); it then hears their releases and answers their NIXL
    metadata asks. The exit stack unwinds intake first, then the drain, then the rest."""
    loop = asyncio.get_running_loop()

    def release(instance_id: str, request_id: str) -> None:  # from the connector's thread
        message = mesh_pb2.KvRelease(request_id=request_id)
        publish = ctx.bus.publish(subjects.kv_release(instance_id), message)
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(publish))

    transfer = ctx.settings.kv_transfer

    def fetch_nixl_metadata(instance_id: str) -> bytes:  # from the connector's thread
        ask = ctx.bus.request(subjects.kv_nixl(instance_id), mesh_pb2.NixlMetadataRequest(), mesh_pb2.NixlMetadata,
                              timeout=transfer.nixl_metadata_timeout_s)  # fmt: skip
        reply = asyncio.run_coroutine_threadsafe(ask, loop).result(transfer.nixl_metadata_timeout_s + 1.0)
        if not reply.metadata:
            raise ConnectionError(f"{instance_id} has no NIXL agent")
        return reply.metadata

    chain = connector_chain(ctx.settings.kvcache, transfer, ctx.settings.engine.host_kv_cache_bytes,
                            ctx.instance_id, release, fetch_nixl_metadata,
                            loopback_only=ctx.settings.worker.binds_loopback)  # fmt: skip
    try:
        # Token ids only (text is the balancer's job), and block events for its routing.
        engine = await asyncio.to_thread(
            LLMEngine, ctx.settings.engine, detokenize=False, record_kv_events=True, kv_connector=chain.head,
            share_kv=share_kv and transfer.peer_copy, load_progress=True,  # in the log: `infermesh up` shows it as a progress bar
        )  # fmt: skip
    except BaseException:
        chain.head.close()
        raise
    stack.callback(engine.close)  # after the drain below has stopped the engine thread
    # Only an engine that holds blocks for peers offers them through NIXL (decode's link reads).
    nixl = chain.nixl if share_kv and chain.nixl is not None and chain.nixl.ready else None
    vision_language = engine.model.config.vision_language is not None
    embeddings = None
    if vision_language:  # embeddings a vision instance stored (E/P/D) come from kvcache, on this loop
        from shared.kv.wire.client import KVCacheClient

        embeddings = KVCacheClient(ctx.settings.kvcache.address, chunk_bytes=ctx.settings.kvcache.chunk_bytes,
                                   timeout_s=ctx.settings.vision.fetch_timeout_s, shm_bytes=0)
        stack.push_async_callback(embeddings.close)
    arena_reader = None
    if vision_language and chain.nixl is not None and chain.nixl.agent is not None:
        # Vision instances' arenas through NIXL (vision.nixl there), with the process's one agent.
        from shared.stage.embedding_nixl import NixlArenaReader

        arena_reader = NixlArenaReader(chain.nixl.agent, fetch_nixl_metadata, ctx.settings.vision.fetch_timeout_s)
        stack.callback(arena_reader.close)  # before engine.close ends the agent
    images = await StageImages.load(ctx.settings.engine.model, vision_language, embeddings,
                                    ctx.settings.vision.fetch_timeout_s, ctx.metrics, arena_reader)
    worker = Worker(ctx, engine, chain.kvcache, nixl, images)
    routes = list(make_dispatch(worker))
    await worker.start(stack)
    routes.append(Dispatch(subjects.CANCEL, mesh_pb2.Cancel, worker.on_cancel))
    routes.append(Dispatch(subjects.reset_prefix_cache(ctx.stage, ctx.instance_id), mesh_pb2.ResetPrefixCache,
                           worker.on_reset_prefix_cache))
    if share_kv:
        routes.append(Dispatch(subjects.kv_release(ctx.instance_id), mesh_pb2.KvRelease, worker.on_kv_release))
        if nixl is not None:
            routes.append(Dispatch(subjects.kv_nixl(ctx.instance_id), mesh_pb2.NixlMetadataRequest, worker.on_nixl_metadata))
    for route in routes:
        sub = await ctx.bus.subscribe(route.subject, route.message_type, route.handle)
        stack.push_async_callback(sub.unsubscribe)
    worker.mark_subscribed()
    ctx.metrics.set_readiness(worker.not_ready)


def validate_prompt(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> None:
    """The checks the engine would make, done before accepting work, so a bad
    request is refused in the Ack rather than failing later."""
    if not prompt:
        raise ValueError("the prompt is empty")
    vocab = engine.model.config.vocab_size
    if any(not 0 <= t < vocab for t in prompt):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if len(prompt) >= engine.max_model_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model takes at most {engine.max_model_len}")


async def fail_stream(
    bus: Bus, request_id: str, instance_id: str, message: str, code: int = mesh_pb2.ERROR_CODE_INTERNAL
) -> None:
    """End a request's token stream with an error, so the balancer answers the
    client (or moves the request) instead of waiting for a timeout. From prefill,
    a retryable code (OVERLOADED, SHUTTING_DOWN) says the decode instance did not
    take the handoff; any other code, that prefill itself failed."""
    chunk = mesh_pb2.TokenChunk(
        request_id=request_id,
        final=True,
        error_code=code,
        error=message,
        instance_id=instance_id,
    )
    with contextlib.suppress(Exception):
        await StreamPublisher(bus, instance_id, request_id).send(chunk)
