"""train_tokenizer: deterministic output that both the Recipe and transformers load."""

from pathlib import Path

import pytest

from shared.recipe import Recipe, train_tokenizer
from shared.recipe.train_tokenizer import SPECIAL_TOKENS

VOCAB_SIZE = 4096


@pytest.fixture(scope="module")
def trained_twice(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    first = tmp_path_factory.mktemp("first")
    second = tmp_path_factory.mktemp("second")
    train_tokenizer(first, VOCAB_SIZE)
    train_tokenizer(second, VOCAB_SIZE)
    return first, second


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_same_call_twice_gives_byte_identical_files(trained_twice: tuple[Path, Path], name: str) -> None:
    first, second = trained_twice
    assert (first / name).read_bytes() == (second / name).read_bytes()


def test_vocab_size_and_special_token_ids(trained_twice: tuple[Path, Path]) -> None:
    recipe = Recipe.from_pretrained(trained_twice[0])
    assert recipe.vocab_size == VOCAB_SIZE
    ids = [recipe.encode(token, add_special_tokens=False) for token in SPECIAL_TOKENS]
    assert ids == [[0], [1], [2], [3], [4]]
    assert recipe.bos_token_id == 0
    assert recipe.eos_token_ids == frozenset({3})  # <|im_end|>
    assert recipe.pad_token_id == 4
    assert recipe.all_special_ids == frozenset(range(5))


def test_bos_is_prepended_only_with_special_tokens(trained_twice: tuple[Path, Path]) -> None:
    recipe = Recipe.from_pretrained(trained_twice[0])
    plain = recipe.encode("import os", add_special_tokens=False)
    assert recipe.encode("import os") == [0, *plain]


@pytest.mark.parametrize("text", ["🦙🚀 naïve café", "你好，世界", "\x00\x7f\t\r\n  ", "Ω≈ç√∫˜µ≤≥÷ 𝕿𝖍𝖊 ﷽"])
def test_any_utf8_text_round_trips(trained_twice: tuple[Path, Path], text: str) -> None:
    recipe = Recipe.from_pretrained(trained_twice[0])
    ids = recipe.encode(text)
    assert recipe.decode(ids) == text
    assert recipe.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


def test_loads_in_transformers(trained_twice: tuple[Path, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(trained_twice[0])
    assert len(reference) == VOCAB_SIZE
    assert (reference.bos_token, reference.eos_token, reference.pad_token) == (
        "<|begin_of_text|>",
        "<|im_end|>",
        "<|pad|>",
    )
    assert reference.chat_template is not None


def test_rejects_a_vocab_smaller_than_the_alphabet(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 261"):
        train_tokenizer(tmp_path, 100)
