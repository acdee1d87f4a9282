"""The Recipe against transformers 5.24 (the reference), and streaming detokenization."""

import json
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from shared.recipe import ChatTemplateError, IncrementalDetokenizer, Recipe, train_tokenizer
from tests.helpers.chat_templates import QWEN25_TEMPLATE

transformers = pytest.importorskip("transformers")

EMOJI_TEXT = "🦙🚀 naïve café"
CJK_TEXT = "你好，世界"
MIXED_TEXT = "The llama 🦙 said: 你好，世界! Then the rocket 🚀 left. naïve café, end of story."

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": f"Say {EMOJI_TEXT} and {CJK_TEXT}"},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]}],
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — returns °C",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

TOOL_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"wind": 3}'},
    {"role": "assistant", "content": "21 °C, calm.", "reasoning_content": "Read the tool output."},
    {"role": "user", "content": "Thanks"},
]

# Everything else transformers' environment offers: namespace, dict(), loop controls,
# tojson options, strftime_now, raise_exception, the {% generation %} tag, kwargs.
KITCHEN_SINK_TEMPLATE = """{{ bos_token }}{% set ns = namespace(system=none, turns=0) %}
{%- if messages[0].role == 'system' %}{% set ns.system = messages[0].content %}{% endif %}
{%- set meta = dict(date=strftime_now('%Y-%m-%d'), thinking=enable_thinking | default(false)) %}
[meta]{{ meta | tojson(indent=2, sort_keys=true) }}
{% if tools %}[tools]{{ tools | tojson(separators=(',', ':')) }}
{% endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- if message.role not in ['user', 'assistant'] %}{{ raise_exception('bad role: ' + message.role) }}{% endif %}
    {%- if message.role == 'user' and loop.previtem is defined and loop.previtem.role == 'user' %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    <|im_start|>{{ message.role }} #{{ ns.turns }}{% if ns.system %} ({{ ns.system | length }}){% endif %}
{% if message.role == 'assistant' %}{% generation %}{{ message.content | trim }}{{ eos_token }}{% endgeneration %}
{% else %}{{ message.content | tojson }}<|im_end|>
{% endif %}
    {%- if message.content == 'STOP' %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if meta.thinking %}<think>{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("recipe_tokenizer")
    train_tokenizer(folder, 2048, max_corpus_bytes=1_000_000)
    return folder


@pytest.fixture(scope="module")
def recipe(tokenizer_dir: Path) -> Recipe:
    return Recipe.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def reference(tokenizer_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def _with_template(tokenizer_dir: Path, destination: Path, template: str) -> Path:
    shutil.copy(tokenizer_dir / "tokenizer.json", destination / "tokenizer.json")
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = template
    (destination / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return destination


# --- chat templates -----------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=lambda c: f"{len(c)}-messages")
def test_chat_template_matches_transformers(
    recipe: Recipe, reference: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    expected = reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert recipe.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected
    assert expected.startswith("<|begin_of_text|><|im_start|>")
    expected_ids = reference.apply_chat_template(
        conversation, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt
    )
    assert recipe.encode_chat(conversation, add_generation_prompt=add_generation_prompt) == expected_ids


def test_default_template_rejects_unknown_roles(recipe: Recipe) -> None:
    with pytest.raises(ChatTemplateError, match="Unsupported role tool"):
        recipe.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [True, False])
def test_qwen_template_with_tools_matches_transformers(
    tokenizer_dir: Path, tmp_path: Path, with_tools: bool, add_generation_prompt: bool
) -> None:
    folder = _with_template(tokenizer_dir, tmp_path, QWEN25_TEMPLATE)
    tools = TOOLS if with_tools else None
    expected = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        TOOL_CONVERSATION, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    rendered = Recipe.from_pretrained(folder).apply_chat_template(
        TOOL_CONVERSATION, tools=tools, add_generation_prompt=add_generation_prompt
    )
    assert rendered == expected
    assert '"arguments": {"city": "Zürich"}' in rendered  # tojson keeps non-ASCII


@pytest.mark.parametrize(
    "conversation, kwargs",
    [
        (CONVERSATIONS[2], {}),
        ([*TOOL_CONVERSATION[:2], {"role": "assistant", "content": " ok "}], {"enable_thinking": True}),
        ([{"role": "user", "content": "STOP"}, {"role": "assistant", "content": "never shown"}], {}),
    ],
)
def test_kitchen_sink_template_matches_transformers(
    tokenizer_dir: Path, tmp_path: Path, conversation: list[dict[str, Any]], kwargs: dict[str, Any]
) -> None:
    folder = _with_template(tokenizer_dir, tmp_path, KITCHEN_SINK_TEMPLATE)
    expected = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert Recipe.from_pretrained(folder).apply_chat_template(conversation, tools=TOOLS, **kwargs) == expected


def test_raise_exception_becomes_chat_template_error(tokenizer_dir: Path, tmp_path: Path) -> None:
    folder = _with_template(tokenizer_dir, tmp_path, KITCHEN_SINK_TEMPLATE)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="must alternate"):
        transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match="must alternate"):
        Recipe.from_pretrained(folder).apply_chat_template(bad)


def test_reads_chat_template_jinja_written_by_transformers(tokenizer_dir: Path, tmp_path: Path) -> None:
    saver = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    saver.chat_template = QWEN25_TEMPLATE
    saver.save_pretrained(tmp_path)
    # transformers 5.24 moves the template out of tokenizer_config.json into its own file.
    assert (tmp_path / "chat_template.jinja").read_text(encoding="utf-8") == QWEN25_TEMPLATE
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    rendered = Recipe.from_pretrained(tmp_path).apply_chat_template(TOOL_CONVERSATION, tools=TOOLS)
    assert rendered == transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        TOOL_CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )


def test_model_without_chat_template(tokenizer_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    recipe = Recipe.from_pretrained(tmp_path)
    assert not recipe.has_chat_template
    assert recipe.encode("x") == recipe.encode("x", add_special_tokens=True)
    with pytest.raises(ValueError, match="no chat template"):
        recipe.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"No tokenizer\.json"):
        Recipe.from_pretrained(tmp_path)


def test_generation_config_eos_joins_the_eos_set(tokenizer_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3], "bos_token_id": 0}))
    assert Recipe.from_pretrained(tmp_path).eos_token_ids == frozenset({1, 3})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert Recipe.from_pretrained(tmp_path).eos_token_ids == frozenset({1, 3})


# --- encode / decode ----------------------------------------------------------

ENCODE_TEXTS = [
    "",
    "Hello, world!",
    EMOJI_TEXT,
    CJK_TEXT,
    "def f(x: int) -> int:\n    return x ** 2  # 1234567\n",
    "<|im_start|>user\nhi<|im_end|>\n<|begin_of_text|>mid<|pad|><|end_of_text|>",
    "   leading and trailing spaces   \n\n\n",
    "It's we'LL they've I'M 123456789",
]


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", ENCODE_TEXTS)
def test_encode_decode_match_transformers(recipe: Recipe, reference: Any, text: str, add_special_tokens: bool) -> None:
    ids = recipe.encode(text, add_special_tokens=add_special_tokens)
    assert ids == reference.encode(text, add_special_tokens=add_special_tokens)
    for skip in (True, False):
        assert recipe.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_special_tokens_are_single_ids(recipe: Recipe, reference: Any) -> None:
    for token in ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"):
        ids = recipe.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] in recipe.all_special_ids
        assert ids == [reference.convert_tokens_to_ids(token)]
    assert recipe.bos_token_id == reference.bos_token_id
    assert recipe.pad_token_id == reference.pad_token_id
    assert recipe.eos_token_ids == frozenset({reference.eos_token_id})
    assert recipe.all_special_ids == frozenset(reference.all_special_ids)
    assert recipe.vocab_size == len(reference)


# --- incremental detokenization --------------------------------------------------


def _stream(detokenizer: IncrementalDetokenizer, ids: Sequence[int], chunk_sizes: Sequence[int] = ()) -> list[str]:
    """Feed ids in chunks (one at a time by default); return every delta and the flush."""
    deltas = []
    position = 0
    sizes = iter(chunk_sizes)
    while position < len(ids):
        size = next(sizes, 1)
        deltas.append(detokenizer.add_tokens(ids[position : position + size]))
        position += size
    deltas.append(detokenizer.flush())
    return deltas


def _expected(full: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """decode(ids) cut at the stop string that completes first (longest on ties)."""
    found = [(full.find(stop) + len(stop), -len(stop), stop) for stop in stops if stop in full]
    if not found:
        return full, None
    end, _, stop = min(found)
    return (full[:end] if include else full[: end - len(stop)]), stop


def _prompt(recipe: Recipe) -> list[int]:
    return recipe.encode_chat([{"role": "user", "content": "Tell me something."}])


@pytest.mark.parametrize("text", [EMOJI_TEXT, CJK_TEXT, MIXED_TEXT])
def test_one_token_at_a_time_never_emits_broken_characters(recipe: Recipe, text: str) -> None:
    ids = recipe.encode(text, add_special_tokens=False)
    # The case under test: some tokens are parts of a character.
    assert any("\ufffd" in recipe.decode([token_id]) for token_id in ids)
    detokenizer = recipe.detokenizer(_prompt(recipe))
    deltas = _stream(detokenizer, ids)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == recipe.decode(ids) == text == detokenizer.output_text
    assert detokenizer.finished and detokenizer.stop_reason is None


def test_special_tokens_kept_or_skipped(recipe: Recipe) -> None:
    ids = [*recipe.encode(CJK_TEXT, add_special_tokens=False), 3, 1]
    for skip in (True, False):
        deltas = _stream(recipe.detokenizer(_prompt(recipe), skip_special_tokens=skip), ids)
        assert "".join(deltas) == recipe.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas).endswith("<|im_end|><|end_of_text|>")


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("stop", [(), ("世界",)])
def test_token_texts_are_each_tokens_own_text_whatever_the_grouping(
    recipe: Recipe, chunk: int, stop: tuple[str, ...]
) -> None:
    """What usage's reasoning count reads: one text per token, "" while its character
    is unfinished, together the whole reply before stop strings cut it, the same
    however the tokens arrive."""
    ids = recipe.encode(MIXED_TEXT + " 🦙", add_special_tokens=False)[:-1]  # ends inside the emoji
    one_by_one = recipe.detokenizer(_prompt(recipe))
    expected = [one_by_one.add_tokens([token_id]) for token_id in ids]
    detokenizer = recipe.detokenizer(_prompt(recipe), stop=stop)
    texts: list[str] = []
    for position in range(0, len(ids), chunk):
        detokenizer.add_tokens(ids[position : position + chunk], texts)
    tail: list[str] = []
    detokenizer.flush(tail)
    if stop:  # cut by the stop string: the ids after the chunk that holds it are not read
        assert detokenizer.stop_reason == stop[0] and tail == []
        assert "".join(texts).startswith(recipe.decode(ids)[: recipe.decode(ids).index(stop[0])])
        assert texts == expected[: len(texts)]
        return
    assert len(texts) == len(ids) and texts == expected  # no stop strings: emitted text per token
    assert "" in texts  # the case under test: some tokens carry part of a character
    assert "".join(texts) + "".join(tail) == recipe.decode(ids) and tail[0].startswith("\ufffd")


def test_unfinished_character_is_flushed_as_replacement(recipe: Recipe) -> None:
    ids = recipe.encode("ok 🦙", add_special_tokens=False)[:-1]  # cut inside the emoji
    detokenizer = recipe.detokenizer(_prompt(recipe))
    deltas = [detokenizer.add_tokens([token_id]) for token_id in ids]
    assert "".join(deltas) == "ok "
    assert detokenizer.flush().startswith("\ufffd")
    assert detokenizer.output_text == recipe.decode(ids)


def test_prompt_ending_inside_a_character(recipe: Recipe) -> None:
    ids = recipe.encode("🦙🚀", add_special_tokens=False)
    prompt, generated = ids[:2], ids[2:]
    assert recipe.decode(prompt).endswith("\ufffd")
    deltas = _stream(recipe.detokenizer(prompt), generated)
    assert "".join(deltas) == recipe.decode(generated)


def _boundary_stop(recipe: Recipe, text: str) -> str:
    """A 4-character stop string made of the end of one token and the start of the next."""
    ids = recipe.encode(text, add_special_tokens=False)
    ends = [len(recipe.decode(ids[:k])) for k in range(len(ids) + 1)]
    for k in range(1, len(ids)):
        if ends[k] - ends[k - 1] >= 2 and ends[k + 1] - ends[k] >= 2:
            stop = text[ends[k] - 2 : ends[k] + 2]
            if text.index(stop) == ends[k] - 2 and all(stop not in recipe.decode([i]) for i in ids):
                return stop
    raise AssertionError("no token boundary with two characters on each side")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary(recipe: Recipe, include: bool) -> None:
    text = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun."
    stop = _boundary_stop(recipe, text)
    ids = recipe.encode(text, add_special_tokens=False)
    detokenizer = recipe.detokenizer(_prompt(recipe), stop=[stop], include_stop_str_in_output=include)
    deltas = _stream(detokenizer, ids)
    expected = text[: text.index(stop) + (len(stop) if include else 0)]
    assert "".join(deltas) == expected == detokenizer.output_text
    assert detokenizer.stop_reason == stop and detokenizer.finished
    # Nothing past the cut was ever emitted, even for a moment.
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert expected.startswith(emitted)


@pytest.mark.parametrize("stop", ["世", "界! Then", "🚀 left", "好，世"])
def test_stop_string_inside_multibyte_characters(recipe: Recipe, stop: str) -> None:
    ids = recipe.encode(MIXED_TEXT, add_special_tokens=False)
    assert all(stop not in recipe.decode([i]) for i in ids)  # split over several byte tokens
    detokenizer = recipe.detokenizer(_prompt(recipe), stop=[stop])
    deltas = _stream(detokenizer, ids)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == MIXED_TEXT[: MIXED_TEXT.index(stop)]
    assert detokenizer.stop_reason == stop


def test_earliest_stop_string_wins(recipe: Recipe) -> None:
    ids = recipe.encode(MIXED_TEXT, add_special_tokens=False)
    stops = ["end of story", "rocket", "llama 🦙 said", "café"]
    detokenizer = recipe.detokenizer(_prompt(recipe), stop=stops)
    assert "".join(_stream(detokenizer, ids)) == "The "
    assert detokenizer.stop_reason == "llama 🦙 said"


def test_text_after_a_stop_is_dropped(recipe: Recipe) -> None:
    ids = recipe.encode("alpha beta gamma delta", add_special_tokens=False)
    detokenizer = recipe.detokenizer(_prompt(recipe), stop=["beta"], include_stop_str_in_output=True)
    assert "".join(_stream(detokenizer, ids)) == "alpha beta"
    assert detokenizer.add_tokens(ids) == "" and detokenizer.flush() == ""


def test_held_back_text_that_is_not_a_stop_is_released(recipe: Recipe) -> None:
    text = "We stop here. We stopped there."
    ids = recipe.encode(text, add_special_tokens=False)
    detokenizer = recipe.detokenizer(_prompt(recipe), stop=["stopping"])
    deltas = _stream(detokenizer, ids)
    assert "".join(deltas) == text and detokenizer.stop_reason is None
    assert deltas[-1] == ""  # "stop" was released as soon as "stopp"+"ed" ruled it out


@pytest.mark.parametrize("seed", range(6))
def test_random_chunking_matches_full_decode(recipe: Recipe, seed: int) -> None:
    rng = random.Random(seed)
    text = MIXED_TEXT + " " + CJK_TEXT + EMOJI_TEXT
    candidates = ["🦙", "said", "世界!", "rocket 🚀", ", end", "café", "xyz", "naïve", " the"]
    stops = rng.sample(candidates, k=rng.randint(0, 3))
    include = rng.random() < 0.5
    ids = recipe.encode(text, add_special_tokens=False)
    detokenizer = recipe.detokenizer(_prompt(recipe), stop=stops, include_stop_str_in_output=include)
    deltas = _stream(detokenizer, ids, [rng.randint(1, 4) for _ in ids])
    expected, stop = _expected(recipe.decode(ids), stops, include)
    assert "".join(deltas) == expected
    assert detokenizer.stop_reason == stop
    assert all("\ufffd" not in delta for delta in deltas)


@pytest.mark.parametrize("seed", range(20))
def test_overlapping_stop_strings_on_a_tiny_alphabet(recipe: Recipe, seed: int) -> None:
    # Self-overlapping stops ("aab" in "aaab") are where hold-back logic goes wrong.
    rng = random.Random(seed)
    text = "".join(rng.choice("ab ") for _ in range(80))
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(2, 5))) for _ in range(rng.randint(1, 3))]
    include = rng.random() < 0.5
    ids = recipe.encode(text, add_special_tokens=False)
    detokenizer = recipe.detokenizer([], stop=stops, include_stop_str_in_output=include)
    deltas = _stream(detokenizer, ids, [rng.randint(1, 3) for _ in ids])
    expected, stop = _expected(text, stops, include)
    assert "".join(deltas) == expected and detokenizer.stop_reason == stop
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert expected.startswith(emitted)


class _CountingBackend:
    """Wraps the tokenizer to record how many ids each decode call gets."""

    def __init__(self, recipe: Recipe) -> None:
        self.window_sizes: list[int] = []
        self._backend = recipe.backend

    @property
    def backend(self) -> "_CountingBackend":
        return self

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(ids))
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decoding_cost_per_token_is_bounded(recipe: Recipe) -> None:
    ids = recipe.encode(MIXED_TEXT * 20, add_special_tokens=False)
    counting = _CountingBackend(recipe)
    deltas = _stream(IncrementalDetokenizer(counting, _prompt(recipe), stop=["never"]), ids)  # type: ignore[arg-type]
    assert "".join(deltas) == recipe.decode(ids)
    assert len(ids) > 400 and max(counting.window_sizes) <= 12


def test_empty_stop_string_is_rejected(recipe: Recipe) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        recipe.detokenizer([], stop=[""])
