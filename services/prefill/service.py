"""Prefill: one request at a time per task, the engine batches them.

For a request: find how many leading blocks of the prompt are cached here and
in the kvcache service, load the missing cached ones, compute the rest in
chunks (the engine's chunked prefill), write the new full blocks back to
kvcache, and hand the request with its first token to decode. A failure at any
point ends the request's stream with an error: never lost silently.
"""

import asyncio
import dataclasses
import logging
from contextlib import AsyncExitStack

import nats.errors

from shared.engine.engine_request import EngineRequest, KVTransferParams
from shared.engine.llm_engine import LLMEngine, RequestOutput
from shared.engine.sampling_params import SamplingParams
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.kvcache_client import KVCacheClient
from shared.runtime.service import ServiceContext
from shared.stage.convert import logprobs_to_proto, params_from_proto
from shared.stage.worker import Worker, fail_stream, load_cached_blocks, serve_engine_stage, validate_prompt


log = logging.getLogger(__name__)


class PrefillService:
    def __init__(self, ctx: ServiceContext, worker: Worker, kv: KVCacheClient) -> None:
        self.ctx = ctx
        self.worker = worker
        self.kv = kv
        self.engine: LLMEngine = worker.engine.engine
        m = ctx.metrics
        self.m_requests = m.counter("requests_total", "Prefill requests by outcome", ("outcome",))
        self.m_prompt_tokens = m.counter("prompt_tokens_total", "Prompt tokens received")
        self.m_cached_tokens = m.counter("cached_tokens_total", "Prompt tokens served from a cache", ("source",))
        self.m_stored_bytes = m.counter("kv_stored_bytes_total", "KV bytes written to kvcache")
        self.m_latency = m.histogram("latency_seconds", "From dispatch to handoff")

    async def on_run(self, req: mesh_pb2.PrefillRequest) -> mesh_pb2.Ack:
        if self.worker.draining:
            return mesh_pb2.Ack(accepted=False, code=mesh_pb2.ERROR_CODE_SHUTTING_DOWN, message="draining")
        try:
            params = params_from_proto(req.sampling)
            validate_prompt(self.engine, list(req.prompt_token_ids), params)
            subjects.check_token(req.request_id)
            subjects.check_token(req.decode_instance)
        except ValueError as exc:
            self.m_requests.labels("invalid").inc()
            return mesh_pb2.Ack(accepted=False, code=mesh_pb2.ERROR_CODE_INVALID_REQUEST, message=str(exc))
        self.worker.spawn(req.request_id, self._prefill(req, params))
        return mesh_pb2.Ack(accepted=True, instance_id=self.ctx.instance_id)

    async def _prefill(self, req: mesh_pb2.PrefillRequest, params: SamplingParams) -> None:
        rid = req.request_id
        prompt = list(req.prompt_token_ids)
        salt = req.cache_salt or None
        loop = asyncio.get_running_loop()
        started = loop.time()
        with self.ctx.tracer.start_as_current_span("prefill") as span:
            span.set_attribute("request.id", rid)
            span.set_attribute("prompt.tokens", len(prompt))
            try:
                hashes = self.engine.kv.hash_chain(prompt, salt)
                # Block-aligned hits only, and never the prompt's last token.
                max_hit = (len(prompt) - 1) // self.engine.kv.block_size
                remote = await self.kv.lookup(hashes[:max_hit])
                loaded = await load_cached_blocks(self.worker, self.kv, prompt, hashes[:remote], salt, span)
                span.set_attribute("kvcache.leading_blocks", remote)
                # The first token only: decode generates the rest.
                first = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
                final: RequestOutput | None = None
                request = EngineRequest(rid, prompt, first, salt, kv_transfer=KVTransferParams(export_from_block=remote))
                async for out in self.worker.engine.generate(request):
                    final = out
                assert final is not None and final.finished
                stored = await self._store_blocks(final, span)
                span.set_attribute("prompt.cached_tokens", final.num_cached_tokens)
                self.m_prompt_tokens.inc(len(prompt))
                self.m_cached_tokens.labels("local" if loaded == 0 else "kvcache").inc(final.num_cached_tokens)
                handoff = mesh_pb2.DecodeHandoff(
                    request_id=rid,
                    prompt_token_ids=prompt,
                    output_token_ids=final.token_ids,
                    sampling=req.sampling,
                    cache_salt=req.cache_salt,
                    block_hashes=hashes[: remote + stored],
                    num_cached_tokens=final.num_cached_tokens,
                    generator_state=final.generator_state or b"",
                    prefill_instance=self.ctx.instance_id,
                )
                if final.new_logprobs:
                    handoff.first_logprobs.CopyFrom(logprobs_to_proto(final.new_logprobs[0]))
                await self._hand_over(req.decode_instance, handoff)
                self.m_requests.labels("ok").inc()
                self.m_latency.observe(loop.time() - started)
            except asyncio.CancelledError:
                self.m_requests.labels("cancelled").inc()
                raise
            except Exception as exc:
                log.exception("prefill of %s failed", rid)
                self.m_requests.labels("error").inc()
                span.record_exception(exc)
                await fail_stream(self.ctx.bus, rid, self.ctx.instance_id, f"prefill failed: {exc}")

    async def _store_blocks(self, final: RequestOutput, span) -> int:  # noqa: ANN001
        blocks = final.exported_kv or []
        if blocks:
            layout = self.engine.block_layout
            await self.kv.put_blocks([(h, layout, data) for h, data in blocks])
            num_bytes = sum(len(d) for _, d in blocks)
            self.m_stored_bytes.inc(num_bytes)
            span.set_attribute("kv.stored_blocks", len(blocks))
            span.set_attribute("kv.stored_bytes", num_bytes)
        return len(blocks)

    async def _hand_over(self, decode_instance: str, handoff: mesh_pb2.DecodeHandoff) -> None:
        try:
            ack = await self.ctx.bus.request(subjects.decode_admit(decode_instance), handoff, mesh_pb2.Ack)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            raise RuntimeError(f"decode instance {decode_instance} did not answer ({type(exc).__name__})") from None
        if not ack.accepted:
            raise RuntimeError(f"decode instance {decode_instance} refused: {ack.message}")


async def setup(ctx: ServiceContext, stack: AsyncExitStack) -> None:
    await serve_engine_stage(
        ctx,
        stack,
        lambda worker, kv: PrefillService(ctx, worker, kv).on_run,
        subjects.prefill_run(ctx.instance_id),
        mesh_pb2.PrefillRequest,
    )
