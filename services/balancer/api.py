"""The balancer's OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions,
/v1/models, /health and /metrics.

A request passes the guard (API key, body size, request metrics), is parsed into
a protocol model, checked (model name, admission, context length), tokenized and
handed to the Generator as a GenerationRequest. Its token events go through one
IncrementalDetokenizer per request (text, stop strings) and out as one JSON body
or as SSE chunks.

Each request's generation runs in a task of its own (a _Pump) that feeds a queue
the response reads. So the generator is iterated in one task and one context (the
request's span is current there, and the generator's spans nest under it), and
cancelling that one task cancels the request, whether a stop string matched or
the client went away. The first output is awaited before the response starts, so
a request the generator refuses gets its real status, not a 200 and an error event.

The parts, one file each: errors.py (the OpenAI error body and the exception
handlers), guard.py (API key, body size, requests counter), http_metrics.py (the
HTTP layer's Prometheus series) and serving.py (one request's flow: _Pump,
OpenAIServer, the SSE body); this file puts them together in create_app.
"""

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from opentelemetry import trace
from opentelemetry.trace import Tracer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.balancer import protocol as p
from services.balancer.errors import APIError, add_error_handlers
from services.balancer.generation import Generator
from services.balancer.guard import Guard
from services.balancer.http_metrics import HttpMetrics
from services.balancer.serving import OpenAIServer, json_response
from shared.recipe import Recipe
from shared.runtime.metrics import Metrics
from shared.runtime.settings import BalancerSettings

MAX_CONTEXT_TOKENS = 1 << 17
"""The longest context served. A prompt (with the tokens so far, when a request
migrates) crosses NATS whole, balancer to prefill and prefill to decode, and a
NATS message holds at most 1 MiB (nats-server's max_payload). The handoff to
decode is the larger: per token at most 5 bytes of id (a uint32 varint), per
block of 16 tokens (the default) a 34-byte hash and a block id per KV group. At
2**17 tokens, with every other field at its limit, that is ~1,000 KiB
(tests/test_bad_input.py builds it); real vocabularies (ids under 2**21: 3 bytes)
leave a quarter of the message free."""


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
) -> FastAPI:
    """The OpenAI-compatible app over generator. metrics' registry gets the
    balancer's series (create one app per Metrics) and is served on /metrics;
    without it the series are kept privately and /metrics answers 404. tracer
    makes one SERVER span per generation request, parent of the generator's spans."""
    max_model_len = min(max_model_len, MAX_CONTEXT_TOKENS)  # a 400 that names the limit, not a 5xx from NATS
    stats = HttpMetrics(metrics or Metrics("balancer"), model_name, max_model_len)
    server = OpenAIServer(generator, recipe, model_name, max_model_len, settings, stats, tracer or trace.NoOpTracer())
    # FastAPI's own telemetry would add a second root span per request from the global
    # tracer provider; ours is explicit (the tracer given) and parents the generator's spans.
    telemetry: Any = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="InferMesh balancer", docs_url=None, redoc_url=None, openapi_url=None, telemetry=telemetry)
    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_request_bytes, stats=stats)
    add_error_handlers(app)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response(p.ModelList(data=[p.ModelCard(id=model_name, max_model_len=max_model_len)]))

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, http: Request) -> Response:
        return await server.completions(body, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, http: Request) -> Response:
        return await server.chat(body, http)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def serve_metrics() -> Response:
        if metrics is None:
            raise APIError(404, "This server keeps no metrics registry.", code="not_found")
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
