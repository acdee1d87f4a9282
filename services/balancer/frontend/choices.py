"""One HTTP request's choices: the jobs it fans out to (prompts × samples), and
how their deltas become OpenAI bodies and chunks (echo, logprobs, prompt
logprobs, token ids, usage summed over the choices, best_of's pick).

A Call is one HTTP request; a Job one generation in the mesh (one choice, or one
of best_of candidates). Samples of one prompt share its KV: the first is
dispatched alone, the others once its first token arrives, so they find the
prompt's full blocks in the prefix cache (the prefill instance's own, or
kvcache's) and compute only the last partial block.
"""

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span

from services.balancer.frontend import protocol as p
from services.balancer.generation import GenerationRequest, Usage
from services.balancer.frontend.reasoning_parsers import ReasoningSplitter, ReasoningTokenCount, new_splitter
from services.balancer.frontend.seeds import fingerprint
from services.balancer.frontend.tool_output import ToolPlan, ToolStream, whole_message
from services.balancer.frontend.tool_schema import constrain
from shared.engine.outputs import TokenLogprobs
from shared.recipe import IncrementalDetokenizer


@dataclass(slots=True)
class Delta:
    text: str
    logprobs: list[TokenLogprobs]
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    """Usage of this job so far (always set with finish_reason)."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """On the job's first delta, when asked."""


@dataclass(slots=True)
class Job:
    request: GenerationRequest
    detokenizer: IncrementalDetokenizer
    prompt_index: int
    sample_index: int
    index: int
    """The choice index (prompt_index * n + sample_index; best_of re-indexes)."""
    span: Span = trace.INVALID_SPAN
    arrival: float = field(default_factory=time.monotonic)
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    """Set at this job's first event (or its end): its prompt's KV is cached by then."""
    after: "Job | None" = None
    """Dispatch only once this job (the prompt's first sample) has its first token."""
    started: bool = False
    """Its first delta went out (stream: the echo and prompt token ids ride on it)."""
    text_offset: int = 0
    tool_stream: ToolStream | None = None
    """A chat stream with tools: this choice's text read for tool calls."""
    reasoning: ReasoningSplitter | None = None
    """A chat stream of a reasoning model: this choice's text split into reasoning and content."""
    reasoning_count: ReasoningTokenCount | None = None
    """A chat of a reasoning model (whole or streamed): its reasoning tokens, counted for usage."""
    """Completions logprobs: where the next token's text starts in the choice."""


@dataclass(slots=True)
class Call:
    """One HTTP request and what its response must hold."""

    id: str
    chat: bool
    model: str
    jobs: list[Job]
    prompts: list[list[int]]
    n: int
    """Choices returned per prompt (best_of draws len(jobs) // len(prompts))."""
    logprobs: int | None
    """What the client asked for (best_of may ask the mesh for more)."""
    prompt_logprobs: bool = False
    echo: bool = False
    echo_only: bool = False
    """max_tokens 0 with echo: the prompt alone; the one token generated is dropped."""
    prompt_texts: list[str] = field(default_factory=list)
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    tools: ToolPlan | None = None
    """Chat with tools: how the output becomes tool calls (tool_output.py)."""
    created: int = field(default_factory=lambda: int(time.time()))
    reasoning: str | None = None
    """Chat of a reasoning model: the reasoning format (a key of reasoning_parsers.REASONING_PARSERS)."""
    prompt_tail: str = ""
    """The prompt's last text: whether it opened a thinking block."""
    labels: dict[str, str] = field(default_factory=dict)
    """The body's labels (user, metadata, ...) as span attributes (label_fields.py)."""
    seed: int | None = None
    """The seed the request ran with (drawn when the body named none; choice i ran
    with seed + i): named by every response body's system_fingerprint."""

    @property
    def fingerprint(self) -> str | None:
        return fingerprint(self.seed) if self.seed is not None else None

    @property
    def num_samples(self) -> int:
        return len(self.jobs) // len(self.prompts)


def attach_tools(call: Call, plan: ToolPlan, stream: bool) -> None:
    """Give a planned chat call its tools: each job constrained where the choice is
    forced, and read for calls as it streams."""
    call.tools = plan
    for job in call.jobs:
        if plan.spec is not None:
            constrain(job.request.params, plan.spec)
        if stream:
            job.tool_stream = ToolStream(plan)


def split_whole(call: Call, text: str) -> tuple[str | None, str]:
    """A whole chat reply as (reasoning, content): split where the call has a reasoning
    format (reasoning_output.ReasoningSupport.attach), else all content; reasoning is
    None when the reply wrote none. Chat's message and /v1/responses' items both use it,
    so the two endpoints split alike."""
    if call.reasoning is None:
        return None, text
    splitter = new_splitter(call.reasoning, call.prompt_tail, raw=call.tools is not None)
    piece = splitter.feed(text)
    piece.add(splitter.finish())
    return (piece.reasoning if splitter.saw_reasoning else None), piece.content


