"""The balancer's OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions,
/v1/responses (and GET/DELETE /v1/responses/{id}: responses_serving.py),
/v1/models (and /v1/models/{id}), /tokenize, /detokenize, /tokenizer_info,
/version, /ping, /health, /metrics, and the schema at /openapi.json and /docs,
shaped as vLLM's OpenAI server shapes them.

A request passes the guard (API key, body size, request metrics), is parsed into
a protocol model, checked (model name, admission, context length), tokenized and
handed to the Generator as a GenerationRequest. Its token events go through one
IncrementalDetokenizer per request (text, stop strings) and out as one JSON body
or as SSE chunks.

Each request's generation runs in a task of its own (a Pump) that feeds a queue
the response reads. So the generator is iterated in one task and one context (the
request's span is current there, and the generator's spans nest under it), and
cancelling that one task cancels the request, whether a stop string matched or
the client went away. The first output is awaited before the response starts, so
a request the generator refuses gets its real status, not a 200 and an error event.

The parts, one file each: protocol.py (the bodies, one name over the files that
define them), errors.py (the OpenAI error body and the exception handlers),
guard.py (API key, body size, requests counter), http_metrics.py (the HTTP layer's
Prometheus series), serving.py (one request's flow: check, admit, generate,
answer), jobs.py (a request as the mesh's jobs), pump.py (generation in a task of
its own), event_stream.py (the SSE body and disconnects), chat_template.py and
images.py (a chat request's images: refused for a text-only model, else loaded);
this file puts them together in create_app.
"""

import asyncio
import json
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from opentelemetry import trace
from opentelemetry.trace import Tracer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.balancer.frontend import protocol as p
from services.balancer.frontend.errors import APIError, add_error_handlers, check_model
from services.balancer.generation import Generator
from services.balancer.frontend.guard import Guard
from services.balancer.frontend.http_metrics import HttpMetrics
from services.balancer.frontend.images import ModelImages
from services.balancer.frontend.responses_bodies import ResponsesRequest
from services.balancer.frontend.responses_serving import ResponsesServer
from services.balancer.frontend.responses_store import MemoryResponseStore, ResponseStore
from services.balancer.frontend.serving import OpenAIServer, json_response
from shared.recipe import Recipe
from shared.runtime.metrics import Metrics
from shared.runtime.settings import BalancerSettings, ImageSettings

# -- the app ---------------------------------------------------------------------------


