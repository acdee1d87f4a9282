"""One request through the HTTP API: check, admit, tokenize, generate, answer.

OpenAIServer serves /v1/completions and /v1/chat/completions; each request's
generation runs in a _Pump, read as one JSON body or as an _EventStream of SSE
events (see api.py's docstring for why)."""

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import AsyncExitStack, aclosing, suppress
from dataclasses import dataclass, field, fields
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Tracer
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from services.balancer import protocol as p
from services.balancer.errors import APIError, ClientGone
from services.balancer.generation import GenerationError, GenerationRequest, Generator, Usage
from services.balancer.http_metrics import HttpMetrics
from shared.engine.outputs import TokenLogprobs
from shared.engine.sampling_params import SamplingParams
from shared.recipe import IncrementalDetokenizer, Recipe
from shared.runtime.settings import BalancerSettings
from shared.runtime.telemetry import extract_context

log = logging.getLogger(__name__)
T = TypeVar("T")

_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
_DONE = "data: [DONE]\n\n"


# -- one request -------------------------------------------------------------------------


@dataclass(slots=True)
class _Job:
    request: GenerationRequest
    detokenizer: IncrementalDetokenizer
    chat: bool
    include_usage: bool
    span: Span = trace.INVALID_SPAN
    arrival: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))
    text_offset: int = 0
    """Completions logprobs: where the next token's text starts in the output."""


@dataclass(slots=True)
class _Delta:
    text: str
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    usage: Usage | None = None
    """Set with finish_reason."""