def split_delta(job: Job, delta: Delta) -> tuple[str | None, str]:
    """A streamed delta as (reasoning, content) through the job's splitter (which holds
    back a tag split over deltas, so the pieces add up exactly); reasoning None when
    this delta has none. Chat's chunks and /v1/responses' events both use it."""
    if job.reasoning is None:
        return None, delta.text
    piece = job.reasoning.feed(delta.text)
    if delta.finish_reason is not None:
        piece.add(job.reasoning.finish())
    return piece.reasoning or None, piece.content


def token_text_of(call: Call, decode_one: "p.TokenText") -> "p.TokenText":
    if call.tokens_as_ids:
        return lambda token_id: f"token_id:{token_id}"
    return decode_one


@dataclass(slots=True)
class Finished:
    """One job's whole output (a non-streamed response)."""

    job: Job
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.logprobs += delta.logprobs
        self.token_ids += delta.token_ids
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.usage = delta.usage or self.usage
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


def usage_of(call: Call, usages: dict[int, Usage]) -> Usage:
    """The request's usage from its jobs' (by job position): prompts counted once
    each, completions summed over every job (best_of's dropped ones included, as
    OpenAI bills them), cached tokens as the prompts' first samples found them."""
    num_prompt = sum(len(ids) for ids in call.prompts)
    num_output = 0 if call.echo_only else sum(u.completion_tokens for u in usages.values())
    samples = call.num_samples
    num_cached = sum(u.cached_tokens for i, u in usages.items() if i % samples == 0)
    drafted = sum(u.spec_drafted_tokens for u in usages.values())
    accepted = sum(u.spec_accepted_tokens for u in usages.values())
    num_reasoning = sum(u.reasoning_tokens for u in usages.values())
    return Usage(num_prompt, num_output, num_cached, drafted, accepted, num_reasoning)


def pick_best(call: Call, finished: list[Finished]) -> list[Finished]:
    """Per prompt, the n samples with the highest cumulative logprob (best_of), re-indexed."""
    samples = call.num_samples
    if samples == call.n:
        return finished
    chosen: list[Finished] = []
    for start in range(0, len(finished), samples):
        best = sorted(finished[start : start + samples], key=lambda f: -f.cumulative_logprob)[: call.n]
        for rank, f in enumerate(best):
            f.job.index = f.job.prompt_index * call.n + rank
        chosen += best
    return chosen


