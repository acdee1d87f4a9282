"""Decode: continue a request handed over by prefill, or run one whole.

The first token (sampled by prefill) goes out at once; the engine's connector
loads the prompt's full blocks into the local paged cache: straight out of
prefill's cache where it can map it (the persistent KV groups and the
sliding-window blocks a query at the handoff sees, so nothing is replayed), else
from kvcache (the persistent groups; sliding-window KV is then replayed). The
engine recomputes only the partial last block and the first token, then generates.
A prompt's images come in the handoff, as the balancer sent them to prefill, and are
made ready here (the processor; or, E/P/D, the vision instance's embeddings from
kvcache): the positions past the prompt follow the images' M-RoPE table, and decode may
have to recompute some of the prompt. The vision tower runs here only for the images
whose rows decode computes (shared/engine/images.py): one that reaches into the partial
last block at admission; one wholly in the blocks prefill handed over only if a step
recomputes it (a failed load, a preemption), never otherwise
(images_encoded_total counts the tower's runs). Every token goes out
on the request's stream subject with a sequence number; the last chunk says
why it ended and carries usage. A cancel message aborts the request, which
frees its blocks.

A whole request (PrefillRequest on decode_run) comes when the balancer prefers
this instance to compute the prompt too (conditional disaggregation: the prompt
is short, or prefill is the bottleneck): the engine loads what kvcache holds of
the prompt, prefills the rest in its own steps beside the requests it decodes,
writes the new full blocks behind to kvcache, and streams every token from the
first, with the prompt's logprobs when asked.
"""

import asyncio
import logging
from contextlib import AsyncExitStack

from opentelemetry.trace import Span

from shared.engine.engine_request import EngineRequest
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.request import Request
from shared.engine.sampling_params import InvalidParam, SamplingParams
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import StreamPublisher
from shared.runtime.service import ServiceContext
from shared.runtime.telemetry import inject_headers
from shared.stage.convert import logprobs_to_proto
from shared.stage.kv_handoff import handoff_transfer, whole_request_transfer
from shared.stage.worker import Dispatch, Worker, serve_engine_stage

log = logging.getLogger(__name__)


