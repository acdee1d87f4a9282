"""The mesh as a Generator: route a request to a prefill and a decode
instance, dispatch it over NATS, and turn the decode instance's token stream
into TokenEvents.

Failure handling: a refusal from an overloaded or draining prefill instance is
retried on the next candidate. Once accepted, a request fails over (migrates:
prompt + tokens so far go to other instances) when an instance it depends on
fails it: an error chunk, a silent stream, or, at once, the instance leaving the
registry (missed heartbeats, a restart) — the prefill instance until decode's
first chunk, the decode instance until the end. The failure is charged to the
instance at fault, which the retry avoids: a prefill error to prefill; a
handoff that decode refused or did not answer (prefill reports it with a
retryable code, OVERLOADED or SHUTTING_DOWN) to decode; decode's errors to
decode. Leaving the iteration early publishes a cancel that every worker
applies. Nothing waits forever.

A NATS outage (the server restarted, the balancer's link dropped) is nobody's
fault and loses whatever was in flight: chunks the server held when it died,
and those a worker that reconnected before the balancer sent to nobody. The
registry does not read the balancer's own outage as every instance's death
(registry.py); here, a stream that misses a seq while later ones come, or says
nothing for a while once the bus is back (LOST_AFTER_S, LOST_BEFORE_FIRST_S),
counts as lost and moves like a failure (cause "lost"), charged to nobody:
its tokens so far went out, so the continuation resumes after them. Requests
that arrive while the bus is down, or find no instance that answers while it
recovers, wait for it and retry (up to OUTAGE_WAIT_S) instead of failing. A move
for lost chunks, or any move while the bus recovers (down, or back for less than
OUTAGE_WINDOW_S), does not count against migration_limit: up to OUTAGE_MOVES
such moves are allowed on top.

Stream integrity: each attempt listens only on the stream subjects of the
instances it was handed to (`im.stream.<instance>.<request>`, see
bus.StreamReader); a chunk from anyone else is dropped and counted
(`stream_chunks_rejected_total`, and a `stream.chunk_rejected` event on the
request's span). Errors that reach the client say what happened, never where
(no instance addresses or worker messages): those go to the log and the trace.
"""

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator

import nats.errors
from opentelemetry import trace
from opentelemetry.trace import Span, Tracer

from services.balancer.generation import GenerationError, GenerationRequest, TokenEvent, Usage
from services.balancer.router.policies import (
    Choice,
    choose_decode,
    choose_decode_by_cache,
    choose_prefill,
    choose_prefill_site,
    conditional_disaggregation,
    leading_blocks_held,
)
from services.balancer.router.registry import Instance, Registry
from shared.kv.block_hash import BlockHash, hash_block_chain
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import Bus, StreamLost, StreamReader, StreamTimeout
from shared.runtime.metrics import Metrics
from shared.runtime.settings import BalancerSettings
from shared.stage.convert import logprobs_from_proto, params_to_proto

log = logging.getLogger(__name__)

_RETRYABLE = (mesh_pb2.ERROR_CODE_OVERLOADED, mesh_pb2.ERROR_CODE_SHUTTING_DOWN)

LOST_AFTER_S = 2.0
"""Once the bus is back, a stream that had started must say something within this
(a decode instance streams every step; its reconnect may trail ours by a reconnect
wait, 0.5 s), else it is lost: its last chunks, the final one maybe, died with the server."""
LOST_BEFORE_FIRST_S = 10.0
"""The same for a request that had no chunk yet: it may be queued in prefill, and
a handoff lost in the outage is reported by prefill only after its request timeout.
Sooner when its prefill instance says, in a heartbeat after the outage, that it
has nothing running nor waiting: then the request is past prefill, and decode,
which streams the first token as soon as it takes a request, gets LOST_AFTER_S."""
OUTAGE_WAIT_S = 10.0
"""How long a request waits for the bus to come back, or for an instance that
answers while it recovers, before it fails with 503."""
OUTAGE_WINDOW_S = 10.0
"""How long after the bus came back a failure is still counted as the outage's."""
OUTAGE_MOVES = 2
"""Moves a request may make, on top of migration_limit, while the bus recovers."""


class _InstanceFailed(Exception):
    """Instances failed a request they had accepted: worth migrating, elsewhere."""

    def __init__(self, message: str, *instance_ids: str, cause: str = "error") -> None:
        super().__init__(message)
        self.instance_ids = set(instance_ids)
        self.cause = cause