class Shaper:
    """Builds the OpenAI bodies of one call."""

    def __init__(self, call: Call, token_text: "p.TokenText") -> None:
        self.call = call
        self.token_text = token_text_of(call, token_text)

    # -- whole responses ------------------------------------------------------------

    def whole(self, finished: list[Finished]) -> p.CompletionResponse | p.ChatCompletionResponse:
        call = self.call
        usage = self._usage_info(usage_of(call, {i: f.usage for i, f in enumerate(finished) if f.usage is not None}))
        chosen = sorted(pick_best(call, finished), key=lambda f: f.job.index)
        if call.chat:
            choices = [
                p.ChatChoice(
                    index=f.job.index,
                    logprobs=self._chat_logprobs(f.logprobs),
                    token_ids=f.token_ids if call.return_token_ids else None,
                    **self._message(f),
                )
                for f in chosen
            ]
            first = finished[0]
            return p.ChatCompletionResponse(
                id=call.id, created=call.created, model=call.model, choices=choices, usage=usage,
                system_fingerprint=call.fingerprint,
                prompt_logprobs=self._prompt_logprobs(first.prompt_logprobs),
                prompt_token_ids=call.prompts[0] if call.return_token_ids else None,
            )
        return p.CompletionResponse(
            id=call.id, created=call.created, model=call.model, choices=[self._completion_choice(f) for f in chosen],
            usage=usage, system_fingerprint=call.fingerprint,
        )

    def _message(self, f: Finished) -> dict[str, Any]:
        """A chat choice's message and finish_reason (the reasoning split off first, then
        tool calls read out of the rest with tools)."""
        call = self.call
        reasoning, text = split_whole(call, f.text)
        if call.tools is None:
            message = p.ChatResponseMessage(content=text, reasoning_content=reasoning)
            return {"message": message, "finish_reason": f.finish_reason}
        message, finish = whole_message(call.tools, text, f.finish_reason)
        message.reasoning_content = reasoning
        return {"message": message, "finish_reason": finish}

    def _completion_choice(self, f: Finished) -> p.CompletionChoice:
        call, job = self.call, f.job
        prompt_ids = call.prompts[job.prompt_index]
        text = "" if call.echo_only else f.text
        logprobs = [] if call.echo_only else f.logprobs
        token_ids = [] if call.echo_only else f.token_ids
        finish = "length" if call.echo_only else f.finish_reason
        if call.echo:
            text = call.prompt_texts[job.prompt_index] + text
        return p.CompletionChoice(
            index=job.index,
            text=text,
            logprobs=self._completion_logprobs(job, logprobs, f.prompt_logprobs, prompt_ids),
            finish_reason=finish,
            prompt_logprobs=self._prompt_logprobs(f.prompt_logprobs),
            prompt_token_ids=prompt_ids if call.return_token_ids else None,
            token_ids=token_ids if call.return_token_ids else None,
        )

    # -- stream chunks --------------------------------------------------------------

    def chunk(self, job: Job, delta: Delta, usage: Usage | None) -> p.CompletionResponse | p.ChatCompletionChunk:
        """The chunk of one delta; the job's first carries the echo and prompt token ids."""
        call = self.call
        first = not job.started
        job.started = True
        prompt_ids = call.prompts[job.prompt_index]
        usage_info = self._usage_info(usage) if usage is not None and call.continuous_usage else None
        token_ids = delta.token_ids if call.return_token_ids else None
        if call.chat:
            reasoning, text = split_delta(job, delta)
            message, finish = p.DeltaMessage(content=text), delta.finish_reason
            if job.tool_stream is not None:
                message, finish = job.tool_stream.delta(text, delta.finish_reason)
            elif job.reasoning is not None and not text:
                message.content = None  # a reasoning piece (or a held-back tag) carries no content key
            message.reasoning_content = reasoning
            choice = p.ChatStreamChoice(
                index=job.index, delta=message, logprobs=self._chat_logprobs(delta.logprobs),
                finish_reason=finish, token_ids=token_ids,
            )
            return self.chat_chunk([choice], usage_info)
        text, logprobs = delta.text, delta.logprobs
        if call.echo_only:
            text, logprobs, token_ids = "", [], [] if token_ids is not None else None
            if delta.finish_reason is not None:
                delta.finish_reason = "length"
        if first and call.echo:
            text = call.prompt_texts[job.prompt_index] + text
        choice = p.CompletionChoice(
            index=job.index,
            text=text,
            logprobs=self._completion_logprobs(job, logprobs, delta.prompt_logprobs if first else None, prompt_ids),
            finish_reason=delta.finish_reason,
            prompt_logprobs=self._prompt_logprobs(delta.prompt_logprobs) if first else None,
            prompt_token_ids=prompt_ids if first and call.return_token_ids else None,
            token_ids=token_ids,
        )
        return self.completion_chunk([choice], usage_info)

    def role_chunk(self, job: Job) -> p.ChatCompletionChunk:
        """OpenAI's first chat chunk of a choice names the role; vLLM's carries the prompt's token ids."""
        call = self.call
        # With tools the reply may be calls only: its content starts null, as OpenAI's does.
        content = None if job.tool_stream is not None else ""
        choice = p.ChatStreamChoice(index=job.index, delta=p.DeltaMessage(role="assistant", content=content))
        chunk = self.chat_chunk([choice], None)
        if call.return_token_ids and job.index == 0:
            chunk.prompt_token_ids = call.prompts[0]
        return chunk

    def chat_chunk(self, choices: list[p.ChatStreamChoice], usage: p.UsageInfo | None) -> p.ChatCompletionChunk:
        call = self.call
        return p.ChatCompletionChunk(id=call.id, created=call.created, model=call.model, choices=choices, usage=usage,
                                     system_fingerprint=call.fingerprint)  # fmt: skip

    def completion_chunk(self, choices: list[p.CompletionChoice], usage: p.UsageInfo | None) -> p.CompletionResponse:
        call = self.call
        return p.CompletionResponse(id=call.id, created=call.created, model=call.model, choices=choices, usage=usage,
                                    system_fingerprint=call.fingerprint)  # fmt: skip

    def usage_chunk(self, usage: Usage) -> p.CompletionResponse | p.ChatCompletionChunk:
        info = self._usage_info(usage)
        return self.chat_chunk([], info) if self.call.chat else self.completion_chunk([], info)

    def _usage_info(self, usage: Usage) -> p.UsageInfo:
        # A call split for reasoning reports its reasoning tokens, 0 included.
        return p.UsageInfo.of(usage, reasoning=self.call.reasoning is not None)

    # -- logprobs ----------------------------------------------------------------------

    def _chat_logprobs(self, entries: list[TokenLogprobs]) -> p.ChatLogprobs | None:
        if self.call.logprobs is None:
            return None
        return p.chat_logprobs(entries, self.token_text)

    def _completion_logprobs(
        self, job: Job, entries: list[TokenLogprobs], prompt: list[TokenLogprobs | None] | None, prompt_ids: list[int]
    ) -> p.CompletionLogprobs | None:
        call = self.call
        if call.logprobs is None:
            return None
        listed: list[TokenLogprobs | int] = []
        if call.echo and prompt is not None:  # the echoed prompt's tokens first (None: its first token)
            listed += [prompt_ids[i] if lp is None else lp for i, lp in enumerate(prompt)]
        listed += entries
        logprobs, job.text_offset = p.completion_logprobs(listed, self.token_text, job.text_offset)
        return logprobs

    def _prompt_logprobs(self, entries: list[TokenLogprobs | None] | None) -> p.PromptLogprobs | None:
        if not self.call.prompt_logprobs or entries is None:
            return None
        return p.prompt_logprobs(entries, self.token_text)