class _Pump(Generic[T]):
    """Runs a producer in a task of its own, into a queue; close() cancels it."""

    def __init__(self, producer: AsyncGenerator[T, None], context: contextvars.Context) -> None:
        self._queue: asyncio.Queue[T | BaseException | None] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(producer), context=context)

    async def _run(self, producer: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(producer):  # a cancel lands in the producer and closes the generator
                async for item in producer:
                    self._queue.put_nowait(item)
        except Exception as exc:
            self._queue.put_nowait(exc)
        else:
            self._queue.put_nowait(None)

    async def next(self) -> T | None:
        """The next item, None at the end; raises what the producer raised."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def close(self) -> None:
        self._task.cancel()
        with suppress(asyncio.CancelledError):
            await self._task


class OpenAIServer:
    def __init__(
        self,
        generator: Generator,
        recipe: Recipe,
        model_name: str,
        max_model_len: int,
        settings: BalancerSettings,
        stats: HttpMetrics,
        tracer: Tracer,
    ) -> None:
        self.generator = generator
        self.recipe = recipe
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.settings = settings
        self.stats = stats
        self.tracer = tracer
        self.num_in_flight = 0
        """Admitted and not finished, counted here (not asked of the generator) so
        that two requests arriving together cannot both take the last place."""

    # -- the two endpoints ---------------------------------------------------------

    async def completions(self, body: p.CompletionRequest, http: Request) -> Response:
        self._check(body)
        prompt = body.single_prompt
        async with AsyncExitStack() as stack:
            self._admit(stack)
            if isinstance(prompt, str):  # off the loop: a long prompt takes a while
                prompt_ids = await asyncio.to_thread(self.recipe.encode, prompt)
            else:
                prompt_ids = list(prompt)
            job = self._job(body, prompt_ids, body.max_tokens, body.logprobs, chat=False, what="prompt")
            return await self._respond(job, bool(body.stream), http, stack)

    async def chat(self, body: p.ChatCompletionRequest, http: Request) -> Response:
        self._check(body)
        messages = [m.for_template() for m in body.messages]
        kwargs = {**(body.chat_template_kwargs or {}), "add_generation_prompt": body.add_generation_prompt}
        async with AsyncExitStack() as stack:
            self._admit(stack)
            try:
                prompt_ids = await asyncio.to_thread(self.recipe.encode_chat, messages, **kwargs)
            except (ValueError, TypeError) as exc:  # the template refused, or bad template kwargs
                raise APIError(400, str(exc), param="messages") from exc
            job = self._job(body, prompt_ids, body.requested_max_tokens, body.num_logprobs, chat=True, what="messages")
            return await self._respond(job, bool(body.stream), http, stack)

    # -- checks and preparation ----------------------------------------------------

    def _check(self, body: p.CompletionRequest | p.ChatCompletionRequest) -> None:
        if body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist.", param="model", code="model_not_found")
        if body.model_extra:
            log.debug("ignoring unknown request fields %s", sorted(body.model_extra))

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

    def _job(
        self,
        body: p.CompletionRequest | p.ChatCompletionRequest,
        prompt_ids: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        chat: bool,
        what: str,
    ) -> _Job:
        num_prompt, limit = len(prompt_ids), self.max_model_len
        if num_prompt == 0:
            raise APIError(400, f"The {what} is empty.", param=what)
        if num_prompt >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{num_prompt} input tokens. Please reduce the length of the {what}.",
                param=what,
            )
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the {what}, {max_tokens} in the completion). "
                f"Please reduce the length of the {what} or completion.",
                param="max_tokens",
            )
        try:
            params = body.sampling_params(limit - num_prompt if max_tokens is None else max_tokens, logprobs)
            detokenizer = self.recipe.detokenizer(
                prompt_ids,
                skip_special_tokens=body.skip_special_tokens,
                stop=body.stop_strings,
                include_stop_str_in_output=body.include_stop_str_in_output,
            )
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0]  # SamplingParams' messages start with the field's name
            raise APIError(400, str(exc), param=name if name in _SAMPLING_FIELDS else None) from exc
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        request = GenerationRequest(request_id, prompt_ids, params, cache_salt=body.cache_salt)
        return _Job(request, detokenizer, chat, body.include_usage)

    # -- generation ------------------------------------------------------------------

    async def _respond(self, job: _Job, stream: bool, http: Request, stack: AsyncExitStack) -> Response:
        """Start the request's pump and answer with its first output; what stack
        holds (the place in flight, the span, the pump) lasts as long as the response."""
        span = self.tracer.start_span(
            f"POST {http.url.path}", context=extract_context(http.headers), kind=SpanKind.SERVER
        )
        stack.callback(span.end)
        span.set_attribute("request.id", job.request.request_id)
        span.set_attribute("prompt.tokens", len(job.request.prompt_token_ids))
        job.span = span
        context = contextvars.copy_context()
        context.run(otel_context.attach, trace.set_span_in_context(span))  # a private copy: never detached
        pump: _Pump[Any] = _Pump(self._stream(job) if stream else self._whole(job), context)
        stack.push_async_callback(pump.close)
        first = await _unless_disconnected(http, pump.next())
        if not stream:
            return json_response(first)
        return _EventStream(first, pump, stack.pop_all())

    async def _deltas(self, job: _Job) -> AsyncGenerator[_Delta, None]:
        """Text deltas of one request; the last one has finish_reason and usage.
        Closing this closes the generator's iteration, which cancels the request."""
        detok = job.detokenizer
        num_tokens, num_cached = 0, 0
        clock = self.stats.clock(job.arrival, len(job.request.prompt_token_ids))
        async with aclosing(self.generator.generate(job.request)) as events, clock:
            async for event in events:
                clock.tokens(len(event.token_ids))
                num_tokens += len(event.token_ids)
                if event.usage is not None:  # on the last event; one cut by a stop string has none
                    num_cached = event.usage.cached_tokens
                text = detok.add_tokens(event.token_ids)
                finish = "stop" if detok.stop_reason is not None else event.finish_reason
                if finish is None:
                    yield _Delta(text, event.logprobs)
                    continue
                text += detok.flush()
                usage = Usage(len(job.request.prompt_token_ids), num_tokens, num_cached)
                clock.finished(finish, usage)
                job.span.set_attribute("output.tokens", num_tokens)
                job.span.set_attribute("finish_reason", finish)
                yield _Delta(text, event.logprobs, finish, usage)
                return  # after a stop string, leaving the iteration cancels the request
        raise GenerationError("the generator ended the request without a finish reason", 502, "bad_gateway")

    async def _whole(self, job: _Job) -> AsyncGenerator[BaseModel, None]:
        """The non-streaming response, as the one item of a producer."""
        texts: list[str] = []
        logprobs: list[TokenLogprobs] = []
        final: _Delta | None = None
        async with aclosing(self._deltas(job)) as deltas:
            async for final in deltas:
                texts.append(final.text)
                logprobs += final.logprobs
        assert final is not None and final.finish_reason is not None and final.usage is not None
        text, usage, finish = "".join(texts), p.UsageInfo.of(final.usage), final.finish_reason
        rid, created, model = job.request.request_id, job.created, self.model_name
        if job.chat:
            message = p.ChatResponseMessage(content=text)
            chat = p.ChatChoice(message=message, logprobs=self._chat_logprobs(job, logprobs), finish_reason=finish)
            yield p.ChatCompletionResponse(id=rid, created=created, model=model, choices=[chat], usage=usage)
        else:
            logprobs_ = self._completion_logprobs(job, logprobs)
            choice = p.CompletionChoice(text=text, logprobs=logprobs_, finish_reason=finish)
            yield p.CompletionResponse(id=rid, created=created, model=model, choices=[choice], usage=usage)

    async def _stream(self, job: _Job) -> AsyncGenerator[str, None]:
        """SSE events. An error before the first token raises (the response has not
        started); after it, the error travels as an event, then [DONE]."""
        async with aclosing(self._deltas(job)) as deltas:
            delta: _Delta | None = await anext(deltas)
            try:
                if job.chat:  # OpenAI's first chat chunk names the role
                    yield _sse(self._chat_chunk(job, p.DeltaMessage(role="assistant", content="")))
                usage = None
                while delta is not None:
                    if delta.text or delta.logprobs or delta.finish_reason:
                        yield _sse(self._chunk(job, delta))
                    usage = delta.usage or usage
                    delta = await anext(deltas, None)
                if job.include_usage and usage is not None:
                    last = self._chat_chunk(job, None) if job.chat else self._completion_chunk(job, None)
                    last.usage = p.UsageInfo.of(usage)
                    yield _sse(last)
            except GenerationError as exc:
                yield _sse_error(APIError(exc.status, str(exc), exc.error_type))
            except Exception:
                log.exception("stream %s failed", job.request.request_id)
                yield _sse_error(APIError(500, "Internal server error.", "server_error"))
        yield _DONE

    # -- OpenAI shapes -------------------------------------------------------------------

    def _chunk(self, job: _Job, delta: _Delta) -> BaseModel:
        if job.chat:
            logprobs = self._chat_logprobs(job, delta.logprobs)
            return self._chat_chunk(job, p.DeltaMessage(content=delta.text), logprobs, delta.finish_reason)
        logprobs_ = self._completion_logprobs(job, delta.logprobs)
        choice = p.CompletionChoice(text=delta.text, logprobs=logprobs_, finish_reason=delta.finish_reason)
        return self._completion_chunk(job, choice)

    def _chat_chunk(
        self, job: _Job, delta: p.DeltaMessage | None, logprobs: p.ChatLogprobs | None = None, finish: str | None = None
    ) -> p.ChatCompletionChunk:
        choices = [] if delta is None else [p.ChatStreamChoice(delta=delta, logprobs=logprobs, finish_reason=finish)]
        rid, model = job.request.request_id, self.model_name
        return p.ChatCompletionChunk(id=rid, created=job.created, model=model, choices=choices)

    def _completion_chunk(self, job: _Job, choice: p.CompletionChoice | None) -> p.CompletionResponse:
        choices = [] if choice is None else [choice]
        rid, model = job.request.request_id, self.model_name
        return p.CompletionResponse(id=rid, created=job.created, model=model, choices=choices)

    def _token_text(self, token_id: int) -> str:
        return self.recipe.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(self, job: _Job, entries: list[TokenLogprobs]) -> p.ChatLogprobs | None:
        if job.request.params.logprobs is None:
            return None
        return p.chat_logprobs(entries, self._token_text)

    def _completion_logprobs(self, job: _Job, entries: list[TokenLogprobs]) -> p.CompletionLogprobs | None:
        if job.request.params.logprobs is None:
            return None
        logprobs, job.text_offset = p.completion_logprobs(entries, self._token_text, job.text_offset)
        return logprobs


class _EventStream(StreamingResponse):
    """The SSE body read from a request's pump; cleanup (the pump, the span, the place
    in flight) runs however the response ends. When the client goes away Starlette
    stops the body, and closing the pump cancels the request."""

    def __init__(self, first: str, pump: _Pump[str], cleanup: AsyncExitStack) -> None:
        async def body() -> AsyncIterator[str]:
            item: str | None = first
            while item is not None:
                yield item
                item = await pump.next()

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(body(), media_type="text/event-stream", headers=headers)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup.aclose()


async def _unless_disconnected(http: Request, work: Awaitable[T]) -> T:
    """work's result; if the client disconnects first, work is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(http))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnect(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def json_response(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _sse_error(error: APIError) -> str:
    return f"data: {error.body()}\n\n"