@dataclasses.dataclass(slots=True, frozen=True)
class _Route:
    prefill: str
    decode: str


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
        self.bus = bus
        self.registry = registry
        self.tracer = tracer
        self.settings = settings
        self.block_size = block_size
        self.kv_fingerprint = kv_fingerprint
        self.rng = rng or random.Random()
        self._in_flight = 0
        self._background: set[asyncio.Task] = set()
        self._watchers: dict[str, set[StreamReader]] = {}
        """Per instance id, the streams of the attempts that depend on it."""
        self._leaving: dict[str, set[asyncio.Future[str]]] = {}
        """Per instance id, dispatches waiting for its Ack: told when it leaves."""
        self._streaming: dict[StreamReader, _Route] = {}
        """The streams of dispatched attempts: checked for losses when the bus comes back."""
        registry.on_removed.append(self._on_instance_removed)
        registry.on_beat.append(self._on_beat)
        bus.on_reconnected.append(self._on_bus_reconnected)
        metrics = metrics or Metrics("balancer")
        self.m_rejected = metrics.counter(
            "stream_chunks_rejected_total", "Stream chunks dropped: from an instance the request was not handed to, "
            "naming another instance or request, a repeated seq, or on the old subject form", ("reason",)
        )
        self.m_migrations = metrics.counter(
            "migrations_total", "Requests moved to other instances, by cause (left_mesh: the registry lost the "
            "instance; error; timeout; handoff: decode did not take prefill's handoff; lost: chunks lost in a NATS "
            "outage)", ("cause",)
        )
        self.m_prefill_site = metrics.counter(
            "prefill_site_total", "Requests by where their prompt was computed (remote: on a prefill instance; local: "
            "on their decode instance, conditional disaggregation) and why", ("site", "reason")
        )
        self.m_migration_gap = metrics.histogram(
            "migration_gap_seconds", "What a moved request's client waited: from its last token before the failure "
            "(or its start) to its first token after the move"
        )

    def num_in_flight(self) -> int:
        return self._in_flight

    def reject_chunk(
        self, reason: str, chunk: mesh_pb2.TokenChunk, span: Span | None = None, tally: list[int] | None = None
    ) -> None:
        """Count a stream chunk nobody may send; note it on the request's span (an
        event, and the request's running count in tally as `stream.rejected_chunks`)."""
        self.m_rejected.labels(reason).inc()
        log.debug("dropped a stream chunk (%s) claiming %s for %s", reason, chunk.instance_id or "?",
                  chunk.request_id or "?")
        if span is not None:
            span.add_event("stream.chunk_rejected", {"reason": reason, "claimed_instance": chunk.instance_id})
            if tally is not None:
                tally[0] += 1
                span.set_attribute("stream.rejected_chunks", tally[0])

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self._in_flight += 1
        try:
            async for event in self._generate(request):
                yield event
        finally:
            self._in_flight -= 1

    async def _generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Run the request; when an instance fails it after accepting it, migrate:
        re-dispatch prompt + tokens generated so far to other instances and go
        on streaming (up to migration_limit times, plus OUTAGE_MOVES for a NATS
        outage's losses), as Dynamo does. Greedy output
        is unchanged by a migration, and so is a seeded sample: its draws are keyed by
        (seed, position) and the continuation's positions go on where they stopped."""
        # The HTTP layer's request span: TTFT and cache figures belong on the trace's root.
        root = trace.get_current_span()
        started = time.perf_counter()
        generated: list[int] = []
        cached: int | None = None
        excluded: set[str] = set()
        rejected = [0]  # chunks dropped from this request's streams
        attempt = req
        last_token = started  # when tokens last went out (the start before any)
        moved = False
        migration = 0  # moves so far
        charged = 0  # those counted against migration_limit (the others: a NATS outage's)
        while True:
            if migration:
                attempt = self._continuation(req, generated, migration)
            try:
                async for event in self._attempt(attempt, excluded, root, time.perf_counter(), rejected, migration):
                    now = time.perf_counter()
                    if moved and event.token_ids:
                        moved = False
                        self.m_migration_gap.observe(now - last_token)
                        root.set_attribute("migration.gap_ms", round((now - last_token) * 1e3, 2))
                        root.set_attribute("migration.resumed_unix", time.time())  # to line up with a death
                    if event.token_ids:
                        last_token = now
                    if not generated and event.token_ids:
                        root.set_attribute("ttft_ms", round((now - started) * 1e3, 2))
                    generated += event.token_ids
                    if event.usage is not None:
                        cached = event.usage.cached_tokens if cached is None else cached
                        u = event.usage
                        event.usage = Usage(len(req.prompt_token_ids), len(generated), cached,
                                            u.spec_drafted_tokens, u.spec_accepted_tokens)  # fmt: skip
                    yield event
                return
            except _InstanceFailed as exc:
                outage = exc.cause == "lost" or self._recovering()
                over = migration - charged >= OUTAGE_MOVES if outage else charged >= self.settings.migration_limit
                if over:
                    raise GenerationError(
                        "The mesh failed this request, also after moving it to other instances; retry.", status=503
                    ) from None
                charged += not outage
                migration += 1
                moved = True
                excluded |= exc.instance_ids
                self.m_migrations.labels(exc.cause).inc()
                log.warning("request %s: %s; migrating (%d, %d of %d counted%s)", req.request_id, exc, migration,
                            charged, self.settings.migration_limit, ", NATS outage" if outage else "")
                root.set_attribute("migrations", migration)
                root.add_event("migrate", {"cause": exc.cause, "error": str(exc), "tokens_so_far": len(generated),
                                           "outage": outage})

    def _recovering(self) -> bool:
        """The bus is down, or came back less than OUTAGE_WINDOW_S ago."""
        bus = self.bus
        back = bus.reconnected_at
        return bus.down_since is not None or (back is not None and time.monotonic() - back < OUTAGE_WINDOW_S)

    def _on_bus_reconnected(self) -> None:
        """The bus is back: whatever was in flight may be gone. Every dispatched stream
        must now say something soon, or it moves."""
        now = time.monotonic()
        for reader in self._streaming:
            reader.expect_by(now + (LOST_AFTER_S if reader.started else LOST_BEFORE_FIRST_S))

    def _on_beat(self, inst: Instance) -> None:
        """An idle prefill instance after an outage: the requests it had that have not
        started streaming are past it (with decode, or lost): LOST_AFTER_S for them."""
        if inst.stage != "prefill" or inst.load.num_running or inst.load.num_waiting:
            return
        deadline = time.monotonic() + LOST_AFTER_S
        for reader, route in self._streaming.items():
            if route.prefill == inst.instance_id and reader.expecting and not reader.started:
                reader.expect_by(deadline)

    @staticmethod
    def _continuation(req: GenerationRequest, generated: list[int], migration: int) -> GenerationRequest:
        p = req.params
        params = dataclasses.replace(
            p, max_tokens=p.max_tokens - len(generated), min_tokens=max(p.min_tokens - len(generated), 0),
            # The prompt's logprobs came with the first token: the continuation's longer prompt is not scored.
            prompt_logprobs=p.prompt_logprobs if not generated else None,
        )
        return GenerationRequest(
            f"{req.request_id}-m{migration}", req.prompt_token_ids + generated, params, req.cache_salt, req.priority
        )

    # -- failover from the registry -------------------------------------------------------

    def _watch(self, reader: StreamReader, instance_id: str) -> None:
        self._watchers.setdefault(instance_id, set()).add(reader)
        if self.registry.get(instance_id) is None:  # it left while we dispatched
            self._fail(reader, instance_id, "left the mesh")

    def _unwatch(self, reader: StreamReader, instance_id: str) -> None:
        readers = self._watchers.get(instance_id)
        if readers is not None:
            readers.discard(reader)
            if not readers:
                del self._watchers[instance_id]

    def _on_instance_removed(self, inst: Instance, why: str) -> None:
        for reader in self._watchers.pop(inst.instance_id, set()):
            self._fail(reader, inst.instance_id, why)
        for gone in self._leaving.pop(inst.instance_id, set()):
            if not gone.done():
                gone.set_result(why)

    async def _request_unless_gone(self, instance_id: str, subject: str, msg: mesh_pb2.PrefillRequest) -> mesh_pb2.Ack:
        """The instance's Ack; _InstanceFailed as soon as it leaves the registry (a
        dispatch that reached a dying instance is not waited on for the whole timeout).
        The request then moves under a new id and its old id is cancelled: should the
        instance only have been frozen, its late work on the old id is dropped."""
        gone_error = _InstanceFailed(f"instance {instance_id} left the mesh during dispatch", instance_id,
                                     cause="left_mesh")
        if self.registry.get(instance_id) is None:
            raise gone_error
        gone: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._leaving.setdefault(instance_id, set()).add(gone)
        ack = asyncio.ensure_future(self.bus.request(subject, msg, mesh_pb2.Ack))
        try:
            await asyncio.wait((ack, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting = self._leaving.get(instance_id)
            if waiting is not None:
                waiting.discard(gone)
                if not waiting:
                    del self._leaving[instance_id]
            if not ack.done():
                ack.cancel()
        if not ack.done() or ack.cancelled():
            self._cancel_soon(msg.request_id)
            raise gone_error
        reply = ack.result()
        self.registry.touch(instance_id)  # it answered: alive
        return reply

    @staticmethod
    def _fail(reader: StreamReader, instance_id: str, why: str) -> None:
        reader.fail(_InstanceFailed(f"instance {instance_id} {why}", instance_id, cause="left_mesh"))

    # -- one attempt ------------------------------------------------------------------------

    async def _attempt(
        self, req: GenerationRequest, excluded: set[str], root: Span, started: float, rejected: list[int],
        migration: int = 0,
    ) -> AsyncIterator[TokenEvent]:
        rid = req.request_id
        finished = False

        def on_rejected(reason: str, chunk: mesh_pb2.TokenChunk) -> None:
            self.reject_chunk(reason, chunk, root, rejected)

        # A chunk that passed the checks is proof of life, as it arrives (its heartbeat may be late).
        async with StreamReader(self.bus, rid, on_rejected, lambda chunk: self.registry.touch(chunk.instance_id)) as reader:
            route = await self._dispatch(req, excluded, reader)
            if migration:  # handed to its new instances: when, to line up with a death
                root.set_attribute("migration.dispatched_unix", time.time())
            # Not the current span: this generator yields, and a span made current
            # across a yield would be detached in another context when closed.
            local = route.prefill == route.decode
            span = self.tracer.start_span(
                "stream",
                attributes={"decode.instance": route.decode, "prefill.instance": route.prefill, "prefill.local": local},
            )
            self._watch(reader, route.prefill)
            self._watch(reader, route.decode)
            self._streaming[reader] = route
            num_tokens = 0
            num_chunks = 0
            try:
                async for chunk in reader.chunks(self.settings.first_token_timeout_s, self.settings.token_timeout_s):
                    if chunk.error:
                        span.set_attribute("error", chunk.error)
                        if chunk.error_code == mesh_pb2.ERROR_CODE_INVALID_REQUEST:
                            raise GenerationError(chunk.error, status=400, error_type="invalid_request_error")
                        if chunk.instance_id != route.decode:
                            if chunk.error_code in _RETRYABLE:
                                raise _InstanceFailed(f"the handoff to decode failed: {chunk.error}", route.decode,
                                                      cause="handoff")
                            raise _InstanceFailed(chunk.error, route.prefill)
                        raise _InstanceFailed(chunk.error, route.decode)
                    if num_chunks == 0 and not local:  # decode has the request: prefill's fate no longer matters
                        self._unwatch(reader, route.prefill)
                    num_chunks += 1
                    if num_tokens == 0:
                        span.set_attribute("ttft_ms", round((time.perf_counter() - started) * 1e3, 2))
                    num_tokens += len(chunk.token_ids)
                    event = TokenEvent(
                        token_ids=list(chunk.token_ids),
                        logprobs=[logprobs_from_proto(lp) for lp in chunk.logprobs],
                    )
                    if num_chunks == 1 and req.params.prompt_logprobs is not None:
                        event.prompt_logprobs = [None, *(logprobs_from_proto(lp) for lp in chunk.prompt_logprobs)]
                    if chunk.HasField("usage"):
                        u = chunk.usage
                        event.usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens,
                                            u.spec_drafted_tokens, u.spec_accepted_tokens)  # fmt: skip
                        root.set_attribute("prompt.cached_tokens", chunk.usage.cached_tokens)
                    if chunk.final:
                        finished = True
                        event.finish_reason = chunk.finish_reason or "stop"
                        span.set_attribute("output.tokens", num_tokens)
                        span.set_attribute("prompt.cached_tokens", chunk.usage.cached_tokens)
                    yield event
            except StreamLost as exc:
                span.set_attribute("error", str(exc))
                raise _InstanceFailed(f"lost in a NATS outage: {exc}", cause="lost") from None
            except StreamTimeout as exc:
                span.set_attribute("error", str(exc))
                # Before decode's first chunk the request may as well be stuck in prefill.
                culprits = (route.decode,) if num_chunks else (route.decode, route.prefill)
                raise _InstanceFailed(f"the mesh did not answer in time: {exc}", *culprits, cause="timeout") from None
            except _InstanceFailed as exc:
                span.set_attribute("error", str(exc))
                raise
            finally:
                self._streaming.pop(reader, None)
                self._unwatch(reader, route.prefill)
                self._unwatch(reader, route.decode)
                span.end()
                if not finished:  # an error, a stop string or a client gone: stop the work everywhere
                    self._cancel_soon(rid)

    def _cancel_soon(self, request_id: str) -> None:
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

    def _candidates(self, stage: str) -> list[Instance]:
        """The live instances of the stage; when none is, those only late with their
        heartbeat (not yet dropped: a dead one is dropped within a sweep or two), rather
        than a certain 503 while the machine is busy."""
        return self.registry.live(stage) or self.registry.live(stage, include_silent=True)

    @staticmethod
    def _prefer(candidates: list[Instance], excluded: set[str]) -> list[Instance]:
        """The candidates that have not failed this request; all of them if every one has
        (still live: worth one more try rather than a certain failure)."""
        return [i for i in candidates if i.instance_id not in excluded] or candidates

    async def _dispatch(self, req: GenerationRequest, excluded: set[str], reader: StreamReader) -> _Route:
        """Choose the instances, listen to their streams and hand the request to
        prefill. Retries other prefill instances that refuse because they are busy
        or draining, or do not answer. Instances that failed this request before
        are chosen again only when no other is live."""
        hashes = hash_block_chain(req.prompt_token_ids, self.block_size, self.kv_fingerprint, req.cache_salt)
        deadline = time.monotonic() + OUTAGE_WAIT_S
        with self.tracer.start_as_current_span("route") as span:
            span.set_attribute("request.id", req.request_id)
            span.set_attribute("prompt.tokens", len(req.prompt_token_ids))
            await self._wait_for_bus(span)
            s = self.settings
            by_cache = conditional_disaggregation(s.local_prefill_max_tokens, s.local_prefill_queue_tokens)
            while True:
                try:
                    candidates = self._prefer(self._candidates("decode"), excluded)
                    if by_cache:  # the prompt may be computed there: its own cache counts
                        decode = choose_decode_by_cache(
                            candidates, hashes, len(req.prompt_token_ids), self.block_size, self.rng
                        )
                    else:
                        decode = choose_decode(candidates, self.rng)
                    break
                except LookupError as exc:
                    if not await self._outage_retry(deadline, span):
                        raise GenerationError(str(exc), status=503) from None
            # Reserved now, before the first await, as prefill's tokens are below: a burst
            # routed meanwhile must see it (choose_decode_by_cache would send a whole burst
            # sharing a prefix to the one instance holding it); given back if this fails.
            decode.instance.in_flight += 1
            try:
                return await self._dispatch_to(req, hashes, decode, excluded, reader, span, deadline)
            except BaseException:
                decode.instance.in_flight = max(decode.instance.in_flight - 1, 0)
                raise

    async def _dispatch_to(
        self, req: GenerationRequest, hashes: list[BlockHash], decode: Choice, excluded: set[str],
        reader: StreamReader, span: Span, deadline: float,
    ) -> _Route:
        """_dispatch once its decode instance is chosen: where the prompt is computed, then
        to that decode instance or to a prefill instance that takes it."""
        s = self.settings
        did = decode.instance.instance_id
        span.set_attribute("decode.candidates", list(decode.scores))
        span.set_attribute("decode.scores", list(decode.scores.values()))
        span.set_attribute("decode.reason", decode.reason)
        span.set_attribute("decode.choice", did)
        await reader.listen(did)
        site = choose_prefill_site(
            self._prefer(self._candidates("prefill"), excluded), hashes, len(req.prompt_token_ids),
            self.block_size, s.local_prefill_max_tokens, s.local_prefill_queue_tokens, decode.instance,
        )  # fmt: skip
        span.set_attribute("prefill.local", site.local)
        span.set_attribute("prefill.site_reason", site.reason)
        span.set_attribute("prefill.queued_tokens", site.queued_tokens)
        if site.local:
            self.m_prefill_site.labels("local", site.reason).inc()
            return await self._dispatch_local(req, decode.instance, span)
        tried: set[str] = set()
        last_error = "no live prefill instance"
        while True:
            live = [i for i in self._candidates("prefill") if i.instance_id not in tried]
            if not live and await self._outage_retry(deadline, span):
                tried.clear()  # while the bus recovers, one that did not answer may now
                continue
            try:
                prefill = choose_prefill(self._prefer(live, excluded), hashes, self.rng)
            except LookupError:
                log.warning("request %s: no prefill instance took it: %s", req.request_id, last_error)
                span.set_attribute("error", last_error)
                raise GenerationError("No prefill instance could take the request; retry later.",
                                      status=503) from None
            pid = prefill.instance.instance_id
            tried.add(pid)
            # Reserved now, before the first await: the requests routed while this one
            # waits for its ack must see these tokens queued (a burst of 16 otherwise all
            # saw an idle prefill instance, and conditional disaggregation never triggered).
            held = leading_blocks_held(prefill.instance, hashes) * self.block_size
            reserved = max(len(req.prompt_token_ids) - held, 0)
            prefill.instance.in_flight_tokens += reserved
            span.set_attribute("prefill.candidates", list(prefill.scores))
            span.set_attribute("prefill.scores", list(prefill.scores.values()))
            span.set_attribute("prefill.choice", pid)
            span.set_attribute("prefill.reason", prefill.reason)
            msg = _prefill_request(req, did)
            try:
                await reader.listen(pid, source=False)  # prefill may only end the stream with an error
                await self._wait_for_bus(span)
            except BaseException:
                _unreserve(prefill.instance, reserved)
                raise
            try:
                ack = await self._request_unless_gone(pid, subjects.prefill_run(pid), msg)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
                last_error = f"prefill instance {pid} did not answer ({type(exc).__name__})"
                _unreserve(prefill.instance, reserved)
                continue
            except BaseException:
                _unreserve(prefill.instance, reserved)
                raise
            if ack.accepted:
                self.m_prefill_site.labels("remote", site.reason).inc()
                prefill.instance.in_flight += 1
                return _Route(pid, did)
            _unreserve(prefill.instance, reserved)
            if ack.code not in _RETRYABLE:
                raise GenerationError(ack.message, status=400, error_type="invalid_request_error")
            last_error = f"prefill instance {pid} refused: {ack.message}"

    async def _dispatch_local(self, req: GenerationRequest, decode: Instance, span: Span) -> _Route:
        """Hand the whole request to its decode instance, which prefills it too (the
        route's two stages are then one instance). A decode instance that refuses or does
        not answer fails this attempt, charged to it: the request moves."""
        did = decode.instance_id
        msg = _prefill_request(req, did)
        await self._wait_for_bus(span)
        try:
            ack = await self._request_unless_gone(did, subjects.decode_run(did), msg)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            raise _InstanceFailed(f"decode instance {did} did not answer ({type(exc).__name__})", did,
                                  cause="handoff") from None
        if not ack.accepted:
            if ack.code not in _RETRYABLE:
                raise GenerationError(ack.message, status=400, error_type="invalid_request_error")
            raise _InstanceFailed(f"decode instance {did} refused: {ack.message}", did, cause="handoff")
        return _Route(did, did)

    async def _wait_for_bus(self, span: Span) -> None:
        """Wait for the bus, when it is down, up to OUTAGE_WAIT_S; 503 if it is not back."""
        if self.bus.connected:
            return
        span.add_event("wait_for_bus")
        if not await self.bus.wait_connected(OUTAGE_WAIT_S):
            raise GenerationError("The mesh's message bus is down; retry later.", status=503)

    async def _outage_retry(self, deadline: float, span: Span) -> bool:
        """While the bus recovers and before the deadline: wait a moment (and for the bus)
        and say to try again; else False (no instance: fail as usual)."""
        if not self._recovering() or time.monotonic() >= deadline:
            return False
        span.add_event("outage_retry")
        await asyncio.sleep(0.2)
        await self._wait_for_bus(span)
        return True


def _prefill_request(req: GenerationRequest, decode_instance: str) -> mesh_pb2.PrefillRequest:
    """The request as a prefill instance, or its decode instance prefilling it, takes it."""
    return mesh_pb2.PrefillRequest(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=params_to_proto(req.params),
        cache_salt=req.cache_salt or "",
        decode_instance=decode_instance,
    )


def _unreserve(instance: Instance, tokens: int) -> None:
    """Take back tokens reserved on a prefill instance that did not take the request (a
    heartbeat since may have zeroed the count: never below 0)."""
    instance.in_flight_tokens = max(instance.in_flight_tokens - tokens, 0)
