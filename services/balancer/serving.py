"""One request through the HTTP API: check, admit, tokenize, generate, answer.

OpenAIServer serves /v1/completions and /v1/chat/completions; a request fans out
to jobs (choices.py: prompts × samples), each job's generation runs under the
balancer's queue (admission.py), and the request's deltas run in a _Pump, read
as one JSON body or as an _EventStream of SSE events (see api.py's docstring
for why)."""

import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, aclosing, suppress
from dataclasses import fields
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Tracer
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from services.balancer import protocol as p
from services.balancer.admission import PriorityGate
from services.balancer.choices import Call, Delta, Finished, Job, Shaper, usage_of
from services.balancer.errors import APIError, ClientGone
from services.balancer.generation import GenerationError, GenerationRequest, Generator, Usage
from services.balancer.http_metrics import HttpMetrics
from shared.engine.sampling_params import SamplingParams
from shared.recipe import Recipe
from shared.runtime.settings import BalancerSettings
from shared.runtime.telemetry import extract_context

log = logging.getLogger(__name__)
T = TypeVar("T")

_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams)) | {"bad_words"}
_DONE = "data: [DONE]\n\n"


# -- one request -------------------------------------------------------------------------

MAX_PROMPT_LOGPROB_BYTES = 512 << 10
"""Prompt logprobs cross NATS in prefill's handoff and decode's first chunk, beside the prompt."""


