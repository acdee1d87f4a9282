"""Prefill: one request at a time per task, the engine batches them.

For a request: run it for its first token with KV transfer on both ways (the
engine's connector loads the prompt's blocks kvcache holds and this worker
lacks, and stores the new full blocks), then hand it with its first token to
decode. With direct transfer (kv_direct_transfer, the default) the prompt's
blocks stay held in this engine's cache under a lease and the handoff says
where, so decode copies them straight across; kvcache is written behind, off
the time to first token. Without it, the last output waits for the store and
decode reads kvcache. The service moves no KV itself. A request's images (PNG on
the wire) are decoded and run through the model's image processor off the event loop
(shared/stage/images.py), the engine encodes them off its step loop, and they go on
to decode in the handoff as they came. A failure at any point
ends the request's stream with an error: never lost silently. A handoff that
decode refuses or does not answer ends it with a retryable code (OVERLOADED), so
the balancer charges decode, not this instance, and moves the request.
"""

import asyncio
import dataclasses
import logging
from contextlib import AsyncExitStack

import nats.errors

from shared.engine.engine_request import EngineRequest
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.sampling_params import InvalidParam, SamplingParams
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.service import ServiceContext
from shared.runtime.telemetry import inject_headers
from shared.stage.convert import logprobs_to_proto
from shared.stage.kv_handoff import held_kv_source, prefill_transfer
from shared.stage.worker import Dispatch, Worker, fail_stream, serve_engine_stage


log = logging.getLogger(__name__)


class _HandoffFailed(RuntimeError):
    """The decode instance the balancer named did not take the request."""


