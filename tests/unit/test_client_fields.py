"""The fields clients send by default, through the balancer's HTTP API (the real app,
tests/helpers/tool_api.py's scripted generator): the official openai client's and
LangChain's ChatOpenAI's bodies, as those clients build them, answered with a 200;
the labelling fields (user, metadata, safety_identifier, service_tier auto/default,
store false) accepted and recorded on the request's span; store true, other tiers,
oversized metadata and unknown fields refused with a 400 naming the field."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.balancer.frontend.api import create_app
from shared.recipe import Recipe
from shared.runtime.settings import BalancerSettings
from tests.helpers.tool_api import Scripted
from tools.make_model import make_model

MODEL = "tiny-fields"
MESSAGES = [{"role": "user", "content": "hi"}]


class Front:
    def __init__(self, folder: Path) -> None:
        self.spans = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.generator = Scripted(Recipe.from_pretrained(folder))
        self.generator.reply = "Hello there."
        app = create_app(generator=self.generator, recipe=self.generator.recipe, model_name=MODEL,
                         max_model_len=512, settings=BalancerSettings(), tracer=provider.get_tracer("test"))
        self.http = TestClient(app, base_url="http://balancer")
        self.bodies: list[dict[str, Any]] = []
        """Every body a client sent, as it sent it."""
        self.http.event_hooks["request"].append(self._record)
        self.client = openai.OpenAI(base_url="http://balancer/v1", api_key="x", http_client=self.http, max_retries=0)

    def _record(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(request.read() or b"{}"))

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(path, json=body)


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    folder = tmp_path_factory.mktemp("fields-model")
    make_model(folder)
    served = Front(folder)
    with served.http:
        yield served


def test_openai_clients_default_bodies(front: Front) -> None:
    front.bodies.clear()
    reply = front.client.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert reply.choices[0].message.content == "Hello there."
    chunks = list(front.client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there."
    text = front.client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert text.choices[0].text == "Hello there."
    # What the openai client put in the bodies by default (it sends only what it is given).
    assert front.bodies == [
        {"model": MODEL, "messages": MESSAGES},
        {"model": MODEL, "messages": MESSAGES, "stream": True},
        {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    ]


def test_langchain_chat_openai_default_bodies(front: Front) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    front.bodies.clear()
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url="http://balancer/v1", api_key="x",
                                      http_client=front.http, max_retries=0, stream_usage=True)
    assert llm.invoke("hi").content == "Hello there."
    pieces = list(llm.stream("hi"))
    assert "".join(str(p.content) for p in pieces) == "Hello there."
    assert any(p.usage_metadata for p in pieces)  # the stream_options' usage chunk came
    # ChatOpenAI's defaults: stream false on invoke; stream with stream_options when streaming.
    assert front.bodies == [
        {"model": MODEL, "stream": False, "messages": [{"content": "hi", "role": "user"}]},
        {"model": MODEL, "stream": True, "messages": [{"content": "hi", "role": "user"}],
         "stream_options": {"include_usage": True}},
    ]


def test_every_labelling_field_is_accepted_and_recorded_on_the_span(front: Front) -> None:
    front.spans.clear()
    metadata = {f"k{i}": f"v{i}" for i in range(16)}
    reply = front.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, user="u-1", metadata=metadata, service_tier="auto", store=False,  # type: ignore[arg-type]
        safety_identifier="hash-9", parallel_tool_calls=True, stream=True, stream_options={"include_usage": True},
        n=1, temperature=0.7, top_p=1.0, seed=3, max_completion_tokens=8,
    )
    chunks = list(reply)
    assert chunks[-1].usage is not None
    (span,) = [s for s in front.spans.get_finished_spans() if s.name == "POST /v1/chat/completions"]
    attrs = dict(span.attributes or {})
    assert attrs["request.user"] == "u-1" and attrs["request.safety_identifier"] == "hash-9"
    assert attrs["request.service_tier"] == "auto"
    assert {k: attrs[f"request.metadata.{k}"] for k in metadata} == metadata
    front.spans.clear()
    completion = front.client.completions.create(model=MODEL, prompt="hi", user="u-2", max_tokens=2)
    assert completion.choices[0].text
    (span,) = [s for s in front.spans.get_finished_spans() if s.name == "POST /v1/completions"]
    assert dict(span.attributes or {})["request.user"] == "u-2"
    assert front.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "service_tier": "default"}).status_code == 200


@pytest.mark.parametrize(("change", "param", "words"), [
    ({"store": True}, "store", "/v1/responses"),
    ({"service_tier": "flex"}, "service_tier", "no service tiers"),
    ({"service_tier": "priority"}, "service_tier", "no service tiers"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16"),
    ({"metadata": {"k": 1}}, "metadata.k", "string"),
    ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 65, "at most 64"),
    ({"user": 7}, "user", "string"),
    ({"verbosity": "low"}, "verbosity", "not supported"),
    ({"web_search_options": {}}, "web_search_options", "not supported"),
    ({"functions": []}, "functions", "not supported"),
])
def test_fields_that_would_change_the_answer_are_400s_naming_them(
    front: Front, change: dict[str, Any], param: str, words: str
) -> None:
    response = front.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