def _prompt_logprob_bytes(num_prompt: int, k: int) -> int:
    """A bound on the wire size of num_prompt TokenLogprobs with k + 1 entries each."""
    return num_prompt * (24 + 9 * (k + 1))


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
        self.gate = PriorityGate(settings.max_dispatched_requests)

    # -- the two endpoints ---------------------------------------------------------

    async def completions(self, body: p.CompletionRequest, http: Request) -> Response:
        self._check(body)
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
            call = self._call(
                body, http, prompts, chat=False, what="prompt", max_tokens=1 if echo_only else body.max_tokens,
                logprobs=body.logprobs, prompt_k=prompt_k,
            )
            call.echo, call.echo_only, call.prompt_texts = body.echo, echo_only, texts
            return await self._respond(call, bool(body.stream), http, stack)

    async def chat(self, body: p.ChatCompletionRequest, http: Request) -> Response:
        self._check(body)
        async with AsyncExitStack() as stack:
            self._admit(stack)
            prompt_ids = await asyncio.to_thread(self.encode_chat, body)
            call = self._call(
                body, http, [prompt_ids], chat=True, what="messages", max_tokens=body.requested_max_tokens,
                logprobs=body.num_logprobs, prompt_k=body.prompt_logprobs,
            )
            return await self._respond(call, bool(body.stream), http, stack)

    def encode_chat(self, body: p.ChatCompletionRequest | p.TokenizeChatRequest) -> list[int]:
        """The conversation's tokens: rendered by the chat template (the last message
        left open with continue_final_message), encoded with or without special tokens."""
        messages = [m.for_template() for m in body.messages]
        kwargs = {**(body.chat_template_kwargs or {}), "add_generation_prompt": body.add_generation_prompt}
        try:
            text = self.recipe.apply_chat_template(messages, **kwargs)
        except (ValueError, TypeError) as exc:  # the template refused, or bad template kwargs
            raise APIError(400, str(exc), param="messages") from exc
        if body.continue_final_message:
            text = _open_final_message(text, body.messages[-1], body.add_generation_prompt)
        return self.recipe.encode(text, add_special_tokens=body.add_special_tokens)

    # -- checks and preparation ----------------------------------------------------

    def _check(self, body: p.CompletionRequest | p.ChatCompletionRequest) -> None:
        if body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist.", param="model", code="model_not_found")
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

    def _call(
        self,
        body: p.CompletionRequest | p.ChatCompletionRequest,
        http: Request,
        prompts: list[list[int]],
        chat: bool,
        what: str,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_k: int | None,
    ) -> Call:
        """The jobs of one request: per prompt, num_samples generations (seed + i each,
        the first alone scoring the prompt when prompt logprobs are asked)."""
        limit = self.max_model_len
        prompts = [self._truncate(ids, body.truncate_prompt_tokens) for ids in prompts]
        bad_words = self._bad_words(body.bad_words) if body.bad_words else None
        num_samples = body.num_samples
        # best_of ranks samples by their cumulative logprob: ask for it even if the client did not.
        mesh_logprobs = logprobs if logprobs is not None or num_samples == (body.n or 1) else 0
        named = body.request_id or _header_id(http)
        call_id = f"{'chatcmpl' if chat else 'cmpl'}-{named or uuid.uuid4().hex}"
        # The mesh's ids are ours: unique, and safe as NATS subject tokens (a client's id need be neither).
        internal = call_id if named is None and len(prompts) * num_samples == 1 else None
        jobs: list[Job] = []
        for prompt_index, prompt_ids in enumerate(prompts):
            num_prompt = len(prompt_ids)
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
            if prompt_k is not None and _prompt_logprob_bytes(num_prompt, prompt_k) > MAX_PROMPT_LOGPROB_BYTES:
                param = "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs"
                raise APIError(400, f"{param}: the prompt's logprobs ({num_prompt} tokens with {prompt_k} "
                               "alternatives each) would not fit one mesh message; score a shorter prompt "
                               "or ask for fewer alternatives", param=param)
            first: Job | None = None
            for sample in range(num_samples):
                try:
                    params = body.sampling_params(
                        limit - num_prompt if max_tokens is None else max_tokens, mesh_logprobs, bad_words
                    )
                    if params.seed is not None:
                        params.seed += sample
                    if sample:
                        params.prompt_logprobs = None  # the prompt's first sample scores it for all
                    else:
                        params.prompt_logprobs = prompt_k
                    params.__post_init__()  # the seed moved
                    detokenizer = self.recipe.detokenizer(
                        prompt_ids,
                        skip_special_tokens=body.skip_special_tokens,
                        stop=body.stop_strings,
                        include_stop_str_in_output=body.include_stop_str_in_output,
                    )
                except ValueError as exc:
                    name = str(exc).split(" ", 1)[0]  # SamplingParams' messages start with the field's name
                    raise APIError(400, str(exc), param=name if name in _SAMPLING_FIELDS else None) from exc
                rid = internal or f"{call_id.split('-', 1)[0]}-{uuid.uuid4().hex}"
                request = GenerationRequest(rid, prompt_ids, params, cache_salt=body.cache_salt, priority=body.priority)
                job = Job(request, detokenizer, prompt_index, sample, prompt_index * (body.n or 1) + sample, after=first)
                first = first or job
                jobs.append(job)
        return Call(
            call_id, chat, self.model_name, jobs, prompts, body.n or 1, logprobs,
            prompt_logprobs=body.prompt_logprobs is not None,
            include_usage=body.include_usage, continuous_usage=body.continuous_usage,
            return_token_ids=body.return_token_ids, tokens_as_ids=body.return_tokens_as_token_ids,
        )

    def _truncate(self, prompt_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: the context length)."""
        if keep is None:
            return prompt_ids
        keep = self.max_model_len if keep == -1 else keep
        if keep == 0:
            raise APIError(400, "truncate_prompt_tokens: must be -1 or at least 1", param="truncate_prompt_tokens")
        return prompt_ids[-keep:]

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad words: each word alone, and after a space when
        that makes other tokens of the same length (a word inside the text)."""
        out: list[list[int]] = []
        for word in words:
            alone = self.recipe.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.recipe.encode(" " + word.lstrip(), add_special_tokens=False)
            if not alone:
                raise APIError(400, f"bad_words: {word!r} has no tokens", param="bad_words")
            out.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return out

    # -- generation ------------------------------------------------------------------

    async def _respond(self, call: Call, stream: bool, http: Request, stack: AsyncExitStack) -> Response:
        """Start the request's pump and answer with its first output; what stack
        holds (the place in flight, the span, the pump) lasts as long as the response."""
        span = self.tracer.start_span(
            f"POST {http.url.path}", context=extract_context(http.headers), kind=SpanKind.SERVER
        )
        stack.callback(span.end)
        span.set_attribute("request.id", call.id)
        span.set_attribute("prompt.tokens", sum(len(ids) for ids in call.prompts))
        if len(call.jobs) > 1:
            span.set_attribute("request.choices", len(call.jobs))
        for job in call.jobs:
            job.span = span
        context = contextvars.copy_context()
        context.run(otel_context.attach, trace.set_span_in_context(span))  # a private copy: never detached
        pump: _Pump[Any] = _Pump(self._stream(call) if stream else self._whole(call), context)
        stack.push_async_callback(pump.close)
        first = await _unless_disconnected(http, pump.next())
        headers = {"x-request-id": call.id.split("-", 1)[1]}
        if not stream:
            return json_response(first, headers)
        return _EventStream(first, pump, stack.pop_all(), headers)

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
                usage = Usage(len(job.request.prompt_token_ids), num_tokens, num_cached)
                if finish is None:
                    yield Delta(text, event.logprobs, event.token_ids, None, usage, event.prompt_logprobs)
                    continue
                text += detok.flush()
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
                        yield _sse(shaper.role_chunk(job))
                    if delta.text or delta.logprobs or delta.finish_reason or not job.started:
                        yield _sse(shaper.chunk(job, delta, delta.usage))
                    item = await anext(deltas, None)
                if call.include_usage and usages:
                    yield _sse(shaper.usage_chunk(usage_of(call, usages)))
            except GenerationError as exc:
                yield _sse_error(APIError(exc.status, str(exc), exc.error_type))
            except Exception:
                log.exception("stream %s failed", call.id)
                yield _sse_error(APIError(500, "Internal server error.", "server_error"))
        yield _DONE

    def token_text(self, token_id: int) -> str:
        return self.recipe.decode([token_id], skip_special_tokens=False)