class PrefillService:
    def __init__(self, ctx: ServiceContext, worker: Worker) -> None:
        self.ctx = ctx
        self.worker = worker
        self.engine: LLMEngine = worker.llm_engine
        m = ctx.metrics
        self.m_requests = m.counter("requests_total", "Prefill requests by outcome", ("outcome",))
        self.m_prompt_tokens = m.counter("prompt_tokens_total", "Prompt tokens received")
        self.m_dispatched_tokens = m.counter(
            "dispatched_prompt_tokens_total", "Prompt tokens of the dispatches that reached this instance, whole "
            "(long ones come in parts, shared/runtime/bus_parts.py), before admission"
        )
        self.m_cached_tokens = m.counter("cached_tokens_total", "Prompt tokens served from a cache", ("source",))
        self.m_latency = m.histogram("latency_seconds", "From dispatch to handoff")

    async def on_run(self, req: mesh_pb2.PrefillRequest) -> mesh_pb2.Ack:
        self.m_dispatched_tokens.inc(len(req.prompt_token_ids))
        return self.worker.admit(
            req.request_id, req.prompt_token_ids, req.sampling, lambda params: self._prefill(req, params),
            lambda: self.m_requests.labels("invalid").inc(), check=lambda: subjects.check_token(req.decode_instance),
        )  # fmt: skip

    async def _prefill(self, req: mesh_pb2.PrefillRequest, params: SamplingParams) -> None:
        rid = req.request_id
        prompt = list(req.prompt_token_ids)
        salt = req.cache_salt or None
        loop = asyncio.get_running_loop()
        started = loop.time()
        with self.ctx.tracer.start_as_current_span("prefill") as span:
            span.set_attribute("request.id", rid)
            span.set_attribute("prompt.tokens", len(prompt))
            span.set_attribute("images.count", len(req.images))
            try:
                # The first token only: decode generates the rest.
                first = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
                transfer = prefill_transfer(self.engine, nixl=self.worker.nixl is not None)
                images = await self.worker.images.request_images(req.images, self.ctx.tracer)
                request = EngineRequest(rid, prompt, first, salt, kv_transfer=transfer, trace_carrier=inject_headers(),
                                        images=images)  # fmt: skip
                final: RequestOutput | None = None
                async for out in self.worker.engine.generate(request):
                    final = out
                assert final is not None and final.finished and final.kv is not None
                self.worker.record_kv_transfer(final.kv, span, rid)
                if final.queued_seconds is not None:  # a request waits in prefill's engine, nowhere else
                    self.worker.vllm.queue_time.observe(final.queued_seconds)
                span.set_attribute("prompt.cached_tokens", final.num_cached_tokens)
                self.m_prompt_tokens.inc(len(prompt))
                from_kvcache = min(final.kv.num_loaded_blocks * self.engine.kv.block_size, final.num_cached_tokens)
                self.m_cached_tokens.labels("kvcache").inc(from_kvcache)
                self.m_cached_tokens.labels("local").inc(final.num_cached_tokens - from_kvcache)
                # Decode continues without scoring the prompt again: its logprobs travel in the handoff.
                sampling = mesh_pb2.SamplingParams()
                sampling.CopyFrom(req.sampling)
                sampling.ClearField("prompt_logprobs")
                handoff = mesh_pb2.DecodeHandoff(
                    request_id=rid,
                    prompt_token_ids=prompt,
                    output_token_ids=final.token_ids,
                    sampling=sampling,
                    cache_salt=req.cache_salt,
                    # The prompt's chain, which kvcache holds unless the store failed (decode then recomputes).
                    block_hashes=final.kv.block_hashes if final.kv.save_error is None else [],
                    num_cached_tokens=final.num_cached_tokens,
                    prefill_instance=self.ctx.instance_id,
                    images=req.images,  # decode recomputes what it must (its docstring says what): as they came
                )
                if final.new_logprobs:
                    handoff.first_logprobs.CopyFrom(logprobs_to_proto(final.new_logprobs[0]))
                if final.prompt_logprobs is not None:  # positions 1..: the first token has none
                    handoff.prompt_logprobs.extend(logprobs_to_proto(lp) for lp in final.prompt_logprobs[1:] if lp)
                nixl = self.worker.nixl.describe() if self.worker.nixl is not None else b""
                kv_source = held_kv_source(self.engine, self.ctx.instance_id, final.kv.held, nixl)
                if kv_source is not None:
                    handoff.kv_source.CopyFrom(kv_source)
                    span.set_attribute("kv.held_blocks", kv_source.num_blocks)
                await self._hand_over(req.decode_instance, handoff)
                self.m_requests.labels("ok").inc()
                self.m_latency.observe(loop.time() - started)
            except asyncio.CancelledError:
                self.m_requests.labels("cancelled").inc()
                raise
            except InvalidParam as exc:  # the request's images, refused here or by the engine: not retried elsewhere
                self.m_requests.labels("invalid").inc()
                span.record_exception(exc)
                invalid = mesh_pb2.ERROR_CODE_INVALID_REQUEST
                await fail_stream(self.ctx.bus, rid, self.ctx.instance_id, exc.message, invalid)
            except _HandoffFailed as exc:
                log.warning("handoff of %s failed: %s", rid, exc)
                self.m_requests.labels("handoff_failed").inc()
                span.record_exception(exc)
                # A retryable code: the decode instance is at fault, not this one.
                await fail_stream(self.ctx.bus, rid, self.ctx.instance_id, str(exc), mesh_pb2.ERROR_CODE_OVERLOADED)
            except Exception as exc:
                log.exception("prefill of %s failed", rid)
                self.m_requests.labels("error").inc()
                span.record_exception(exc)
                await fail_stream(self.ctx.bus, rid, self.ctx.instance_id, f"prefill failed: {exc}")

    async def _hand_over(self, decode_instance: str, handoff: mesh_pb2.DecodeHandoff) -> None:
        try:
            ack = await self.ctx.bus.request(subjects.decode_admit(decode_instance), handoff, mesh_pb2.Ack)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            raise _HandoffFailed(f"decode instance {decode_instance} did not answer ({type(exc).__name__})") from None
        if not ack.accepted:
            raise _HandoffFailed(f"decode instance {decode_instance} refused: {ack.message}")


async def setup(ctx: ServiceContext, stack: AsyncExitStack) -> None:
    def dispatch(worker: Worker) -> list[Dispatch]:
        return [Dispatch(subjects.prefill_run(ctx.instance_id), mesh_pb2.PrefillRequest, PrefillService(ctx, worker).on_run)]

    await serve_engine_stage(ctx, stack, dispatch, share_kv=ctx.settings.engine.kv_direct_transfer)
