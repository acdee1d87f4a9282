"""One request through the HTTP API: check, admit, tokenize, generate, answer.

OpenAIServer serves /v1/completions and /v1/chat/completions; a request fans out
to jobs (jobs.py: prompts × samples), each job's generation runs under the
balancer's queue (admission.py), and the request's deltas run in a Pump
(pump.py), read as one JSON body or as an EventStream of SSE events
(event_stream.py; see api.py's docstring for why)."""

import asyncio
import contextvars
import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import AsyncExitStack, aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Tracer
from pydantic import BaseModel

from services.balancer.frontend import protocol as p
from services.balancer.frontend.admission import PriorityGate
from services.balancer.frontend.chat_template import encode_chat
from services.balancer.frontend.choices import Call, Delta, Finished, Job, Shaper, attach_tools, usage_of
from services.balancer.frontend.errors import APIError, check_model
from services.balancer.frontend.event_stream import DONE, EventStream, json_response, sse, sse_error, unless_disconnected
from services.balancer.generation import GenerationError, Generator, Usage
from services.balancer.frontend.http_metrics import HttpMetrics
from services.balancer.frontend.images import ImageIntake, ModelImages
from services.balancer.frontend.jobs import JobPlanner
from services.balancer.frontend.pump import Pump, merge_deltas
from services.balancer.frontend.reasoning_output import ReasoningSupport
from services.balancer.frontend.seeds import SEED_HEADER
from services.balancer.frontend.structured_outputs import check_structured
from services.balancer.frontend.tool_output import ToolSupport
from shared.recipe import Recipe
from shared.runtime.settings import BalancerSettings, ImageSettings
from shared.runtime.telemetry import extract_context

log = logging.getLogger(__name__)

Produce = Callable[[Call], AsyncGenerator[Any, None]]
"""A call's answer: the one body (a pydantic model) or SSE events (strings)."""

__all__ = ["OpenAIServer", "json_response"]


