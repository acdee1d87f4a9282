"""Dispatch: choose a request's instances and hand it over.

The decode instance first (by load, by its load and expert balance for MoE
instances, or by its cache where conditional disaggregation may compute the
prompt there), then where the prompt is
computed: on that decode instance, or on a prefill instance that takes it. A
refusal from an overloaded or draining prefill instance, or one that does not
answer, is retried on the next candidate; instances that failed this request
before are chosen again only when no other is live. When every prefill instance
has refused or not answered (a mesh scaling, an instance draining while another
starts, late heartbeats on a busy host), all are asked again every
PREFILL_RETRY_INTERVAL_S for PREFILL_RETRY_S from then before the client gets a 503. The load each choice adds
is reserved at once (reservations.py) and given back if the handover fails.
"""

import asyncio
import logging
import random
import time

import nats.errors
from opentelemetry.trace import Span, Tracer

from services.balancer.generation import GenerationError, GenerationRequest
from services.balancer.router.cancels import Cancels
from services.balancer.router.failures import RETRYABLE, InstanceFailed
from services.balancer.router.instance_watch import InstanceWatch
from services.balancer.router.outage import OUTAGE_WAIT_S, OutageRecovery
from services.balancer.router.policies import (
    Choice,
    choose_decode,
    choose_decode_by_cache,
    choose_expert_parallel,
    choose_prefill,
    choose_prefill_site,
    conditional_disaggregation,
    serves_expert_parallel,
)
from services.balancer.router.registry import Instance, Registry
from services.balancer.router.reservations import Reservation
from services.balancer.router.route import Route
from services.balancer.router.wire import WireImages, prefill_request
from shared.engine.outputs import queued_prompt_tokens
from shared.kv.block_hash import BlockHash, hash_block_chain
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import Bus, StreamReader
from shared.runtime.metrics import Metrics
from shared.runtime.settings import BalancerSettings

log = logging.getLogger(__name__)

PREFILL_RETRY_S = 5.0
"""How long a request no prefill instance took is offered to them again before a 503."""
PREFILL_RETRY_INTERVAL_S = 0.25