class DecodeService:
    def __init__(self, ctx: ServiceContext, worker: Worker) -> None:
        self.ctx = ctx
        self.worker = worker
        self.engine: LLMEngine = worker.llm_engine
        m = ctx.metrics
        self.m_requests = m.counter("requests_total", "Decode requests by outcome", ("outcome",))
        self.m_output_tokens = m.counter("output_tokens_total", "Tokens generated")
        self.m_itl = m.histogram("inter_token_latency_seconds", "Time between two tokens of a request")
        self.m_local = m.counter("local_prefills_total", "Whole requests the balancer sent here, prefilled here too")
        self.m_prompt_tokens = m.counter("local_prompt_tokens_total", "Prompt tokens of those requests, and how many "
                                         "a cache served", ("source",))

    async def on_admit(self, h: mesh_pb2.DecodeHandoff) -> mesh_pb2.Ack:
        def one_token() -> None:
            if len(h.output_token_ids) != 1:
                raise ValueError("a handoff carries exactly the first token")

        # The vocabulary was checked by prefill, which admitted the request first.
        return self.worker.admit(
            h.request_id, h.prompt_token_ids, h.sampling, lambda params: self._decode(h, params),
            lambda: self.m_requests.labels("invalid").inc(), check_vocab=False, check=one_token,
        )  # fmt: skip

    async def on_run(self, req: mesh_pb2.PrefillRequest) -> mesh_pb2.Ack:
        """A whole request: prefill it here too (the balancer chose conditional disaggregation)."""
        return self.worker.admit(
            req.request_id, req.prompt_token_ids, req.sampling, lambda params: self._run(req, params),
            lambda: self.m_requests.labels("invalid").inc(),
        )  # fmt: skip

    @staticmethod
    def _usage(prompt_tokens: int, num_output: int, cached_tokens: int) -> mesh_pb2.Usage:
        return mesh_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=num_output, cached_tokens=cached_tokens)

    async def _decode(self, h: mesh_pb2.DecodeHandoff, params: SamplingParams) -> None:
        rid = h.request_id
        prompt = list(h.prompt_token_ids)
        pub = StreamPublisher(self.ctx.bus, self.ctx.instance_id, rid)
        with self.ctx.tracer.start_as_current_span("decode") as span:
            span.set_attribute("request.id", rid)
            span.set_attribute("prompt.tokens", len(prompt))
            span.set_attribute("images.count", len(h.images))
            try:
                # The first token, at once: the client's time to first token
                # should not wait for the KV transfer.
                first = mesh_pb2.TokenChunk(request_id=rid, token_ids=h.output_token_ids, instance_id=self.ctx.instance_id)
                if params.logprobs is not None and h.HasField("first_logprobs"):
                    first.logprobs.append(h.first_logprobs)
                first.prompt_logprobs.extend(h.prompt_logprobs)  # scored by prefill
                # Usage from the start: a stop string may cut the stream before the last chunk.
                first.usage.CopyFrom(self._usage(len(prompt), 1, h.num_cached_tokens))
                status = self._stops_at_first_token(h, params)
                if status is not None:
                    first.final = True
                    first.finish_reason = status
                await pub.send(first)
                self.m_output_tokens.inc()
                if status is not None:
                    span.set_attribute("output.tokens", 1)
                    self.m_requests.labels("ok").inc()
                    return
                request = EngineRequest(
                    rid,
                    prompt,
                    params,
                    cache_salt=h.cache_salt or None,
                    resume_token_ids=list(h.output_token_ids),
                    kv_transfer=handoff_transfer(self.engine, h),
                    trace_carrier=inject_headers(),
                    images=await self.worker.images.request_images(h.images, self.ctx.tracer),
                )
                await self._stream(request, pub, span, h.num_cached_tokens)
                self.m_requests.labels("ok").inc()
            except asyncio.CancelledError:
                self.m_requests.labels("cancelled").inc()
                span.set_attribute("cancelled", True)
                raise
            except Exception as exc:
                await self._fail(rid, pub, span, exc)

    async def _run(self, req: mesh_pb2.PrefillRequest, params: SamplingParams) -> None:
        rid = req.request_id
        prompt = list(req.prompt_token_ids)
        pub = StreamPublisher(self.ctx.bus, self.ctx.instance_id, rid)
        with self.ctx.tracer.start_as_current_span("decode") as span:
            span.set_attribute("request.id", rid)
            span.set_attribute("prompt.tokens", len(prompt))
            span.set_attribute("prefill.local", True)
            span.set_attribute("images.count", len(req.images))
            self.m_local.inc()
            try:
                # What prefill does, kvcache read and written behind, then decoding in the same engine.
                transfer = whole_request_transfer()
                images = await self.worker.images.request_images(req.images, self.ctx.tracer)
                request = EngineRequest(rid, prompt, params, req.cache_salt or None, kv_transfer=transfer,
                                        trace_carrier=inject_headers(), images=images)  # fmt: skip
                final = await self._stream(request, pub, span, None)
                if final.queued_seconds is not None:
                    self.worker.vllm.queue_time.observe(final.queued_seconds)
                span.set_attribute("prompt.cached_tokens", final.num_cached_tokens)
                self.m_prompt_tokens.labels("computed").inc(len(prompt) - final.num_cached_tokens)
                self.m_prompt_tokens.labels("cached").inc(final.num_cached_tokens)
                self.m_requests.labels("ok").inc()
            except asyncio.CancelledError:
                self.m_requests.labels("cancelled").inc()
                span.set_attribute("cancelled", True)
                raise
            except Exception as exc:
                await self._fail(rid, pub, span, exc)

    async def _stream(
        self, request: EngineRequest, pub: StreamPublisher, span: Span, cached_tokens: int | None
    ) -> RequestOutput:
        """Run the request in the engine and send its tokens as they come. cached_tokens:
        the prompt's, counted by prefill; None when this engine computed the prompt
        (the first chunk then has usage, and the prompt's logprobs when asked)."""
        rid = request.request_id
        prompt_tokens = len(request.prompt)
        loop = asyncio.get_running_loop()
        last = loop.time()
        out: RequestOutput | None = None
        first = cached_tokens is None
        async for out in self.worker.engine.generate(request):
            chunk = mesh_pb2.TokenChunk(request_id=rid, token_ids=out.new_token_ids, instance_id=self.ctx.instance_id)
            chunk.logprobs.extend(logprobs_to_proto(lp) for lp in out.new_logprobs)
            cached = out.num_cached_tokens if cached_tokens is None else cached_tokens
            if first:  # usage from the start: a stop string may cut the stream before the last chunk
                first = False
                chunk.usage.CopyFrom(self._usage(prompt_tokens, len(out.token_ids), cached))
                if out.prompt_logprobs is not None:  # positions 1..: the first token has none
                    chunk.prompt_logprobs.extend(logprobs_to_proto(lp) for lp in out.prompt_logprobs[1:] if lp)
            if out.finished:
                if out.kv is not None:
                    self.worker.record_kv_transfer(out.kv, span, rid)
                chunk.final = True
                chunk.finish_reason = out.finish_reason or "stop"
                chunk.usage.CopyFrom(self._usage(prompt_tokens, len(out.token_ids), cached))
                # What speculation did for this request here (after a migration,
                # on this instance only: the drafts before it are not carried).
                chunk.usage.spec_drafted_tokens = out.num_spec_drafted_tokens
                chunk.usage.spec_accepted_tokens = out.num_spec_accepted_tokens
                span.set_attribute("output.tokens", len(out.token_ids))
                span.set_attribute("finish_reason", chunk.finish_reason)
                if out.num_spec_drafted_tokens:
                    span.set_attribute("spec.drafted_tokens", out.num_spec_drafted_tokens)
                    span.set_attribute("spec.accepted_tokens", out.num_spec_accepted_tokens)
            await pub.send(chunk)
            now = loop.time()
            if cached_tokens is not None or len(out.token_ids) > len(out.new_token_ids):  # not the first token
                self.m_itl.observe(now - last)
            last = now
            self.m_output_tokens.inc(len(out.new_token_ids))
        assert out is not None and out.finished
        return out

    async def _fail(self, rid: str, pub: StreamPublisher, span: Span, exc: Exception) -> None:
        """End the request's stream with the error: the balancer moves it, or answers (a
        400 where the request itself was refused: its images, InvalidParam)."""
        log.exception("decode of %s failed", rid)
        self.m_requests.labels("error").inc()
        span.record_exception(exc)
        invalid = isinstance(exc, InvalidParam)
        error = mesh_pb2.TokenChunk(
            request_id=rid, final=True,
            error_code=mesh_pb2.ERROR_CODE_INVALID_REQUEST if invalid else mesh_pb2.ERROR_CODE_INTERNAL,
            error=exc.message if invalid else f"decode failed: {exc}", instance_id=self.ctx.instance_id,
        )  # fmt: skip
        await pub.send(error)

    def _stops_at_first_token(self, h: mesh_pb2.DecodeHandoff, params: SamplingParams) -> str | None:
        """The engine's own stop rules, applied to the token prefill sampled."""
        request = Request(h.request_id, list(h.prompt_token_ids), params, eos_token_ids=self.engine.eos_token_ids)
        request.append_output_token(h.output_token_ids[0])
        status = request.check_stop(self.engine.max_model_len)
        return status.finish_reason if status is not None else None


async def setup(ctx: ServiceContext, stack: AsyncExitStack) -> None:
    def dispatch(worker: Worker) -> list[Dispatch]:
        service = DecodeService(ctx, worker)
        return [
            Dispatch(subjects.decode_admit(ctx.instance_id), mesh_pb2.DecodeHandoff, service.on_admit),
            Dispatch(subjects.decode_run(ctx.instance_id), mesh_pb2.PrefillRequest, service.on_run),
        ]

    await serve_engine_stage(ctx, stack, dispatch)
