"""GPT-OSS's and DeepSeek-V4's chat formats through the whole mesh (nats-server,
kvcache, prefill, decode and balancer processes) on make-model's seeded folders,
which carry each family's released format (tools/chat_formats.py).

A random model writes no tool calls, so this checks what the mesh is given and how
its real output is read: the prompt with the tools, a call and its result rendered
as the family ships it (counted by usage against transformers' render of GPT-OSS's
template, and against DeepSeek's format for V4), and the reply of tool_choice auto
read by the family's parser (harmony keeps the special tokens it reads) the same
whole and streamed, a 200 either way. Exact calls and broken replies are
tests/unit/test_tool_api_formats.py's, with scripted replies."""

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from shared.recipe import Recipe
from tools.make_model import make_model

ENV = {"INFERMESH_ENGINE__BLOCK_SIZE": "16"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Bern?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]  # fmt: skip


def _expected_prompt(model: str, arch: str) -> list[int]:
    messages = json.loads(json.dumps(HISTORY))
    messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Bern"}
    if arch == "gpt_oss":  # the shipped Jinja template, as transformers renders it
        transformers = pytest.importorskip("transformers")
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return Recipe.from_pretrained(model).encode_chat(messages, tools=TOOLS)  # V4: DeepSeek's format (unit goldens)


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v4"])
def test_tools_auto_through_the_mesh(arch: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.helpers.mesh import running_mesh

    model = str(tmp_path_factory.mktemp(f"{arch}-model"))
    make_model(model, arch=arch, seed=0)
    state: Path = tmp_path_factory.mktemp(f"{arch}-mesh")
    with running_mesh(model, state, extra_env=ENV) as mesh:
        client = openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=300)
        name = client.models.list().data[0].id
        body: dict[str, Any] = dict(model=name, messages=HISTORY, tools=TOOLS, temperature=0, max_tokens=24)
        whole = client.chat.completions.create(**body)
        assert whole.usage.prompt_tokens == len(_expected_prompt(model, arch))
        # The stream gathered by hand: the client's own accumulator refuses a "length" finish.
        calls: dict[int, tuple[str, str]] = {}
        content, finish = "", None
        for chunk in client.chat.completions.create(stream=True, **body):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for piece in choice.delta.tool_calls or []:
                    name, arguments = calls.get(piece.index, ("", ""))
                    calls[piece.index] = (name + (piece.function.name or ""), arguments + (piece.function.arguments or ""))
                finish = choice.finish_reason or finish
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason in ("stop", "length", "tool_calls") and finish == whole.choices[0].finish_reason
    assert (message.content or "") == content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == [calls[i] for i in sorted(calls)]