class _EventStream(StreamingResponse):
    """The SSE body read from a request's pump; cleanup (the pump, the span, the place
    in flight) runs however the response ends. When the client goes away Starlette
    stops the body, and closing the pump cancels the request."""

    def __init__(self, first: str, pump: _Pump[str], cleanup: AsyncExitStack, headers: dict[str, str]) -> None:
        async def body() -> AsyncIterator[str]:
            item: str | None = first
            while item is not None:
                yield item
                item = await pump.next()

        headers = {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
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


def json_response(model: BaseModel, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), media_type="application/json", headers=headers)


def _header_id(http: Request) -> str | None:
    """The client's X-Request-Id, where it could name a response (vLLM takes it too)."""
    value = http.headers.get("x-request-id")
    if value is None:
        return None
    try:
        return p.check_request_id(value) if len(value) <= p.MAX_REQUEST_ID_CHARS else None
    except ValueError:
        return None


def _open_final_message(text: str, last: p.ChatMessage, add_generation_prompt: bool) -> str:
    """The rendered conversation cut right after the last message's content, so the
    reply continues it (transformers' continue_final_message)."""
    content = last.content if isinstance(last.content, str) else "".join(part.text for part in last.content or [])
    content = content.strip()
    at = text.rfind(content) if content else -1
    if at < 0:
        raise APIError(400, "continue_final_message: the chat template does not render the last message's "
                       "content as given, so it cannot be left open", param="continue_final_message")
    return text[: at + len(content)]


async def merge_deltas(
    jobs: list[Job], deltas_of: Callable[[Job], AsyncGenerator[Delta, None]]
) -> AsyncGenerator[tuple[Job, Delta], None]:
    """Every job's deltas as they come, each tagged with its job. One job is iterated
    in place; several run in tasks of their own (in this context: their spans nest
    under the request's). The first failure ends all; closing this cancels them all."""
    if len(jobs) == 1:
        async with aclosing(deltas_of(jobs[0])) as deltas:
            async for delta in deltas:
                yield jobs[0], delta
        return
    queue: asyncio.Queue[tuple[Job, Delta] | BaseException | None] = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async with aclosing(deltas_of(job)) as deltas:
                async for delta in deltas:
                    queue.put_nowait((job, delta))
        except Exception as exc:
            queue.put_nowait(exc)
        else:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        num_running = len(tasks)
        while num_running:
            item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(asyncio.CancelledError):
                await task


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _sse_error(error: APIError) -> str:
    return f"data: {error.body()}\n\n"
