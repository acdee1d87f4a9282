"""Reasoning and served names through the whole mesh (nats-server, kvcache,
prefill, decode and balancer processes) on make-model's seeded DeepSeek-V4 folder,
served as `infermesh up --served-model-name v4-main v4-alias` serves it.

With the thinking switch on, the prompt opens a <think> block, and the model's
real reply (its token ids returned beside it) comes back split exactly as
reasoning_parsers splits that text, whole and streamed alike (exact splits of
chosen replies are tests/unit/test_reasoning_api.py's), and usage counts its
reasoning tokens: those before the </think> token (V4's is one token), whole and in
the stream's usage chunk. Either name, or none,
reaches the model; responses and /v1/models put the first name first."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from services.balancer.frontend.reasoning_parsers import split_reasoning
from shared.recipe import Recipe
from tools.launch.up import served_names_env
from tools.make_model import make_model

NAMES = ["v4-main", "v4-alias"]
ENV = {"INFERMESH_ENGINE__BLOCK_SIZE": "16", **served_names_env(NAMES)}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, Recipe]]:
    from tests.helpers.mesh import running_mesh

    model = str(tmp_path_factory.mktemp("v4-reasoning-model"))
    make_model(model, arch="deepseek_v4", seed=0)
    state: Path = tmp_path_factory.mktemp("v4-reasoning-mesh")
    with running_mesh(model, state, extra_env=ENV) as running:
        yield openai.OpenAI(base_url=running.api_url, api_key="x", max_retries=0, timeout=300), Recipe.from_pretrained(model)


def test_deepseek_v4_reasoning_through_the_mesh(mesh: tuple[openai.OpenAI, Recipe]) -> None:
    client, recipe = mesh
    body: dict[str, Any] = dict(
        model=NAMES[1], messages=[{"role": "user", "content": "What is two and two?"}], temperature=0, max_tokens=24,
        extra_body={"chat_template_kwargs": {"thinking": True}, "return_token_ids": True},
    )
    whole = client.chat.completions.create(**body)
    reasoning, content = "", ""
    usage: Any = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    choice = whole.choices[0]
    text = recipe.decode(choice.model_extra["token_ids"], skip_special_tokens=True)  # type: ignore[index]
    expected = split_reasoning(text, "deepseek_v4", "<｜Assistant｜><think>")
    assert (choice.message.reasoning_content, choice.message.content) == expected  # type: ignore[attr-defined]
    assert expected[0]  # the reply started inside the block the prompt opened
    assert (reasoning, content) == (expected[0], expected[1])
    ids: list[int] = choice.model_extra["token_ids"]  # type: ignore[index]
    [end] = recipe.encode("</think>", add_special_tokens=False)
    inside = ids[: ids.index(end)] if end in ids else ids
    if inside and inside[-1] in recipe.eos_token_ids:
        inside = inside[:-1]  # an end of sequence inside the block has no text: not reasoning
    assert not set(inside) & set(recipe.all_special_ids), inside  # every token inside has text
    assert whole.usage.completion_tokens == len(ids) and usage.completion_tokens == len(ids)
    assert whole.usage.completion_tokens_details.reasoning_tokens == len(inside) > 0
    assert usage.completion_tokens_details.reasoning_tokens == len(inside)


def test_served_names_through_the_mesh(mesh: tuple[openai.OpenAI, Recipe]) -> None:
    client, _ = mesh
    assert [m.id for m in client.models.list().data] == NAMES
    for name in NAMES:
        assert client.completions.create(model=name, prompt="hi", max_tokens=2).model == NAMES[0]
    response = client.with_options(max_retries=0).post(
        "/completions", body={"prompt": "hi", "max_tokens": 2}, cast_to=dict
    )
    assert response["model"] == NAMES[0]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=2)
