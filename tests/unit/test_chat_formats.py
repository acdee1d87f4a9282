"""The chat formats of GPT-OSS, Qwen3 and DeepSeek-V4 as released, in make_model's seeded
checkpoints (tools/chat_formats.py) and rendered by the Recipe.

GPT-OSS ships a Jinja template (openai/gpt-oss's chat_template.jinja), Qwen3 one in
tokenizer_config.json (thinking on, off with enable_thinking, past reasoning dropped,
tools): the Recipe's render must equal transformers' apply_chat_template on the same
folder, tools and tool turns included. DeepSeek-V4 ships its format as Python (encoding/encoding_dsv4.py,
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
from services.balancer.frontend.reasoning_parsers import choose_reasoning_parser
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


# -- Qwen3 --------------------------------------------------------------------------------------

QWEN3_CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    "past-reasoning": [  # reasoning before the last question is dropped; content with inline tags is cut
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\nFour."},
        {"role": "user", "content": "And 3+3?"}],
    "answer-after-the-question": [  # after the last question it is kept, in <think>
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "Four.", "reasoning_content": "\nAdd them.\n"}],
    "tools": HISTORY,
    "tool-round-with-reasoning": [
        {"role": "user", "content": "Weather in Bern?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Read it."}],
}  # fmt: skip


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3")
    make_model(path, arch="qwen3")
    return path


def test_qwen3_folder_carries_the_released_format(qwen3: Path) -> None:
    config = json.loads((qwen3 / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == (TEMPLATES / "qwen3_chat_template.jinja").read_text(encoding="utf-8")
    assert not (qwen3 / "chat_template.jinja").exists()  # Qwen3 ships it in tokenizer_config.json
    recipe = Recipe.from_pretrained(qwen3)
    for token in FORMATS["qwen3"].text_tokens:  # one token each, decoded as text even by a plain decode
        [token_id] = recipe.encode(token, add_special_tokens=False)
        assert token_id not in recipe.all_special_ids and recipe.decode([token_id]) == token
    stops = {recipe.encode(t, add_special_tokens=False)[0] for t in ("<|im_end|>", "<|endoftext|>")}
    assert recipe.eos_token_ids == stops
    assert recipe.encode("hi") == recipe.encode("hi", add_special_tokens=False), "Qwen3 adds no bos"
    # The reasoning format is read off the template: Qwen3's <think>.
    assert choose_reasoning_parser("auto", recipe.chat_template_source()) == "qwen3"
    assert choose_reasoning_parser("auto", recipe.chat_template_source(with_tools=True)) == "qwen3"


@pytest.mark.parametrize("thinking", [None, True, False], ids=["default", "thinking", "no-thinking"])
@pytest.mark.parametrize("name", list(QWEN3_CONVERSATIONS))
def test_qwen3_renders_as_transformers_does(qwen3: Path, name: str, thinking: bool | None) -> None:
    transformers = pytest.importorskip("transformers")
    messages = QWEN3_CONVERSATIONS[name]
    tools = TOOLS if name.startswith("tool") else None
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    last_is_user = messages[-1]["role"] in ("user", "tool")
    recipe = Recipe.from_pretrained(qwen3)
    ours = recipe.apply_chat_template(messages, tools=tools, add_generation_prompt=last_is_user, **kwargs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen3)
    reference = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=last_is_user,
                                              tokenize=False, **kwargs)  # fmt: skip
    assert ours == reference
    assert recipe.encode(ours, add_special_tokens=False) == tokenizer(reference, add_special_tokens=False)["input_ids"]
    if last_is_user:  # the switch: an empty closed block opens the reply when thinking is off
        assert ours.endswith("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if thinking is False else ""))
    if name == "past-reasoning":
        assert "Greet back." not in ours and "Add." not in ours and "<|im_start|>assistant\nFour.<|im_end|>" in ours
    if name == "answer-after-the-question":
        assert ours.endswith("<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\nFour.<|im_end|>\n")
    if tools is not None:
        assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in ours
    if name == "tools":
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>' in ours
        assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response>\n<tool_response>" in ours
    if name == "tool-round-with-reasoning":  # the call came after the question: its reasoning is kept
        assert ('<|im_start|>assistant\n<think>\nCall the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                '"arguments": {"city": "Bern"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n'
                "</tool_response><|im_end|>\n") in ours  # fmt: skip


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
