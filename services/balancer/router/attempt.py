"""One attempt: dispatch a request to its instances and turn the decode
instance's token stream into TokenEvents.

The attempt listens only on the stream subjects of the instances it was handed
to (`im.stream.<instance>.<request>`, see bus.StreamReader); a chunk from anyone
else is dropped and counted (`stream_chunks_rejected_total`, and a
`stream.chunk_rejected` event on the request's span). A failure is charged to
the instance at fault (InstanceFailed, which the migration loop moves): a
prefill error to prefill; a handoff that decode refused or did not answer
(prefill reports it with a retryable code, OVERLOADED or SHUTTING_DOWN) to
decode; decode's errors, and silence, to decode; the instance leaving the
registry to itself (instance_watch.py); chunks lost in a NATS outage to nobody
(outage.py). An attempt that ends unfinished publishes a cancel.
"""

import logging
import time
from collections.abc import AsyncIterator

from opentelemetry.trace import Span, Tracer

from services.balancer.generation import GenerationError, GenerationRequest, TokenEvent, Usage
from services.balancer.router.cancels import Cancels
from services.balancer.router.dispatch import Dispatcher
from services.balancer.router.failures import RETRYABLE, InstanceFailed
from services.balancer.router.instance_watch import InstanceWatch
from services.balancer.router.outage import OutageRecovery
from services.balancer.router.registry import Registry
from services.balancer.router.wire import WireImages
from shared.proto import mesh_pb2
from shared.runtime.bus import Bus, StreamLost, StreamReader, StreamTimeout
from shared.runtime.metrics import Metrics
from shared.runtime.settings import BalancerSettings
from shared.stage.convert import logprobs_from_proto

log = logging.getLogger(__name__)


class Attempts:
    def __init__(
        self,
        bus: Bus,
        registry: Registry,
        tracer: Tracer,
        settings: BalancerSettings,
        dispatcher: Dispatcher,
        watch: InstanceWatch,
        outage: OutageRecovery,
        cancels: Cancels,
        metrics: Metrics,
    ) -> None:
        self.bus = bus
        self.registry = registry
        self.tracer = tracer
        self.settings = settings
        self.dispatcher = dispatcher
        self.watch = watch
        self.outage = outage
        self.cancels = cancels
        self.m_rejected = metrics.counter(
            "stream_chunks_rejected_total", "Stream chunks dropped: from an instance the request was not handed to, "
            "naming another instance or request, a repeated seq, or on the old subject form", ("reason",)
        )

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

    async def run(
        self, req: GenerationRequest, images: WireImages, excluded: set[str], root: Span, started: float,
        rejected: list[int], migration: int = 0,
    ) -> AsyncIterator[TokenEvent]:
        """Dispatch req with its images (avoiding the excluded instances where others are live) and
        stream its events; root is the request's span, rejected its running count of
        dropped chunks; migration the moves so far."""
        rid = req.request_id
        finished = False

        def on_rejected(reason: str, chunk: mesh_pb2.TokenChunk) -> None:
            self.reject_chunk(reason, chunk, root, rejected)

        # A chunk that passed the checks is proof of life, as it arrives (its heartbeat may be late).
        async with StreamReader(self.bus, rid, on_rejected, lambda chunk: self.registry.touch(chunk.instance_id)) as reader:
            route = await self.dispatcher.dispatch(req, images, excluded, reader)
            if migration:  # handed to its new instances: when, to line up with a death
                root.set_attribute("migration.dispatched_unix", time.time())
            # Not the current span: this generator yields, and a span made current
            # across a yield would be detached in another context when closed.
            local = route.local
            span = self.tracer.start_span(
                "stream",
                attributes={"decode.instance": route.decode, "prefill.instance": route.prefill, "prefill.local": local},
            )
            self.watch.watch(reader, route.prefill)
            self.watch.watch(reader, route.decode)
            self.outage.track(reader, route)
            num_tokens = 0
            num_chunks = 0
            try:
                async for chunk in reader.chunks(self.settings.first_token_timeout_s, self.settings.token_timeout_s):
                    if chunk.error:
                        span.set_attribute("error", chunk.error)
                        if chunk.error_code == mesh_pb2.ERROR_CODE_INVALID_REQUEST:
                            raise GenerationError(chunk.error, status=400, error_type="invalid_request_error")
                        if chunk.instance_id != route.decode:
                            if chunk.error_code in RETRYABLE:
                                raise InstanceFailed(f"the handoff to decode failed: {chunk.error}", route.decode,
                                                     cause="handoff", started=False)
                            raise InstanceFailed(chunk.error, route.prefill)
                        raise InstanceFailed(chunk.error, route.decode)
                    if num_chunks == 0 and not local:  # decode has the request: prefill's fate no longer matters
                        self.watch.unwatch(reader, route.prefill)
                        route.prefilled()  # nor its load: the prompt is computed
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
                raise InstanceFailed(f"lost in a NATS outage: {exc}", cause="lost") from None
            except StreamTimeout as exc:
                span.set_attribute("error", str(exc))
                # Before decode's first chunk the request may as well be stuck in prefill.
                culprits = (route.decode,) if num_chunks else (route.decode, route.prefill)
                raise InstanceFailed(f"the mesh did not answer in time: {exc}", *culprits, cause="timeout") from None
            except InstanceFailed as exc:
                span.set_attribute("error", str(exc))
                if exc.instance_ids == {route.decode} and not num_chunks and not local:
                    exc.started = False  # decode had streamed nothing of it: prefill held it, or had only just handed it over
                raise
            finally:
                self.outage.untrack(reader)
                self.watch.unwatch(reader, route.prefill)
                self.watch.unwatch(reader, route.decode)
                span.end()
                if not finished:  # an error, a stop string or a client gone: stop the work everywhere
                    self.cancels.soon(rid)
