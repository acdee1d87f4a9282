"""The chat formats of GPT-OSS and DeepSeek-V4 as released, in make_model's seeded
checkpoints (tools/chat_formats.py) and rendered by the Recipe.

GPT-OSS ships a Jinja template (openai/gpt-oss's chat_template.jinja): the Recipe's
render must equal transformers' apply_chat_template on the same folder, tools and
tool turns included. DeepSeek-V4 ships its format as Python (encoding/encoding_dsv4.py,
no template): the goldens below are that encoder's output (DeepSeek-V4's
encoding_dsv4.encode_messages, run once outside this repository on these messages,
tools on the system message, thinking_mode "chat" and "thinking"); the Recipe renders
V4 folders with shared/recipe/deepseek_v4_chat.py, written from that format."""

import json
from pathlib import Path
from typing import Any

import pytest

from shared.recipe import Recipe
from shared.recipe.chat_template import ChatTemplate
from shared.recipe.deepseek_v4_chat import DeepseekV4Chat
from tools.chat_formats import FORMATS, TEMPLATES
from tools.make_model import make_model

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]  # fmt: skip
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Zürich, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]  # fmt: skip


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpt-oss")
    make_model(path, arch="gpt_oss")
    return path


@pytest.fixture(scope="module")
def deepseek_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("deepseek-v4")
    make_model(path, arch="deepseek_v4")
    return path


# -- GPT-OSS ------------------------------------------------------------------------------------


def test_gpt_oss_folder_carries_the_released_format(gpt_oss: Path) -> None:
    assert (gpt_oss / "chat_template.jinja").read_bytes() == (TEMPLATES / "gpt_oss_chat_template.jinja").read_bytes()
    recipe = Recipe.from_pretrained(gpt_oss)
    for token in FORMATS["gpt_oss"].special_tokens:  # one special token each, dropped by a plain decode
        [token_id] = recipe.encode(token, add_special_tokens=False)
        assert token_id in recipe.all_special_ids and recipe.decode([token_id]) == ""
    stops = {recipe.encode(t, add_special_tokens=False)[0] for t in ("<|return|>", "<|call|>", "<|endoftext|>")}
    assert recipe.eos_token_ids == stops
    assert recipe.encode("hi") == recipe.encode("hi", add_special_tokens=False), "gpt-oss adds no bos"


@pytest.mark.parametrize("turns", [2, 3, 5], ids=["question", "with-call", "with-results"])
def test_gpt_oss_renders_as_transformers_does(gpt_oss: Path, turns: int) -> None:
    transformers = pytest.importorskip("transformers")
    messages = HISTORY[:turns]
    recipe = Recipe.from_pretrained(gpt_oss)
    ours = recipe.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gpt_oss)
    reference = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert ours == reference
    assert recipe.encode(ours, add_special_tokens=False) == tokenizer(reference, add_special_tokens=False)["input_ids"]
    assert ours.endswith("<|start|>assistant") and "type get_weather = (_: {\ncity: string,\ndays?: number,\n}) => any;" in ours
    if turns >= 3:  # harmony's call (the template renders an assistant message's first call)
        assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                '{"city": "Zürich", "days": 2}<|call|>') in ours  # fmt: skip
    if turns == 5:  # results are sent by the last call's function, as JSON strings
        assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"12:00"<|end|>' in ours


# -- DeepSeek-V4 --------------------------------------------------------------------------------

V4_TOOLS_GOLDEN = (
    '<｜begin▁of▁sentence｜>Use tools.\n'
    '\n'
    '## Tools\n'
    '\n'
    'You have access to a set of tools to help answer the user\'s question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n'
    '\n'
    '<｜DSML｜tool_calls>\n'
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    '...\n'
    '</｜DSML｜invoke>\n'
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    '...\n'
    '</｜DSML｜invoke>\n'
    '</｜DSML｜tool_calls>\n'
    '\n'
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n'
    '\n'
    'If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n'
    '\n'
    'Otherwise, output directly after </think> with tool calls or final response.\n'
    '\n'
    '### Available Tool Schemas\n'
    '\n'
    '{"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}\n'
    '{"name": "get_time", "description": "The time now"}\n'
    '\n'
    'You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n'
    '<｜User｜>Weather in Zürich, and the time?<｜Assistant｜></think>\n'
    '\n'
    '<｜DSML｜tool_calls>\n'
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Zürich</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    '</｜DSML｜invoke>\n'
    '<｜DSML｜invoke name="get_time">\n'
    '\n'
    '</｜DSML｜invoke>\n'
    '</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>{"temp": 21}</tool_result>\n'
    '\n'
    '<tool_result>12:00</tool_result><｜Assistant｜></think>'
)
V4_THINKING_GOLDEN = '<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜><think>'


def test_deepseek_v4_folder_carries_the_released_format(deepseek_v4: Path) -> None:
    assert not (deepseek_v4 / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((deepseek_v4 / "tokenizer_config.json").read_text(encoding="utf-8"))
    recipe = Recipe.from_pretrained(deepseek_v4)
    bos, eos = (recipe.encode(t, add_special_tokens=False) for t in ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"))
    assert [recipe.bos_token_id] == bos and recipe.eos_token_ids == frozenset(eos)
    assert recipe.encode("hi")[0] == recipe.bos_token_id
    for token in ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"):  # one token each, decoded as text
        [token_id] = recipe.encode(token, add_special_tokens=False)
        assert recipe.decode([token_id]) == token


def test_deepseek_v4_renders_as_deepseeks_encoder(deepseek_v4: Path) -> None:
    recipe = Recipe.from_pretrained(deepseek_v4)
    assert recipe.apply_chat_template(HISTORY, tools=TOOLS) == V4_TOOLS_GOLDEN
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
               {"role": "user", "content": "2+2?"}]  # fmt: skip
    assert recipe.apply_chat_template(history, thinking=True) == V4_THINKING_GOLDEN
    # Chat mode (the default) closes the thinking block; without a generation prompt nothing opens the reply.
    assert recipe.apply_chat_template(history).endswith("<｜User｜>2+2?<｜Assistant｜></think>")
    assert recipe.apply_chat_template(history, add_generation_prompt=False).endswith("<｜User｜>2+2?")


def test_deepseek_v4_refuses_what_it_does_not_render(deepseek_v4: Path) -> None:
    recipe = Recipe.from_pretrained(deepseek_v4)
    with pytest.raises(ValueError, match="reasoning_effort"):
        recipe.apply_chat_template(HISTORY[:2], reasoning_effort="max")
    with pytest.raises(ValueError, match="role 'ipython'"):
        recipe.apply_chat_template([{"role": "ipython", "content": "x"}])


def test_both_renderers_refuse_an_empty_conversation_alike() -> None:
    for renderer in (ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}"), DeepseekV4Chat()):
        with pytest.raises(ValueError, match="empty conversation: give at least one message"):
            renderer.render([], add_generation_prompt=True)