def create_app(
    *,
    generator: Generator,
    recipe: Recipe,
    model_name: str,
    max_model_len: int,
    settings: BalancerSettings,
    metrics: Metrics | None = None,
    tracer: Tracer | None = None,
    images: ImageSettings | None = None,
    model_images: ModelImages | None = None,
    response_store: ResponseStore | None = None,
    aliases: Sequence[str] = (),
) -> FastAPI:
    """The OpenAI-compatible app over generator. metrics' registry gets the
    balancer's series (create one app per Metrics) and is served on /metrics;
    without it the series are kept privately and /metrics answers 404. tracer
    makes one SERVER span per generation request, parent of the generator's spans.
    images: the limits on a chat request's images; model_images: whether the model
    takes images (default: it does not, and a request with one is a 400).
    response_store: where /v1/responses keeps stored responses (the mesh gives
    JetStream's, shared by its balancers; default: this process's memory, for one
    balancer alone). aliases: other names requests may ask for (vLLM's
    further --served-model-name names); responses carry model_name, the first."""
    stats = HttpMetrics(metrics or Metrics("balancer"), model_name, max_model_len)
    names = (model_name, *aliases)
    server = OpenAIServer(
        generator, recipe, names, max_model_len, settings, stats, tracer or trace.NoOpTracer(),
        images or ImageSettings(), model_images or ModelImages(),
    )
    # FastAPI's own telemetry would add a second root span per request from the global
    # tracer provider; ours is explicit (the tracer given) and parents the generator's spans.
    telemetry: Any = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(
        title="InferMesh balancer", version=_version(), docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
        telemetry=telemetry,
    )
    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_request_bytes, stats=stats)
    add_error_handlers(app)
    responses = ResponsesServer(server, response_store or MemoryResponseStore())
    # As vLLM lists them: a card per served name, the first first, each rooted at the model.
    cards = {name: p.ModelCard(id=name, root=model_name, max_model_len=max_model_len) for name in names}

    @app.get("/v1/models", response_model=p.ModelList)
    async def list_models() -> Response:
        return json_response(p.ModelList(data=list(cards.values())))

    @app.get("/v1/models/{model_id:path}", response_model=p.ModelCard, responses=_ERRORS)
    async def retrieve_model(model_id: str) -> Response:
        check_model(model_id, names)
        return json_response(cards[model_id])

    @app.post("/v1/completions", response_model=p.CompletionResponse, responses=_streamed(p.CompletionResponse))
    async def completions(body: p.CompletionRequest, http: Request) -> Response:
        return await server.completions(body, http)

    @app.post(
        "/v1/chat/completions", response_model=p.ChatCompletionResponse, responses=_streamed(p.ChatCompletionChunk)
    )
    async def chat_completions(body: p.ChatCompletionRequest, http: Request) -> Response:
        return await server.chat(body, http)

    @app.post("/v1/responses", responses=_streamed_events())
    async def create_response(body: ResponsesRequest, http: Request) -> Response:
        return await responses.create(body, http)

    @app.get("/v1/responses/{response_id}", responses=_ERRORS)
    async def retrieve_response(response_id: str) -> Response:
        return Response(json.dumps(await responses.retrieve(response_id)), media_type="application/json")

    @app.delete("/v1/responses/{response_id}", responses=_ERRORS)
    async def delete_response(response_id: str) -> Response:
        return Response(json.dumps(await responses.delete(response_id)), media_type="application/json")

    @app.post("/tokenize", response_model=p.TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: p.TokenizeCompletionRequest | p.TokenizeChatRequest) -> Response:
        check_model(body.model, names)
        if isinstance(body, p.TokenizeChatRequest):
            tokens = await server.tokenize_chat(body)
        else:
            tokens = await asyncio.to_thread(recipe.encode, body.prompt, body.add_special_tokens)
        strs = [server.token_text(t) for t in tokens] if body.return_token_strs else None
        return json_response(p.TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=tokens,
                                                token_strs=strs))

    @app.post("/detokenize", response_model=p.DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: p.DetokenizeRequest) -> Response:
        check_model(body.model, names)
        vocab = recipe.vocab_size
        past = [t for t in body.tokens if t >= vocab]
        if past:
            raise APIError(400, f"tokens: ids past the vocabulary ({vocab} tokens): {past[:5]}", param="tokens")
        return json_response(p.DetokenizeResponse(prompt=recipe.decode(body.tokens, skip_special_tokens=False)))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        return Response(json.dumps(_tokenizer_info(recipe, max_model_len)), media_type="application/json")

    @app.get("/version")
    async def version() -> Response:
        return Response(json.dumps({"version": _version()}), media_type="application/json")

    @app.get("/ping")
    async def ping() -> Response:
        return Response(status_code=200)

    @app.post("/ping")
    async def ping_post() -> Response:  # SageMaker's health check posts
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def serve_metrics() -> Response:
        if metrics is None:
            raise APIError(404, "This server keeps no metrics registry.", code="not_found")
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# -- what the endpoints share ----------------------------------------------------------

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": p.ErrorResponse}, 401: {"model": p.ErrorResponse}, 404: {"model": p.ErrorResponse},
}


def _streamed(chunk: type) -> dict[int | str, dict[str, Any]]:
    """The schema of a generation endpoint: JSON, or with stream: true server-sent
    events, each `data: <chunk>` and a last `data: [DONE]`."""
    return {
        200: {
            "description": "The whole response; with `stream: true`, server-sent events (`data: <chunk JSON>`, "
            f"each chunk a {chunk.__name__}, ending with `data: [DONE]`).",
            "content": {"text/event-stream": {"schema": {"$ref": f"#/components/schemas/{chunk.__name__}"}}},
        },
        **_ERRORS,
        429: {"model": p.ErrorResponse},
    }


def _streamed_events() -> dict[int | str, dict[str, Any]]:
    """/v1/responses: the response object as JSON, or with stream: true Responses'
    typed events (`event: <type>` and `data: <event JSON>`, no [DONE])."""
    return {
        200: {"description": "The response object; with `stream: true`, server-sent Responses events "
                             "(response.created ... response.completed)."},
        **_ERRORS,
        429: {"model": p.ErrorResponse},
    }


def _version() -> str:
    try:
        return metadata.version("infermesh")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _tokenizer_info(recipe: Recipe, max_model_len: int) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's class and configuration."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "vocab_size": recipe.vocab_size,
        "model_max_length": max_model_len,
        "bos_token_id": recipe.bos_token_id,
        "eos_token_ids": sorted(recipe.eos_token_ids),
        "pad_token_id": recipe.pad_token_id,
        **dict(recipe.special_tokens),
    }