class Dispatcher:
    def __init__(
        self,
        bus: Bus,
        registry: Registry,
        tracer: Tracer,
        settings: BalancerSettings,
        block_size: int,
        kv_fingerprint: str,
        rng: random.Random,
        watch: InstanceWatch,
        outage: OutageRecovery,
        cancels: Cancels,
        metrics: Metrics,
    ) -> None:
        self.bus = bus
        self.registry = registry
        self.tracer = tracer
        self.settings = settings
        self.block_size = block_size
        self.kv_fingerprint = kv_fingerprint
        self.rng = rng
        self.watch = watch
        self.outage = outage
        self.cancels = cancels
        self.m_prefill_site = metrics.counter(
            "prefill_site_total", "Requests by where their prompt was computed (remote: on a prefill instance; local: "
            "on their decode instance, conditional disaggregation) and why", ("site", "reason")
        )

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

    async def dispatch(
        self, req: GenerationRequest, images: WireImages, excluded: set[str], reader: StreamReader
    ) -> Route:
        """Choose the instances, listen to their streams and hand the request, with its
        images, to prefill. Retries other prefill instances that refuse because they are
        busy or draining, or do not answer. Instances that failed this request before
        are chosen again only when no other is live."""
        # The workers' block hashes carry each image's identity: so do the routing keys.
        hashes = hash_block_chain(req.prompt_token_ids, self.block_size, self.kv_fingerprint, req.cache_salt,
                                  images=images.spans)  # fmt: skip
        deadline = time.monotonic() + OUTAGE_WAIT_S
        with self.tracer.start_as_current_span("route") as span:
            span.set_attribute("request.id", req.request_id)
            span.set_attribute("prompt.tokens", len(req.prompt_token_ids))
            await self.outage.wait_for_bus(span)
            s = self.settings
            by_cache = conditional_disaggregation(s.local_prefill_max_tokens, s.local_prefill_queue_tokens)
            while True:
                try:
                    candidates = self._prefer(self._candidates("decode"), excluded)
                    if by_cache:  # the prompt may be computed there: its own cache counts
                        decode = choose_decode_by_cache(
                            candidates, hashes, len(req.prompt_token_ids), self.block_size, self.rng,
                            s.kv_overlap_weight,
                        )
                    elif serves_expert_parallel(candidates):  # MoE instances: the EP load balancer
                        decode = choose_expert_parallel(candidates, self.rng)
                    else:
                        decode = choose_decode(candidates, self.rng)
                    break
                except LookupError as exc:
                    if not await self.outage.retry(deadline, span):
                        raise GenerationError(str(exc), status=503) from None
            # Reserved now, before the first await, as prefill's tokens are below: a burst
            # routed meanwhile must see it (choose_decode_by_cache would send a whole burst
            # sharing a prefix to the one instance holding it); given back if this fails.
            with Reservation(decode.instance, requests=1) as reservation:
                route = await self._dispatch_to(req, images, hashes, decode, excluded, reader, span, deadline)
                reservation.keep()
                return route

    async def _dispatch_to(
        self, req: GenerationRequest, images: WireImages, hashes: list[BlockHash], decode: Choice,
        excluded: set[str], reader: StreamReader, span: Span, deadline: float,
    ) -> Route:
        """dispatch once its decode instance is chosen: where the prompt is computed, then
        to that decode instance or to a prefill instance that takes it."""
        s = self.settings
        did = decode.instance.instance_id
        span.set_attribute("decode.candidates", list(decode.scores))
        span.set_attribute("decode.scores", list(decode.scores.values()))
        if decode.held:
            span.set_attribute("decode.held", list(decode.held.values()))
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
            return await self._dispatch_local(req, images, decode.instance, span)
        tried: set[str] = set()
        last_error = "no live prefill instance"
        retry_until: float | None = None  # set when every instance has failed it once
        while True:
            live = [i for i in self._candidates("prefill") if i.instance_id not in tried]
            if not live and await self.outage.retry(deadline, span):
                tried.clear()  # while the bus recovers, one that did not answer may now
                continue
            try:
                prefill = choose_prefill(self._prefer(live, excluded), hashes, len(req.prompt_token_ids),
                                         self.block_size, self.rng, s.kv_overlap_weight)
            except LookupError:
                # Every one refused or was silent: ask them all again shortly, for PREFILL_RETRY_S
                # from now (not from the dispatch: one ack timeout may already have used that up).
                retry_until = time.monotonic() + PREFILL_RETRY_S if retry_until is None else retry_until
                if time.monotonic() < retry_until:
                    await asyncio.sleep(PREFILL_RETRY_INTERVAL_S)
                    tried.clear()
                    continue
                log.warning("request %s: no prefill instance took it: %s", req.request_id, last_error)
                span.set_attribute("error", last_error)
                raise GenerationError("No prefill instance could take the request; retry later.",
                                      status=503) from None
            pid = prefill.instance.instance_id
            tried.add(pid)
            # Reserved now, before the first await: the requests routed while this one
            # waits for its ack must see these tokens queued (a burst of 16 otherwise all
            # saw an idle prefill instance, and conditional disaggregation never triggered).
            # The whole prompt, as the instance's heartbeat will count it (queued_prompt_tokens).
            queued = queued_prompt_tokens(len(req.prompt_token_ids), 0)
            with Reservation(prefill.instance, tokens=queued) as reservation:
                span.set_attribute("prefill.candidates", list(prefill.scores))
                span.set_attribute("prefill.scores", list(prefill.scores.values()))
                span.set_attribute("prefill.held", list(prefill.held.values()))
                span.set_attribute("prefill.choice", pid)
                span.set_attribute("prefill.reason", prefill.reason)
                msg = prefill_request(req, images.messages, did)
                await reader.listen(pid, source=False)  # prefill may only end the stream with an error
                await self.outage.wait_for_bus(span)
                try:
                    ack = await self._request_unless_gone(pid, subjects.prefill_run(pid), msg)
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
                    last_error = f"prefill instance {pid} did not answer ({type(exc).__name__})"
                    continue  # given back on leaving the block
                if ack.accepted:
                    self.m_prefill_site.labels("remote", site.reason).inc()
                    reservation.keep(requests=1)
                    return Route(pid, did, reservation.done)
            # Refused: given back above.
            if ack.code not in RETRYABLE:
                raise _refused(ack)
            last_error = f"prefill instance {pid} refused: {ack.message}"

    async def _dispatch_local(self, req: GenerationRequest, images: WireImages, decode: Instance, span: Span) -> Route:
        """Hand the whole request to its decode instance, which prefills it too (the
        route's two stages are then one instance). A decode instance that refuses or does
        not answer fails this attempt, charged to it: the request moves."""
        did = decode.instance_id
        msg = prefill_request(req, images.messages, did)
        await self.outage.wait_for_bus(span)
        try:
            ack = await self._request_unless_gone(did, subjects.decode_run(did), msg)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            raise InstanceFailed(f"decode instance {did} did not answer ({type(exc).__name__})", did,
                                 cause="handoff", started=False) from None
        if not ack.accepted:
            if ack.code not in RETRYABLE:
                raise _refused(ack)
            raise InstanceFailed(f"decode instance {did} refused: {ack.message}", did, cause="handoff", started=False)
        return Route(did, did)

    async def _request_unless_gone(self, instance_id: str, subject: str, msg: mesh_pb2.PrefillRequest) -> mesh_pb2.Ack:
        """The instance's Ack; InstanceFailed as soon as it leaves the registry (a
        dispatch that reached a dying instance is not waited on for the whole timeout).
        The request then moves under a new id and its old id is cancelled: should the
        instance only have been frozen, its late work on the old id is dropped."""
        gone_error = InstanceFailed(f"instance {instance_id} left the mesh during dispatch", instance_id,
                                    cause="left_mesh", started=False)
        if self.registry.get(instance_id) is None:
            raise gone_error
        gone = self.watch.leaving(instance_id)
        ack = asyncio.ensure_future(self.bus.request(subject, msg, mesh_pb2.Ack))
        try:
            await asyncio.wait((ack, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.watch.forget(instance_id, gone)
            if not ack.done():
                ack.cancel()
        if not ack.done() or ack.cancelled():
            self.cancels.soon(msg.request_id)
            raise gone_error
        reply = ack.result()
        self.registry.touch(instance_id)  # it answered: alive
        return reply


def _refused(ack: mesh_pb2.Ack) -> GenerationError:
    """An instance's refusal of the request itself (not retried elsewhere): a 400 naming
    the parameter at fault where the engine named one."""
    return GenerationError(ack.message, status=400, error_type="invalid_request_error", param=ack.param or None)
