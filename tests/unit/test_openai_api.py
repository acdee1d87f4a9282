"""The balancer's OpenAI API served for real: uvicorn on free ports, a LocalGenerator
over a real AsyncEngine on the tiny model, the official openai client for the happy
paths and httpx for errors, SSE framing and disconnects."""

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from services.balancer.frontend.api import create_app
from services.balancer.generation import GenerationError, GenerationRequest, Generator, TokenEvent
from services.balancer.local import LocalGenerator
from services.balancer.frontend.protocol import MAX_CACHE_SALT_CHARS, MAX_STOP_TOKEN_IDS
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.outputs import EngineLoad
from shared.engine.sampling_params import SamplingParams
from tools.make_model import make_model
from shared.recipe import Recipe
from shared.runtime.metrics import Metrics
from shared.runtime.settings import BalancerSettings
from tests.helpers.uvicorn_app import Served, serve

MODEL = "tiny-llama"
KEY = "test-key"
MAX_MODEL_LEN = 256
MAX_BODY = 64 << 10
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "def fibonacci(n):\n    "


class Recorder:
    """The real generator, remembering how each request's iteration ended: its last
    finish_reason, None when the HTTP layer closed it early (which cancels the request).
    Like the mesh's generator it holds a span open across its yields."""

    def __init__(self, inner: Generator, tracer: Tracer) -> None:
        self.inner = inner
        self.tracer = tracer
        self.ended: dict[str, str | None] = {}

    def num_in_flight(self) -> int:
        return self.inner.num_in_flight()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        finish = None
        try:
            with self.tracer.start_as_current_span("generate"):
                async with aclosing(self.inner.generate(request)) as events:
                    async for event in events:
                        finish = event.finish_reason
                        yield event
        finally:
            self.ended[request.request_id] = finish


@dataclass
class Failing:
    """A generator that fails after `after` events (the mesh losing its workers)."""

    error: Exception = field(default_factory=lambda: GenerationError("no decode instance is alive", 503))
    after: int = 0

    def num_in_flight(self) -> int:
        return 0

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        for _ in range(self.after):
            yield TokenEvent([60])
        raise self.error


