"""One round at one operating point of one stage, through the balancer's OpenAI API
as a user gets it, and the figures a round gives. The requests are sent by
tools/bench/openai_stream.py (timed as `vllm bench serve` times them) and made by
tools/bench/workloads.py (seeded random token ids), each with a cache_salt of its
own, so no block of any prompt is ever a prefix-cache or kvcache hit: the figures are
uncached prefill and decode, what the planner sizes from.

prefill  `concurrency` prompts of `input_tokens` sent at once, max_tokens 1:
         TTFT per request (its median), and the uncached prompt tokens of the round
         over the time to the last first token;
decode   `batch` streams sent at once, each attending to `context` tokens on average
         (a prompt of context - max_tokens / 2, then ignore_eos and `max_tokens`),
         logprobs on so every token is counted: the figures are
         taken over the window in which every stream is decoding (after the last
         first token, before the first last token), so prefill and the ramp are out;
         where that window is under OVERLAP of a stream's decode (the prefills spread out
         against a short decode), the round is sent again with twice the tokens (and a
         shorter prompt: the same mean context), and where that cannot go on, the
         figures are each stream's own decode (flagged).
"""

import asyncio
import dataclasses
import itertools
import statistics
import time
from dataclasses import dataclass

import httpx

from tools.bench.openai_stream import RequestResult, send
from tools.bench.workloads import WorkloadConfig, make_sessions

_SALTS = itertools.count()


@dataclass(frozen=True, slots=True)
class PrefillRound:
    ttft_ms: float
    """Median over the round's requests."""
    tokens_per_s: float
    wall_s: float


@dataclass(frozen=True, slots=True)
class DecodeRound:
    itl_ms: float
    """Over the streams, the median of each one's window over its tokens in it: the
    mean gap between its tokens (SSE chunks may arrive back to back, and carry several
    tokens when the mesh speculates, so single gaps are not the decode step)."""
    tokens_per_s: float
    """Output tokens of every stream in the window over its length."""
    mean_context: float
    wall_s: float
    max_tokens: int
    """Each stream's tokens (more than asked where the streams did not overlap)."""
    overlapped: bool
    """The streams decoded together for at least half of one's decode (else the figures
    are each stream's own: the batch was never whole)."""
    num_waves: int = 1
    """Waves sent for the round (one, and one more per doubling)."""
    wave_prompts: tuple[int, ...] = ()
    """Each wave's prompt length (every stream of a wave has it): what prefill handed off to decode."""


OVERLAP = 0.25
"""The streams decoded together when every one was decoding for at least this part of
a stream's decode (the median's): enough tokens in the window to time."""
MAX_DOUBLINGS = 3
"""A decode round whose streams did not overlap is sent again with twice the tokens, at most this often."""


class RoundFailed(RuntimeError):
    """A request of the round failed: the point cannot be measured as asked."""


def request_specs(input_tokens: int, count: int, max_tokens: int, seed: int, salt: str, extra: dict) -> list:
    config = WorkloadConfig(input_len=input_tokens, output_len=max_tokens, extra_body={"temperature": 0.0, **extra})
    specs = [session.turns[0]([]) for session in make_sessions(config, count, seed)]
    for i, spec in enumerate(specs):
        spec.extra_body["cache_salt"] = f"{salt}-{next(_SALTS)}-{i}"
    return specs


async def send_wave(client: httpx.AsyncClient, model: str, specs: list) -> tuple[list[RequestResult], float, float]:
    """All at once; (results, start on the perf_counter clock, wall)."""
    start = time.perf_counter()
    results = await asyncio.gather(*(send(client, model, spec, start) for spec in specs))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RoundFailed(f"{len(failed)} of {len(results)} requests failed, e.g. {failed[0]}")
    return list(results), start, time.perf_counter() - start