class OpenAIServer:
    def __init__(
        self,
        generator: Generator,
        recipe: Recipe,
        model_names: tuple[str, ...],
        max_model_len: int,
        settings: BalancerSettings,
        stats: HttpMetrics,
        tracer: Tracer,
        images: ImageSettings,
        model_images: ModelImages,
    ) -> None:
        self.generator = generator
        self.recipe = recipe
        model_name = model_names[0]
        self.model_names = model_names
        """The served names (the first is the one responses carry)."""
        self.max_model_len = max_model_len
        self.settings = settings
        self.stats = stats
        self.tracer = tracer
        self.num_in_flight = 0
        """Admitted and not finished, counted here (not asked of the generator) so
        that two requests arriving together cannot both take the last place."""
        self.gate = PriorityGate(settings.max_dispatched_requests)
        self.planner = JobPlanner(recipe, model_name, max_model_len)
        self.tools = ToolSupport(settings.tool_call_parser, recipe)
        self.reasoning = ReasoningSupport(settings.reasoning_parser, recipe)
        self.images = ImageIntake(images, model_name, model_images)

    # -- the two endpoints ---------------------------------------------------------

    async def completions(self, body: p.CompletionRequest, http: Request) -> Response:
        self._check(body)
        await check_structured(body)
        async with AsyncExitStack() as stack:
            self._admit(stack)
            prompts: list[list[int]] = []
            texts: list[str] = []
            for prompt in body.prompts:
                if isinstance(prompt, str):  # off the loop: a long prompt takes a while
                    prompts.append(await asyncio.to_thread(self.recipe.encode, prompt, body.add_special_tokens))
                    texts.append(prompt)
                else:
                    prompts.append(list(prompt))
                    texts.append(self.recipe.decode(prompt, skip_special_tokens=False) if body.echo else "")
            echo_only = body.echo and body.max_tokens == 0
            # vLLM's: echo with logprobs scores the prompt with as many alternatives.
            prompt_k = body.prompt_logprobs
            if prompt_k is None and body.echo and body.logprobs is not None:
                prompt_k = body.logprobs
            call = self.planner.plan(
                body, http, prompts, chat=False, what="prompt", max_tokens=1 if echo_only else body.max_tokens,
                logprobs=body.logprobs, prompt_k=prompt_k,
            )
            call.echo, call.echo_only, call.prompt_texts = body.echo, echo_only, texts
            call.labels = body.span_attributes()
            return await self._respond(call, bool(body.stream), http, stack)

    async def chat(self, body: p.ChatCompletionRequest, http: Request, produce: "Produce | None" = None) -> Response:
        """produce: another shape of answer over the same call (/v1/responses): it gets
        the planned call and yields the body (a model) or SSE events (strings)."""
        self._check(body)
        await check_structured(body)
        tools = await self.tools.plan(body)
        image_refs = self.images.refs(body)  # refused before admission and before any download
        async with AsyncExitStack() as stack:
            self._admit(stack)  # first: loading takes time and memory, so a loading request counts in flight
            images = await self.images.load(image_refs)
            prompt_ids = await asyncio.to_thread(encode_chat, self.recipe, body)
            prompt_ids = self.images.expand(prompt_ids, image_refs, images)
            call = self.planner.plan(
                body, http, [prompt_ids], chat=True, what="messages", max_tokens=body.requested_max_tokens,
                logprobs=body.num_logprobs, prompt_k=body.prompt_logprobs,
                keep_special_tokens=(tools is not None and tools.keeps_special_tokens)
                or self.reasoning.keeps_special_tokens,
                images=images,
            )
            if tools is not None:
                attach_tools(call, tools, bool(body.stream))
            self.reasoning.attach(call, tools, bool(body.stream))
            call.labels = body.span_attributes()
            return await self._respond(call, bool(body.stream), http, stack, produce)

    async def tokenize_chat(self, body: p.TokenizeChatRequest) -> list[int]:
        """/tokenize's tokens of a conversation: the prompt chat would make of it
        (chat_template.py), each image's placeholder repeated once per token the image
        takes (its merged patches, as in the engine's prompt: so the count is the chat's
        usage.prompt_tokens), its images refused as chat refuses them. The images are
        loaded to learn their sizes, in flight as a chat's are (loading takes time and
        memory)."""
        image_refs = self.images.refs(body)
        async with AsyncExitStack() as stack:
            if image_refs:
                self._admit(stack)
            images = await self.images.load(image_refs)
            prompt_ids = await asyncio.to_thread(encode_chat, self.recipe, body)
            return self.images.expand(prompt_ids, image_refs, images)

    # -- checks and preparation ----------------------------------------------------

    def _check(self, body: p.CompletionRequest | p.ChatCompletionRequest) -> None:
        check_model(body.model, self.model_names)
        if body.priority and not self.gate.enabled:
            raise APIError(
                400, "priority: this balancer dispatches at once (no queue to order): set "
                "balancer.max_dispatched_requests to queue requests by priority", param="priority",
            )

    def _admit(self, stack: AsyncExitStack) -> None:
        """Take a place in flight until stack closes; 429 when none is left."""
        if self.num_in_flight >= self.settings.max_queued_requests:
            message = f"Too many requests in flight (at most {self.settings.max_queued_requests}); retry later."
            raise APIError(429, message, type="rate_limit_error", code="rate_limit_exceeded")
        self.num_in_flight += 1
        self.stats.in_flight.inc()
        stack.callback(self._leave)

    def _leave(self) -> None:
        self.num_in_flight -= 1
        self.stats.in_flight.dec()

    # -- generation ------------------------------------------------------------------

    async def _respond(
        self, call: Call, stream: bool, http: Request, stack: AsyncExitStack, produce: "Produce | None" = None
    ) -> Response:
        """Start the request's pump and answer with its first output; what stack
        holds (the place in flight, the span, the pump) lasts as long as the response."""
        span = self.tracer.start_span(
            f"POST {http.url.path}", context=extract_context(http.headers), kind=SpanKind.SERVER
        )
        stack.callback(span.end)
        span.set_attribute("request.id", call.id)
        span.set_attribute("prompt.tokens", sum(len(ids) for ids in call.prompts))
        for name, value in call.labels.items():
            span.set_attribute(name, value)
        if len(call.jobs) > 1:
            span.set_attribute("request.choices", len(call.jobs))
        for job in call.jobs:
            job.span = span
        context = contextvars.copy_context()
        context.run(otel_context.attach, trace.set_span_in_context(span))  # a private copy: never detached
        if produce is not None:
            producer = produce(call)
        else:
            producer = self._stream(call) if stream else self._whole(call)
        pump: Pump[Any] = Pump(producer, context)
        stack.push_async_callback(pump.close)
        first = await unless_disconnected(http, pump.next())
        headers = {"x-request-id": call.id.split("-", 1)[1]}
        if call.seed is not None:
            headers[SEED_HEADER] = str(call.seed)
        if not stream:
            return json_response(first, headers)
        return EventStream(first, pump, stack.pop_all(), headers)

    def chat_deltas(self, call: Call) -> AsyncGenerator[tuple[Job, Delta], None]:
        """Every job's deltas as they come (what a producer other than chat's reads)."""
        return merge_deltas(call.jobs, self._deltas)

    def whole_chat(self, call: Call) -> AsyncGenerator[BaseModel, None]:
        """The call's whole chat completion, as the one item of a producer."""
        return self._whole(call)

    async def _deltas(self, job: Job) -> AsyncGenerator[Delta, None]:
        """Deltas of one job; the last one has finish_reason and usage. Closing this
        closes the generator's iteration, which cancels the request."""
        if job.after is not None:  # share the prompt's KV: wait until the first sample has it cached
            await job.after.first_token.wait()
        try:
            async with self.gate.place(job.request.priority):
                async for delta in self._generate(job):
                    job.first_token.set()
                    yield delta
        finally:
            job.first_token.set()  # a first sample that failed must not hold its siblings forever

    async def _generate(self, job: Job) -> AsyncGenerator[Delta, None]:
        detok, counter = job.detokenizer, job.reasoning_count
        num_tokens, num_cached, drafted, accepted, num_reasoning = 0, 0, 0, 0, 0
        clock = self.stats.clock(job.arrival, len(job.request.prompt_token_ids))
        async with aclosing(self.generator.generate(job.request)) as events, clock:
            async for event in events:
                clock.tokens(len(event.token_ids))
                num_tokens += len(event.token_ids)
                if event.usage is not None:  # on the last event; one cut by a stop string has none
                    num_cached = event.usage.cached_tokens
                    drafted, accepted = event.usage.spec_drafted_tokens, event.usage.spec_accepted_tokens
                # Each token's own text, where usage counts reasoning tokens (count.py).
                token_texts: list[str] = []
                text = detok.add_tokens(event.token_ids, token_texts if counter is not None else None)
                finish = "stop" if detok.stop_reason is not None else event.finish_reason
                num_prompt = len(job.request.prompt_token_ids)
                if finish is None:
                    if counter is not None:
                        num_reasoning = counter.add(token_texts)
                    usage = Usage(num_prompt, num_tokens, num_cached, drafted, accepted, num_reasoning)
                    yield Delta(text, event.logprobs, event.token_ids, None, usage, event.prompt_logprobs)
                    continue
                tail: list[str] = []
                text += detok.flush(tail)
                if counter is not None:
                    num_reasoning = counter.finish(token_texts, "".join(tail))
                usage = Usage(num_prompt, num_tokens, num_cached, drafted, accepted, num_reasoning)
                clock.finished(finish, usage)
                job.span.set_attribute("output.tokens", num_tokens)
                job.span.set_attribute("finish_reason", finish)
                yield Delta(text, event.logprobs, event.token_ids, finish, usage, event.prompt_logprobs)
                return  # after a stop string, leaving the iteration cancels the request
        raise GenerationError("the generator ended the request without a finish reason", 502, "bad_gateway")

    async def _whole(self, call: Call) -> AsyncGenerator[BaseModel, None]:
        """The non-streaming response, as the one item of a producer."""
        finished = {id(job): Finished(job) for job in call.jobs}
        async with aclosing(merge_deltas(call.jobs, self._deltas)) as deltas:
            async for job, delta in deltas:
                finished[id(job)].add(delta)
        yield Shaper(call, self.token_text).whole([finished[id(job)] for job in call.jobs])

    async def _stream(self, call: Call) -> AsyncGenerator[str, None]:
        """SSE events. An error before the first token raises (the response has not
        started); after it, the error travels as an event, then [DONE]."""
        shaper = Shaper(call, self.token_text)
        usages: dict[int, Usage] = {}
        position = {id(job): i for i, job in enumerate(call.jobs)}
        async with aclosing(merge_deltas(call.jobs, self._deltas)) as deltas:
            item = await anext(deltas)
            try:
                while item is not None:
                    job, delta = item
                    if delta.usage is not None:
                        usages[position[id(job)]] = delta.usage
                    if call.chat and not job.started:  # OpenAI's first chat chunk of a choice names the role
                        yield sse(shaper.role_chunk(job))
                    # A token whose text is held back (a partial character, a possible stop
                    # string) still goes out when the client asked for token ids: else it is lost.
                    ids = call.return_token_ids and delta.token_ids
                    if delta.text or delta.logprobs or delta.finish_reason or ids or not job.started:
                        yield sse(shaper.chunk(job, delta, delta.usage))
                    item = await anext(deltas, None)
                if call.include_usage and usages:
                    yield sse(shaper.usage_chunk(usage_of(call, usages)))
            except GenerationError as exc:
                yield sse_error(APIError.of_generation(exc))
            except Exception:
                log.exception("stream %s failed", call.id)
                yield sse_error(APIError(500, "Internal server error.", "server_error"))
        yield DONE

    def token_text(self, token_id: int) -> str:
        return self.recipe.decode([token_id], skip_special_tokens=False)