@dataclass
class Mesh:
    path: str
    loop: asyncio.AbstractEventLoop
    generator: LocalGenerator
    recorder: Recorder
    main: Served
    """api_key set, max_request_bytes = MAX_BODY, metrics served."""
    narrow: Served
    """max_queued_requests = 1."""
    failing: Served
    failure: Failing
    spans: InMemorySpanExporter
    """Spans of the main app's tracer."""

    def on_loop(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def load(self) -> EngineLoad:
        return self.on_loop(self.generator.engine.call(lambda engine: engine.load()))

    def client(self, served: Served | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{(served or self.main).url}/v1", api_key=KEY, max_retries=0, timeout=30)

    def wait_idle(self, timeout: float = 10.0) -> EngineLoad:
        """Until the engine holds no request and every KV block is free again."""
        deadline = time.monotonic() + timeout
        while True:
            load = self.load()
            idle = self.generator.num_in_flight() == 0 and load.num_free_kv_blocks == load.num_total_kv_blocks
            if idle or time.monotonic() > deadline:
                return load
            time.sleep(0.05)


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("openai-model")
    make_model(path)
    return str(path)


@pytest.fixture(scope="session")
def mesh(model_path: str) -> Iterator[Mesh]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-server-loop", daemon=True)
    thread.start()
    config = EngineConfig(model=model_path, block_size=16, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
    generator = LocalGenerator.start(config, loop)
    recipe = Recipe.from_pretrained(model_path)
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracer = provider.get_tracer("test")
    recorder = Recorder(generator, tracer)
    failure = Failing()

    def app(settings: BalancerSettings, metrics: Metrics | None, generator: Generator = recorder, **kw: Any) -> Any:
        return create_app(
            generator=generator, recipe=recipe, model_name=MODEL, max_model_len=MAX_MODEL_LEN,
            settings=settings, metrics=metrics, **kw,
        )

    main_settings = BalancerSettings(api_key=KEY, max_request_bytes=MAX_BODY)
    main = serve(loop, app(main_settings, Metrics("balancer"), tracer=tracer))
    narrow = serve(loop, app(BalancerSettings(api_key=KEY, max_queued_requests=1), None))
    failing = serve(loop, app(BalancerSettings(api_key=KEY), None, failure))
    mesh = Mesh(model_path, loop, generator, recorder, main, narrow, failing, failure, spans)
    yield mesh
    for served in (main, narrow, failing):
        served.stop()
    mesh.on_loop(generator.shutdown())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def post(served: Served, path: str, body: dict[str, Any] | bytes, headers: dict[str, str] = AUTH) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {**headers, "Content-Type": "application/json"}
        return httpx.post(served.url + path, content=body, headers=headers, timeout=30)
    return httpx.post(served.url + path, json=body, headers=headers, timeout=30)


def assert_error(response: httpx.Response, status: int, match: str = "") -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    assert match.lower() in error["message"].lower(), error["message"]
    return error


def sse_events(lines: Iterator[str]) -> list[str]:
    """The data payloads of an SSE body, in order."""
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


# -- happy paths -------------------------------------------------------------------


def test_models_and_health(mesh: Mesh) -> None:
    models = mesh.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(mesh.main.url + "/health").status_code == 200


def test_greedy_completion_equals_offline_llm(mesh: Mesh) -> None:
    llm = LLM(mesh.path, block_size=16, max_model_len=MAX_MODEL_LEN)
    expected = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0))[0]
    got = mesh.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.object == "text_completion" and got.id.startswith("cmpl-")
    assert got.choices[0].text == expected.text
    assert got.choices[0].finish_reason == expected.finish_reason
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert got.usage.completion_tokens == len(expected.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    # The same prompt as token ids, streamed: the same text.
    stream = mesh.client().completions.create(
        model=MODEL, prompt=expected.prompt_token_ids, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_stream_equals_non_stream(mesh: Mesh) -> None:
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    full = mesh.client().chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0
    )
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason in ("stop", "length")
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", mesh.main.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == full.choices[0].message.content
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == full.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == full.usage.completion_tokens
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)


def test_logprobs_shapes(mesh: Mesh) -> None:
    got = mesh.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    n = got.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4 and top[token] == logprob
    chat = mesh.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token  # greedy
    plain = mesh.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert plain.choices[0].logprobs is None


def test_stop_string_cuts_the_text(mesh: Mesh) -> None:
    client = mesh.client()
    greedy = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**greedy).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3, text
    cut = client.completions.create(**greedy, stop=[stop, "never appears"])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < 20
    assert mesh.recorder.ended[cut.id] is None  # closed early: the engine request was cancelled
    streamed = client.completions.create(**greedy, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert mesh.wait_idle().num_free_kv_blocks == mesh.load().num_total_kv_blocks  # the cut request was cancelled


def test_seed_gives_the_same_sample_and_temperature_is_honoured(mesh: Mesh) -> None:
    def complete(**params: Any) -> str:
        return mesh.client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True}, **params
        ).choices[0].text

    sampled = complete(temperature=1.0, seed=1234)
    assert complete(temperature=1.0, seed=1234) == sampled
    assert complete(temperature=1.0, seed=4321) != sampled  # the seed is honoured, not fixed
    assert complete(temperature=0) != sampled  # the temperature is honoured: this run is not greedy


