"""One request to an OpenAI-compatible server, streamed and timed as `vllm bench
serve` times it: time to first token, the gaps between token-carrying chunks
(inter-token latency), end-to-end latency to the last token, and the server's
usage. Works against any server that streams OpenAI's SSE (ours, vLLM, SGLang,
OpenAI itself), on /v1/completions or /v1/chat/completions.

Tokens are counted from what the stream carries: a chunk's `logprobs` entries
when the request asked for them (one per token, exact even when a server puts
several tokens in one chunk), otherwise one per chunk with text; the server's
usage, when it sends one, is the output length reported."""

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(slots=True)
class RequestSpec:
    """What to send: a completions prompt (text or token ids) or chat messages."""

    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    max_tokens: int = 128
    num_prompt_tokens: int | None = None
    """The workload's own count, used when the server sends no usage."""
    extra_body: dict[str, Any] = field(default_factory=dict)
    """More request fields (temperature, ignore_eos, logprobs, ...)."""

    @property
    def chat(self) -> bool:
        return self.messages is not None


@dataclass(slots=True)
class RequestResult:
    success: bool
    start_s: float
    """When it was sent, in seconds since the run started."""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    """To the last token (not to [DONE])."""
    itl_s: list[float] = field(default_factory=list)
    """Gaps between token-carrying chunks."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_counted_tokens: int = 0
    """Output tokens counted off the stream."""
    num_usage_tokens: int | None = None
    """Output tokens as the server's usage reports them; None without usage."""
    num_cached_tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for a one-token answer."""
        if self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


def request_body(model: str, spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "max_tokens": spec.max_tokens, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    if spec.chat:
        body["messages"] = spec.messages
    else:
        body["prompt"] = spec.prompt
    body.update(spec.extra_body)
    return body


def _chunk_tokens(choice: dict[str, Any], chat: bool) -> tuple[int, str]:
    """(tokens, text) one stream choice carries."""
    if chat:
        text = (choice.get("delta") or {}).get("content") or ""
        logprobs = ((choice.get("logprobs") or {}).get("content")) or []
    else:
        text = choice.get("text") or ""
        logprobs = (choice.get("logprobs") or {}).get("tokens") or []
    if logprobs:
        return len(logprobs), text
    return (1 if text else 0), text


async def send(client: httpx.AsyncClient, model: str, spec: RequestSpec, run_start: float) -> RequestResult:
    """Send one request and time its stream. Never raises for the server's
    failures: a refused or broken request is a result with success False."""
    path = "/chat/completions" if spec.chat else "/completions"
    start = time.perf_counter()
    result = RequestResult(False, start - run_start, num_prompt_tokens=spec.num_prompt_tokens or 0)
    first: float | None = None
    last = start
    texts: list[str] = []
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", path, json=request_body(model, spec)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    result.error = str(error.get("message") if isinstance(error, dict) else error)
                    return result
                for choice in chunk.get("choices") or ():
                    n, text = _chunk_tokens(choice, spec.chat)
                    if n == 0:
                        continue
                    if first is None:
                        first = now
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    result.num_counted_tokens += n
                    texts.append(text)
                usage = chunk.get("usage") or usage
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if first is None:
        result.error = "the stream carried no token"
        return result
    result.success = True
    result.ttft_s, result.e2e_s = first - start, last - start
    result.text = "".join(texts)
    result.num_usage_tokens = usage.get("completion_tokens")
    result.num_output_tokens = result.num_usage_tokens or result.num_counted_tokens
    result.num_prompt_tokens = usage.get("prompt_tokens") or result.num_prompt_tokens
    result.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return result
