"""The balancer's HTTP API in process with a scripted generator, for the tool-calling
and reasoning tests (test_tool_api.py, test_tool_api_formats.py, test_reasoning_api.py,
test_responses_api.py): no model writes tool calls or thinking by itself, so the reply
is chosen and the prompt it saw is recorded."""

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
from fastapi.testclient import TestClient
from openai.lib.streaming.chat import ChatCompletionStreamState

from services.balancer.frontend.api import create_app
from services.balancer.generation import GenerationRequest, TokenEvent, Usage
from shared.recipe import Recipe
from shared.runtime.settings import BalancerSettings
from tools.make_model import make_model

MODEL = "tiny-tools"


class Scripted:
    """A generator that replies with `reply`'s tokens, one event each, and records
    every request it gets."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.reply = ""
        self.requests: list[GenerationRequest] = []

    def num_in_flight(self) -> int:
        return 0

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(request)
        ids = self.recipe.encode(self.reply, add_special_tokens=False)
        num_prompt = len(request.prompt_token_ids)
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            yield TokenEvent([token], finish_reason="stop" if last else None, usage=Usage(num_prompt, i + 1, 0))


class Served:
    def __init__(self, folder: Path, settings: BalancerSettings | None = None) -> None:
        self.folder = folder
        self.recipe = Recipe.from_pretrained(folder)
        self.generator = Scripted(self.recipe)
        app = create_app(
            generator=self.generator, recipe=self.recipe, model_name=MODEL, max_model_len=1024,
            settings=settings or BalancerSettings(), metrics=None,
        )  # fmt: skip
        self.http = TestClient(app, base_url="http://balancer")
        self.client = openai.OpenAI(base_url="http://balancer/v1", api_key="none", http_client=self.http, max_retries=0)

    def prompt_text(self) -> str:
        return self.recipe.decode(self.generator.requests[-1].prompt_token_ids, skip_special_tokens=False)


def served_model(folder: Path, arch: str | None, **settings: Any) -> Iterator[Served]:
    """A fixture's body: make_model's seeded model of arch (None: the project's ChatML
    one) in folder, served with settings for as long as the fixture lives."""
    make_model(folder, **({"arch": arch} if arch else {}))
    served = Served(folder, BalancerSettings(**settings))
    with served.http:
        yield served


def chat(served: Served, reply: str, **body: Any) -> Any:
    served.generator.reply = reply
    body.setdefault("messages", [{"role": "user", "content": "Weather in Zürich, and the time?"}])
    return served.client.chat.completions.create(model=MODEL, **body)


def chat_streamed(served: Served, reply: str, **body: Any) -> Any:
    """The stream gathered by the openai client's own accumulator."""
    state = ChatCompletionStreamState()
    for chunk in chat(served, reply, stream=True, **body):
        state.handle_chunk(chunk)
    return state.get_final_completion()


def calls_of(message: Any) -> list[tuple[str, str, str]]:
    return [(c.type, c.function.name, c.function.arguments) for c in message.tool_calls or []]