def test_shared_prefix_is_cached(mesh: Mesh) -> None:
    prompt = "class Cache:\n    " + " ".join(f"slot_{i} = {i}" for i in range(30))
    first = mesh.client().completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 48
    second = mesh.client().completions.create(model=MODEL, prompt=prompt + " tail", max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 32
    assert second.usage.prompt_tokens_details.cached_tokens % 16 == 0


# -- errors ----------------------------------------------------------------------------


def test_bad_requests_get_400(mesh: Mesh) -> None:
    base = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    error = assert_error(post(mesh.main, "/v1/completions", {**base, "temperature": -1}), 400, "temperature")
    assert error["param"] == "temperature" and error["type"] == "invalid_request_error"
    assert_error(post(mesh.main, "/v1/completions", {**base, "n": 0}), 400, "n: Input should be greater than or equal to 1")
    assert_error(post(mesh.main, "/v1/completions", {**base, "prompt": ["a"] * 65}), 400, "at most 64 prompts")
    assert_error(post(mesh.main, "/v1/completions", {**base, "temperature": "hot"}), 400, "temperature")
    assert_error(post(mesh.main, "/v1/completions", {"model": MODEL}), 400, "prompt")
    assert_error(post(mesh.main, "/v1/completions", b"{not json"), 400)
    too_long = {**base, "prompt": list(range(5, 305))}
    assert_error(post(mesh.main, "/v1/completions", too_long), 400, "maximum context length is 256")
    too_many = {**base, "prompt": [5] * 200, "max_tokens": 100}
    assert_error(post(mesh.main, "/v1/completions", too_many), 400, "you requested 300 tokens")
    # The engine's own refusal (a token id past the vocabulary), streamed or not.
    assert_error(post(mesh.main, "/v1/completions", {**base, "prompt": [10**6]}), 400)
    assert_error(post(mesh.main, "/v1/completions", {**base, "prompt": [10**6], "stream": True}), 400)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}
    assert_error(post(mesh.main, "/v1/chat/completions", chat), 400,
                 "messages.0.content.0: Input tag 'input_audio' found using 'type' does not match")
    # An image part without its image; with one, this text-only model refuses it (tests/unit/test_image_api.py).
    chat = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    assert_error(post(mesh.main, "/v1/chat/completions", chat), 400, "messages.0.content.0.image_url: needed")
    assert_error(post(mesh.main, "/v1/chat/completions", {**chat, "messages": []}), 400, "messages")
    ok = post(mesh.main, "/v1/completions", base)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    with pytest.raises(openai.BadRequestError):
        mesh.client().completions.create(model=MODEL, prompt="x", max_tokens=2, n=0)