async def prefill_round(client: httpx.AsyncClient, model: str, input_tokens: int, concurrency: int, seed: int,
                        salt: str) -> PrefillRound:  # fmt: skip
    specs = request_specs(input_tokens, concurrency, 1, seed, salt, {})
    results, _, wall = await send_wave(client, model, specs)
    return prefill_figures(results, input_tokens, wall)


def prefill_figures(results: list[RequestResult], input_tokens: int, wall_s: float) -> PrefillRound:
    """One wave's figures: median TTFT; its prompt tokens over the time to its last first token."""
    last_first = max(r.start_s + r.ttft_s for r in results)
    ttft = statistics.median(r.ttft_s for r in results)
    return PrefillRound(ttft * 1e3, input_tokens * len(results) / last_first, wall_s)


def _token_times(r: RequestResult) -> tuple[list[float], float]:
    """Chunk arrival times (seconds since the wave started) and tokens per chunk."""
    times = [r.start_s + r.ttft_s]
    for gap in r.itl_s:
        times.append(times[-1] + gap)
    return times, r.num_output_tokens / len(times)


async def decode_round(client: httpx.AsyncClient, model: str, batch: int, context: int, max_tokens: int, seed: int,
                       salt: str) -> DecodeRound:  # fmt: skip
    """context: the mean KV each stream attends to while it decodes (the profile's
    context_tokens): a prompt of context - max_tokens / 2, then max_tokens generated.
    A round whose streams did not decode together is sent again with twice the
    tokens and a prompt shorter by as much, the mean kept, while the prompt stays at
    least half the context."""
    if max_tokens < 4 or context < 4:
        raise ValueError(f"decode needs max_tokens and context of at least 4, got {max_tokens} and {context}")
    max_tokens = min(max_tokens, context)
    wave_prompts: list[int] = []
    for doubling in range(MAX_DOUBLINGS + 1):
        prompt = context - max_tokens // 2
        specs = request_specs(prompt, batch, max_tokens, seed, salt, {"ignore_eos": True, "logprobs": 0})
        results, _, wall = await send_wave(client, model, specs)
        wave_prompts.append(prompt)
        figures = decode_figures(results, prompt, max_tokens, wall)
        if figures.overlapped or doubling == MAX_DOUBLINGS or max_tokens * 2 > context:
            return dataclasses.replace(figures, num_waves=doubling + 1, wave_prompts=tuple(wave_prompts))
        max_tokens *= 2  # the prefills' spread was long against the decode: a longer decode
    raise AssertionError("unreachable")


def decode_figures(results: list[RequestResult], prompt: int, max_tokens: int, wall_s: float) -> DecodeRound:
    """One wave's decode figures (the module's docstring says which window)."""
    timed = [_token_times(r) for r in results if len(r.itl_s) > 0]
    if not timed:
        raise RoundFailed("no stream carried more than one chunk")
    lo = max(times[0] for times, _ in timed)
    hi = min(times[-1] for times, _ in timed)
    spans = [times[-1] - times[0] for times, _ in timed]
    overlapped = hi - lo >= OVERLAP * statistics.median(spans)
    if not overlapped:
        # The streams barely decoded together (their prefills were spread out): each
        # stream's own decode, and the whole wave's tokens over its decoding time.
        per_token = [span / ((len(times) - 1) * per_chunk) for span, (times, per_chunk) in zip(spans, timed)]
        tokens = sum((len(times) - 1) * per_chunk for times, per_chunk in timed)
        lo, hi = min(times[0] for times, _ in timed), max(times[-1] for times, _ in timed)
    else:
        tokens, per_token = 0.0, []
        for times, per_chunk in timed:
            num = len([t for t in times if lo < t <= hi]) * per_chunk
            tokens += num
            if num:
                per_token.append((hi - lo) / num)
    if not per_token or hi <= lo:
        raise RoundFailed("no token arrived while the streams were decoding")
    return DecodeRound(statistics.median(per_token) * 1e3, tokens / (hi - lo), prompt + max_tokens / 2, wall_s,
                       max_tokens, overlapped)
