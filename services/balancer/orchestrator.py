"""The mesh as a Generator: route a request to a prefill and a decode
instance, dispatch it over NATS, and turn the decode instance's token stream
into TokenEvents.

Failure handling: a refusal from an overloaded or draining prefill instance is
retried on the next candidate; a silent stream (no chunk in time) or an error
chunk ends the request with an error; leaving the iteration early publishes a
cancel that every worker applies. Nothing waits forever.
"""

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator

import nats.errors
from opentelemetry import trace
from opentelemetry.trace import Tracer

from services.balancer.generation import GenerationError, GenerationRequest, TokenEvent, Usage
from services.balancer.policies import choose_decode, choose_prefill
from services.balancer.registry import Registry
from shared.kv.block_hash import hash_block_chain
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import Bus, StreamReader, StreamTimeout
from shared.runtime.convert import logprobs_from_proto, params_to_proto
from shared.runtime.settings import BalancerSettings

log = logging.getLogger(__name__)

_RETRYABLE = (mesh_pb2.ERROR_CODE_OVERLOADED, mesh_pb2.ERROR_CODE_SHUTTING_DOWN)


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
        rid = req.request_id
        finished = False
        # The HTTP layer's request span: TTFT and cache figures belong on the trace's root.
        root = trace.get_current_span()
        started = time.perf_counter()
        async with StreamReader(self.bus, rid) as reader:
            decode_id = await self._dispatch(req)
            # Not the current span: this generator yields, and a span made current
            # across a yield would be detached in another context when closed.
            span = self.tracer.start_span("stream", attributes={"decode.instance": decode_id})
            num_tokens = 0
            try:
                async for chunk in reader.chunks(self.settings.first_token_timeout_s, self.settings.token_timeout_s):
                    if chunk.error:
                        status = 400 if chunk.error_code == mesh_pb2.ERROR_CODE_INVALID_REQUEST else 503
                        raise GenerationError(chunk.error, status=status)
                    if num_tokens == 0:
                        ttft_ms = (time.perf_counter() - started) * 1e3
                        root.set_attribute("ttft_ms", round(ttft_ms, 2))
                        span.set_attribute("ttft_ms", round(ttft_ms, 2))
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
                raise GenerationError(f"the mesh did not answer in time: {exc}", status=503) from None
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

    async def _dispatch(self, req: GenerationRequest) -> str:
        """Choose the instances and hand the request to prefill; returns the
        decode instance's id. Retries other prefill instances that refuse
        because they are busy or draining."""
        hashes = hash_block_chain(req.prompt_token_ids, self.block_size, self.kv_fingerprint, req.cache_salt)
        with self.tracer.start_as_current_span("route") as span:
            span.set_attribute("request.id", req.request_id)
            span.set_attribute("prompt.tokens", len(req.prompt_token_ids))
            try:
                decode = choose_decode(self.registry.live("decode"), self.rng)
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
