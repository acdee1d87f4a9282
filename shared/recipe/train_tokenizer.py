"""Train a small byte-level BPE tokenizer from text already on the machine.

Tests and local runs need a real tokenizer without network access: this one is
trained with `tokenizers` on the Python standard library's own `.py` sources and
saved in the Hugging Face layout (`tokenizer.json` + `tokenizer_config.json`)
that both `Recipe.from_pretrained` and `transformers.AutoTokenizer` load.

Determinism: `BpeTrainer` breaks ties between equally frequent pairs by the
pair itself, not by hash-map order or thread timing, so the same corpus gives
the same merges. Checked with 1, 2 and 7 rayon threads and across processes
(tokenizers 0.23.3); `tests/unit/test_train_tokenizer.py` keeps checking it. The
corpus is a sorted, capped list of files, and both files are written with
sorted keys, so two calls give byte-identical files on the same Python install
(a different Python version has different stdlib sources, hence other merges).
"""

import json
import os
import sysconfig
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Order fixes the ids: the trainer gives special tokens ids 0..4 before the byte alphabet.
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, END_OF_TEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)

# Llama-3's split pattern: contractions, letter runs, numbers in chunks of at most
# three digits, punctuation runs that swallow following newlines, and whitespace
# rules that keep indentation apart from the next word (good for source code).
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML turns, opened by bos like Llama-3 so that `encode_chat` (which adds no
# special tokens itself) still starts with bos. Content may be a string or a list
# of OpenAI-style parts, of which only the text parts are rendered.
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('Unsupported role ' + message['role'] + ': use system, user or assistant.') }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' }}\n"
    "    {%- if message['content'] is string %}\n"
    "        {{- message['content'] }}\n"
    "    {%- else %}\n"
    "        {%- for part in message['content'] %}\n"
    "            {%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}\n"
    "        {%- endfor %}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# A few MB trains in about two seconds on two cores and gives enough merges for
# vocabularies well past 32k.
DEFAULT_MAX_CORPUS_BYTES = 4_000_000
DEFAULT_MODEL_MAX_LENGTH = 8192

# Test suites hold odd encodings and huge generated data; site-packages is not stdlib.
_SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test"})


def train_tokenizer(
    out_dir: str | Path,
    vocab_size: int,
    *,
    max_corpus_bytes: int = DEFAULT_MAX_CORPUS_BYTES,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
) -> None:
    """Train a byte-level BPE tokenizer on stdlib sources; write tokenizer.json and tokenizer_config.json.

    vocab_size counts the 5 special tokens and the 256-symbol byte alphabet.
    """
    min_vocab_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is too small: it must be at least {min_vocab_size}.")
    texts = stdlib_corpus(max_corpus_bytes)
    tokenizer = _build_tokenizer(texts, vocab_size)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"The corpus ({max_corpus_bytes} bytes) only yields {tokenizer.get_vocab_size()} tokens, "
            f"fewer than vocab_size={vocab_size}: raise max_corpus_bytes or lower vocab_size."
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # pretty=True writes the vocab ordered by id, so the file is stable text.
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    config = _tokenizer_config(tokenizer, model_max_length)
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def stdlib_corpus(max_bytes: int) -> list[str]:
    """The stdlib's `.py` files in sorted path order, as long as they fit in max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    relative_paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so the walk never enters site-packages (thousands of files).
        dirnames[:] = [name for name in dirnames if name not in _SKIPPED_DIRS]
        base = Path(dirpath).relative_to(root)
        relative_paths.extend((base / name).as_posix() for name in filenames if name.endswith(".py"))
    texts: list[str] = []
    num_bytes = 0
    for relative in sorted(relative_paths):
        data = (root / relative).read_bytes()
        if num_bytes + len(data) > max_bytes:
            break
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError:
            continue  # a legacy-encoded file; skipping it keeps the corpus valid UTF-8
        num_bytes += len(data)
    if not texts:
        raise ValueError(f"No stdlib .py sources found under {root} within {max_bytes} bytes.")
    return texts


def _build_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # Split first, then map bytes to printable symbols without a second regex (as Llama-3 does).
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS],
        # All 256 byte symbols, seen or not, so any UTF-8 text (emoji, CJK) encodes and round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Llama-3's post-processor: offsets left untrimmed, bos before each sequence when
    # add_special_tokens=True.
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN}:0 $A:0",
                pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


def _tokenizer_config(tokenizer: Tokenizer, model_max_length: int) -> dict[str, object]:
    """The tokenizer_config.json that transformers v4 writes for a fast tokenizer (v5 reads it too)."""
    added_tokens_decoder = {
        str(token_id): {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
        for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    named = {BOS_TOKEN, IM_END_TOKEN, PAD_TOKEN}
    return {
        "added_tokens_decoder": added_tokens_decoder,
        # Listed so transformers counts them in all_special_ids, as decode already skips them.
        "additional_special_tokens": [token for token in SPECIAL_TOKENS if token not in named],
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        # False: transformers' clean-up deletes spaces before punctuation, which
        # breaks code and makes its decode differ from the raw tokenizer's.
        "clean_up_tokenization_spaces": False,
        # <|im_end|> ends every assistant turn in the template, so it is what a chat
        # model emits when done (as in Qwen2 instruct configs); <|end_of_text|> ends a
        # document in pretraining; a model's generation_config.json should list both
        # ids as eos_token_id, and Recipe adds them to its stop set.
        "eos_token": IM_END_TOKEN,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
