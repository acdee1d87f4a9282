"""The mesh as a Generator: route a request to a prefill and a decode
instance, dispatch it over NATS, and turn the decode instance's token stream
into TokenEvents.

Failure handling: a refusal from an overloaded or draining prefill instance is
retried on the next candidate; a silent stream (no chunk in time) or an error
chunk ends the request with an error; leaving the iteration early publishes a
cancel that every worker applies. Nothing waits forever.
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
from services.balancer.policies import choose_decode, choose_prefill
from services.balancer.registry import Registry
from shared.kv.block_hash import hash_block_chain
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import Bus, StreamReader, StreamTimeout
from shared.runtime.settings import BalancerSettings
from shared.stage.convert import logprobs_from_proto, params_to_proto

log = logging.getLogger(__name__)

_RETRYABLE = (mesh_pb2.ERROR_CODE_OVERLOADED, mesh_pb2.ERROR_CODE_SHUTTING_DOWN)


class _InstanceFailed(Exception):
    """An instance failed a request it had accepted: worth migrating."""

    def __init__(self, message: str, decode_id: str) -> None:
        super().__init__(message)
        self.decode_id = decode_id


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

    def num_in_flight(self) -> int:
        return self._in_flight

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
        on streaming (up to migration_limit times), as Dynamo does. Greedy output
        is unchanged by a migration; a seeded sample restarts its randomness."""
        # The HTTP layer's request span: TTFT and cache figures belong on the trace's root.
        root = trace.get_current_span()
        started = time.perf_counter()
        generated: list[int] = []
        cached: int | None = None
        excluded: set[str] = set()
        attempt = req
        last: Exception | None = None
        for migration in range(self.settings.migration_limit + 1):
            if migration:
                attempt = self._continuation(req, generated, migration)
            try:
                async for event in self._attempt(attempt, excluded, root, time.perf_counter()):
                    if not generated and event.token_ids:
                        root.set_attribute("ttft_ms", round((time.perf_counter() - started) * 1e3, 2))
                    generated += event.token_ids
                    if event.usage is not None:
                        cached = event.usage.cached_tokens if cached is None else cached
                        event.usage = Usage(len(req.prompt_token_ids), len(generated), cached)
                    yield event
                return
            except _InstanceFailed as exc:
                excluded.add(exc.decode_id)
                log.warning("request %s: %s; migrating (%d/%d)", req.request_id, exc, migration + 1,
                            self.settings.migration_limit)
                root.set_attribute("migrations", migration + 1)
                last = exc
        raise GenerationError(f"the mesh failed this request: {last}", status=503)

    @staticmethod
    def _continuation(req: GenerationRequest, generated: list[int], migration: int) -> GenerationRequest:
        p = req.params
        params = dataclasses.replace(
            p, max_tokens=p.max_tokens - len(generated), min_tokens=max(p.min_tokens - len(generated), 0)
        )
        return GenerationRequest(
            f"{req.request_id}-m{migration}", req.prompt_token_ids + generated, params, req.cache_salt
        )

    async def _attempt(
        self, req: GenerationRequest, excluded: set[str], root: Span, started: float
    ) -> AsyncIterator[TokenEvent]:
        rid = req.request_id
        finished = False
        async with StreamReader(self.bus, rid) as reader:
            decode_id = await self._dispatch(req, excluded)
            # Not the current span: this generator yields, and a span made current
            # across a yield would be detached in another context when closed.
            span = self.tracer.start_span("stream", attributes={"decode.instance": decode_id})
            num_tokens = 0
            try:
                async for chunk in reader.chunks(self.settings.first_token_timeout_s, self.settings.token_timeout_s):
                    if chunk.error:
                        if chunk.error_code == mesh_pb2.ERROR_CODE_INVALID_REQUEST:
                            raise GenerationError(chunk.error, status=400, error_type="invalid_request_error")
                        raise _InstanceFailed(chunk.error, decode_id)
                    if num_tokens == 0:
                        span.set_attribute("ttft_ms", round((time.perf_counter() - started) * 1e3, 2))
                    num_tokens += len(chunk.token_ids)
                    event = TokenEvent(
                        token_ids=list(chunk.token_ids),
                        logprobs=[logprobs_from_proto(lp) for lp in chunk.logprobs],
                    )
                    if chunk.HasField("usage"):
                        event.usage = Usage(
                            chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.cached_tokens
                        )
                        root.set_attribute("prompt.cached_tokens", chunk.usage.cached_tokens)
                    if chunk.final:
                        finished = True
                        event.finish_reason = chunk.finish_reason or "stop"
                        span.set_attribute("output.tokens", num_tokens)
                        span.set_attribute("prompt.cached_tokens", chunk.usage.cached_tokens)
                    yield event
            except StreamTimeout as exc:
                span.set_attribute("error", str(exc))
                raise _InstanceFailed(f"the mesh did not answer in time: {exc}", decode_id) from None
            finally:
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

    async def _dispatch(self, req: GenerationRequest, excluded_decode: set[str]) -> str:
        """Choose the instances and hand the request to prefill; returns the
        decode instance's id. Retries other prefill instances that refuse
        because they are busy or draining. Decode instances that failed this
        request before are not chosen again."""
        hashes = hash_block_chain(req.prompt_token_ids, self.block_size, self.kv_fingerprint, req.cache_salt)
        with self.tracer.start_as_current_span("route") as span:
            span.set_attribute("request.id", req.request_id)
            span.set_attribute("prompt.tokens", len(req.prompt_token_ids))
            try:
                live = [i for i in self.registry.live("decode") if i.instance_id not in excluded_decode]
                decode = choose_decode(live, self.rng)
            except LookupError as exc:
                raise GenerationError(str(exc), status=503) from None
            span.set_attribute("decode.candidates", list(decode.scores))
            span.set_attribute("decode.choice", decode.instance.instance_id)
            tried: set[str] = set()
            last_error = "no live prefill instance"
            while True:
                candidates = [i for i in self.registry.live("prefill") if i.instance_id not in tried]
                try:
                    prefill = choose_prefill(candidates, hashes, self.rng)
                except LookupError:
                    raise GenerationError(last_error, status=503) from None
                pid = prefill.instance.instance_id
                tried.add(pid)
                span.set_attribute("prefill.candidates", list(prefill.scores))
                span.set_attribute("prefill.scores", list(prefill.scores.values()))
                span.set_attribute("prefill.choice", pid)
                span.set_attribute("prefill.reason", prefill.reason)
                msg = mesh_pb2.PrefillRequest(
                    request_id=req.request_id,
                    prompt_token_ids=req.prompt_token_ids,
                    sampling=params_to_proto(req.params),
                    cache_salt=req.cache_salt or "",
                    decode_instance=decode.instance.instance_id,
                )
                try:
                    ack = await self.bus.request(subjects.prefill_run(pid), msg, mesh_pb2.Ack)
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
                    last_error = f"prefill instance {pid} did not answer ({type(exc).__name__})"
                    continue
                if ack.accepted:
                    prefill.instance.in_flight += 1
                    decode.instance.in_flight += 1
                    return decode.instance.instance_id
                if ack.code not in _RETRYABLE:
                    raise GenerationError(ack.message, status=400, error_type="invalid_request_error")
                last_error = f"prefill instance {pid} refused: {ack.message}"