_COMPLETION = {"model": MODEL, "prompt": "x", "max_tokens": 2}
_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
_NAN, _INF = float("nan"), float("inf")
_TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (request, what replaces or adds to it, the param the 400 names)
BAD_INPUTS = [
    # Values that would not fit their protobuf field deeper in the mesh.
    (_COMPLETION, {"prompt": [-1]}, "prompt.0"),
    (_COMPLETION, {"prompt": [5, 2**32]}, "prompt.1"),
    (_COMPLETION, {"prompt": [[5, -1]]}, "prompt.0.1"),
    (_COMPLETION, {"prompt": [-1], "stream": True}, "prompt.0"),
    (_COMPLETION, {"seed": -1}, "seed"),
    (_COMPLETION, {"seed": 2**80}, "seed"),
    (_COMPLETION, {"top_k": 2**40}, "top_k"),
    (_COMPLETION, {"top_k": -2}, "top_k"),
    (_COMPLETION, {"stop_token_ids": [-1]}, "stop_token_ids"),
    (_COMPLETION, {"stop_token_ids": [2**32]}, "stop_token_ids"),
    # Sizes bounded so a request fits a NATS message.
    (_COMPLETION, {"cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)}, "cache_salt"),
    (_COMPLETION, {"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    # Text that is not valid Unicode (JSON can spell a lone surrogate).
    (_COMPLETION, {"prompt": "a\ud800b"}, "prompt"),
    (_COMPLETION, {"prompt": ["\udfff"]}, "prompt.0"),
    (_COMPLETION, {"stop": "\ud800"}, "stop"),
    (_CHAT, {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages.0.content"),
    (_CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content.0.text"),
    (_CHAT, {"chat_template_kwargs": {"enable_thinking": False, "notes": ["\udc00"]}}, "chat_template_kwargs"),
    # Floats that are not finite.
    (_COMPLETION, {"temperature": _NAN}, "temperature"),
    (_COMPLETION, {"temperature": _INF}, "temperature"),
    (_COMPLETION, {"temperature": -_INF}, "temperature"),
    (_COMPLETION, {"top_p": _NAN}, "top_p"),
    (_COMPLETION, {"min_p": _INF}, "min_p"),
    (_COMPLETION, {"presence_penalty": -_INF}, "presence_penalty"),
    (_COMPLETION, {"frequency_penalty": _NAN}, "frequency_penalty"),
    (_COMPLETION, {"repetition_penalty": _INF}, "repetition_penalty"),
    (_CHAT, {"temperature": _NAN}, "temperature"),
    # Fields we do not implement, declared or not.
    (_COMPLETION, {"stream_options": {"include_usage": True}}, "stream_options"),
    (_COMPLETION, {"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    (_COMPLETION, {"stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats"),
    # Tools (tool_bodies.py): each mistake named; the legacy functions API is not served.
    (_CHAT, {"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]},
     "tools.0.function.name"),
    (_CHAT, {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name"),
    (_CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools.0.function.parameters"),
    (_CHAT, {"tools": [_TOOL, _TOOL]}, "tools"),
    (_CHAT, {"tools": []}, "tools"),
    (_CHAT, {"tool_choice": "auto"}, "tool_choice"),
    (_CHAT, {"tool_choice": "required"}, "tool_choice"),
    (_CHAT, {"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    (_CHAT, {"tools": [{"type": "function", "function": {**_TOOL["function"], "strict": True}}]},
     "tools.0.function.strict"),
    (_CHAT, {"functions": [_TOOL["function"]]}, "functions"),
    (_CHAT, {"function_call": "auto"}, "function_call"),
    (_CHAT, {"messages": [{"role": "user", "content": "hi", "tool_calls": [_TOOL_CALL]}]}, "messages.0.tool_calls"),
    (_CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {**_TOOL_CALL, "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    (_CHAT, {"messages": [{"role": "tool", "content": "1"}]}, "messages.0.tool_call_id"),
    (_CHAT, {"messages": [{"role": "user", "content": "1", "tool_call_id": "call_1"}]}, "messages.0.tool_call_id"),
    # Structured outputs (structured_outputs.py; tests/mesh/test_structured_mesh.py has the rest).
    (_CHAT, {"response_format": {"type": "yaml"}}, "response_format.type"),
    (_CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    (_CHAT, {"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}},
     "response_format.json_schema"),
    (_CHAT, {"top_logprobs": 2}, "top_logprobs"),
    (_CHAT, {"logprobs": True, "top_logprobs": 2**80}, "top_logprobs"),
    (_COMPLETION, {"logit_bias": {"five": 10}}, "logit_bias"),
    (_COMPLETION, {"n": 0}, "n"),
    (_COMPLETION, {"best_of": 2, "n": 3}, "best_of"),
    (_COMPLETION, {"echo": 1}, "echo"),
    (_COMPLETION, {"suffix": "}"}, "suffix"),
    # Labels are accepted (tests/unit/test_client_fields.py); their wrong values are not.
    (_COMPLETION, {"metadata": {"a": 1}}, "metadata.a"),
    (_COMPLETION, {"store": True}, "store"),
    (_COMPLETION, {"user": 1}, "user"),
    (_CHAT, {"service_tier": "priority"}, "service_tier"),
    # A value of another type where a bool, an int or a string belongs: no coercion.
    (_CHAT, {"add_generation_prompt": 0}, "add_generation_prompt"),
    (_COMPLETION, {"stream": 1}, "stream"),
    (_COMPLETION, {"ignore_eos": "true"}, "ignore_eos"),
    (_COMPLETION, {"max_tokens": "2"}, "max_tokens"),
    (_COMPLETION, {"seed": 1.5}, "seed"),
    (_COMPLETION, {"prompt": 5}, "prompt"),
]


@pytest.mark.parametrize(("request_body", "change", "param"), BAD_INPUTS, ids=[p for _, _, p in BAD_INPUTS])
def test_bad_input_gets_400_naming_the_field(
    mesh: Mesh, request_body: dict[str, Any], change: dict[str, Any], param: str
) -> None:
    path = "/v1/chat/completions" if "messages" in request_body else "/v1/completions"
    # json.dumps, not httpx's encoder: it writes NaN, Infinity and lone surrogates (as \ud800) as clients can.
    response = post(mesh.main, path, json.dumps({**request_body, **change}).encode())
    error = assert_error(response, 400)
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(f"{param}: ") or error["message"].startswith(f"{param} "), error
    assert "Traceback" not in response.text and "127.0.0.1" not in response.text
    ok = post(mesh.main, path, request_body)  # the server still serves
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_bad_input_at_the_limits(mesh: Mesh) -> None:
    # A 1 MB cache salt under the deployed body limit (4 MiB): refused by name, not a 5xx from NATS.
    salted = post(mesh.narrow, "/v1/completions", json.dumps({**_COMPLETION, "cache_salt": "s" * (1 << 20)}).encode())
    error = assert_error(salted, 400, f"at most {MAX_CACHE_SALT_CHARS}")
    assert error["param"] == "cache_salt"
    # Past the model's vocabulary: the engine refuses it (streamed or not).
    vocab = json.loads((Path(mesh.path) / "config.json").read_text())["vocab_size"]
    for stream in (False, True):
        past_vocab = {**_COMPLETION, "prompt": [5, vocab], "stream": stream}
        error = assert_error(post(mesh.main, "/v1/completions", past_vocab), 400)
        assert f"prompt token ids must be in [0, {vocab})" in error["message"]
    # The largest values that fit are served: top_k past the vocabulary keeps every token.
    edge = {**_COMPLETION, "seed": 2**63 - 1, "top_k": 2**32 - 1, "stop_token_ids": [2**32 - 1], "temperature": 1.0}
    assert post(mesh.main, "/v1/completions", edge).json()["usage"]["completion_tokens"] == 2
    assert_error(post(mesh.main, "/v1/completions", {**edge, "seed": 2**63}), 400, "seed must be in [0, 2**63)")
    # Not JSON, or not an object: 400s too.
    assert_error(post(mesh.main, "/v1/completions", b'{"model": "tiny-llama", "prompt": "x",}'), 400, "not valid JSON")
    assert_error(post(mesh.main, "/v1/completions", b"[1, 2]"), 400)
    assert_error(post(mesh.main, "/v1/completions", b'{"model": "tiny-llama", "prompt": "\xff\xfe"}'), 400)


def test_the_context_is_the_models_not_one_nats_message(model_path: str) -> None:
    # Past the 2**17 tokens one NATS message held (the bus sends long messages in parts):
    # the model's context is served whole, and a prompt that fills it is a 400 naming it.
    context = 1 << 18
    app = create_app(generator=Failing(), recipe=Recipe.from_pretrained(model_path), model_name=MODEL,
                     max_model_len=context, settings=BalancerSettings())
    with TestClient(app) as client:
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == context
        too_long = client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * context})
        error = assert_error(too_long, 400, f"maximum context length is {context} tokens")
        assert error["param"] == "prompt"


def test_auth_model_route_and_size_errors(mesh: Mesh) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert_error(post(mesh.main, "/v1/completions", body, headers={}), 401)
    assert_error(post(mesh.main, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=mesh.main.url + "/v1", api_key="wrong", max_retries=0).models.list()
    error = assert_error(post(mesh.main, "/v1/completions", {**body, "model": "gpt-4"}), 404, "gpt-4")
    assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        mesh.client().chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert_error(post(mesh.main, "/v1/nothing", body), 404)
    assert_error(post(mesh.main, "/v1/completions", {**body, "prompt": "x" * MAX_BODY}), 413)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the guard counts the bytes
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    response = httpx.post(mesh.main.url + "/v1/completions", content=chunked(), headers=AUTH)
    assert_error(response, 413)


def pause_engine(mesh: Mesh) -> threading.Event:
    """Holds the engine's step loop (a call on its thread) until the returned event
    is set: meanwhile no request makes a token, so none can reach its end."""
    paused, release = threading.Event(), threading.Event()

    def hold(_: Any) -> None:
        paused.set()
        release.wait(30)

    asyncio.run_coroutine_threadsafe(mesh.generator.engine.call(hold), mesh.loop)
    assert paused.wait(10), "the engine did not pause"
    return release


def test_too_many_in_flight_and_disconnect_cancels(mesh: Mesh) -> None:
    total = mesh.wait_idle().num_total_kv_blocks
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    num_ended = len(mesh.recorder.ended)
    release = None
    try:
        with httpx.Client(timeout=30) as held:
            with held.stream("POST", mesh.narrow.url + "/v1/completions", json=body, headers=AUTH) as stream:
                assert stream.status_code == 200
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                # From here the engine makes no token: the request can end only by the
                # server noticing that the client left (it once ran to its end first).
                release = pause_engine(mesh)
                held_blocks = mesh.generator.engine.last_load.num_free_kv_blocks < total  # as the pause found it
                assert mesh.generator.num_in_flight() == 1 and held_blocks
                refused = post(mesh.narrow, "/v1/completions", {**body, "stream": False, "max_tokens": 1})
                assert_error(refused, 429)
                assert refused.json()["error"]["type"] == "rate_limit_error"
            # Leaving the stream unread closes the connection: the server must cancel the request.
        deadline = time.monotonic() + 10
        while len(mesh.recorder.ended) == num_ended:
            assert time.monotonic() < deadline, "the server did not notice that the client left"
            time.sleep(0.02)
        assert list(mesh.recorder.ended.values())[-1] is None  # cancelled, not run to its end
    finally:
        if release is not None:
            release.set()
    load = mesh.wait_idle()
    assert mesh.generator.num_in_flight() == 0 and load.num_free_kv_blocks == total
    after = mesh.client(mesh.narrow).completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert after.usage.completion_tokens == 1  # the place was given back
    # A non-streaming client that gives up cancels its request too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(mesh.narrow.url + "/v1/completions", json={**body, "stream": False}, headers=AUTH, timeout=0.3)
    load = mesh.wait_idle()
    assert load.num_free_kv_blocks == total and list(mesh.recorder.ended.values())[-1] is None


def test_generator_failures_keep_the_openai_shape(mesh: Mesh) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
    mesh.failure.error, mesh.failure.after = GenerationError("no decode instance is alive", 503), 0
    assert_error(post(mesh.failing, "/v1/completions", body), 503, "no decode instance")
    assert_error(post(mesh.failing, "/v1/completions", {**body, "stream": True}), 503, "no decode instance")
    mesh.failure.after = 2  # after the headers: an error event, then [DONE]
    with httpx.stream("POST", mesh.failing.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == "no decode instance is alive"
    mesh.failure.error, mesh.failure.after = RuntimeError("secret internals"), 0
    crashed = post(mesh.failing, "/v1/completions", body)
    assert_error(crashed, 500)
    assert "secret" not in crashed.text and "Traceback" not in crashed.text


def test_metrics(mesh: Mesh) -> None:
    mesh.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    post(mesh.main, "/v1/completions", {"model": MODEL, "prompt": "x"}, headers={})
    post(mesh.main, "/v1/elsewhere", {})
    text = httpx.get(mesh.main.url + "/metrics").text
    for endpoint, status in (("/v1/completions", 200), ("/v1/completions", 401), ("other", 404)):
        assert f'infermesh_balancer_requests_total{{endpoint="{endpoint}",status="{status}"}}' in text
    names = ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
             "e2e_request_latency_seconds_count", "prompt_tokens_total", "completion_tokens_total",
             "cached_tokens_total")
    for name in names:
        assert f"infermesh_balancer_{name}" in text, name
    assert "infermesh_balancer_requests_in_flight 0.0" in text
    assert httpx.get(mesh.narrow.url + "/metrics").status_code == 404  # no registry given


def test_request_span_is_the_parent_of_the_generators(mesh: Mesh) -> None:
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    headers = {**AUTH, "traceparent": f"00-{trace_id}-{parent_id}-01"}
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": stream}
        with httpx.stream("POST", mesh.main.url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            r.read()
    deadline = time.monotonic() + 5
    while len(mine := [s for s in mesh.spans.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id]) < 4:
        assert time.monotonic() < deadline, mine
        time.sleep(0.05)
    servers = [s for s in mine if s.name == "POST /v1/completions"]
    assert len(servers) == 2 and all(f"{s.parent.span_id:016x}" == parent_id for s in servers)
    generates = [s for s in mine if s.name == "generate"]
    assert {s.parent.span_id for s in generates} == {s.context.span_id for s in servers}
    assert all(s.attributes["output.tokens"] == 3 for s in servers)
