"""The Recipe: a model's tokenizer, chat template and stop tokens, read from a Hugging Face folder.

Everything the balancer needs to turn an OpenAI request into token ids and
token ids back into text, without importing transformers: `tokenizers` does
BPE, `ChatTemplate` renders the prompt, `IncrementalDetokenizer` streams text.
"""

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from shared.recipe.chat_template import ChatRenderer, ChatTemplate
from shared.recipe.deepseek_v4_chat import DeepseekV4Chat
from shared.recipe.detokenizer import IncrementalDetokenizer

# The named special tokens transformers passes to chat templates (its
# SPECIAL_TOKENS_ATTRIBUTES in v5), in its order.
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Chat formats a model family ships as code rather than a template, by config.json's model_type.
_CODE_FORMATS: Mapping[object, type[ChatRenderer]] = {"deepseek_v4": DeepseekV4Chat}
# transformers writes int(1e30) for "no limit".
_NO_MAX_LENGTH = 10**29


class Recipe:
    """Tokenize, render chat prompts and detokenize for one model. Immutable after loading."""

    def __init__(
        self,
        backend: Tokenizer,
        *,
        special_tokens: Mapping[str, str],
        chat_templates: Mapping[str, ChatRenderer],
        extra_eos_token_ids: Sequence[int] = (),
        model_max_length: int | None = None,
    ) -> None:
        """Prefer `from_pretrained`; this takes an already configured `tokenizers.Tokenizer`.

        special_tokens maps transformers' names (bos_token, eos_token, pad_token, ...)
        to token strings; each must be in the vocabulary.
        """
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self._chat_templates = dict(chat_templates)
        self._model_max_length = model_max_length
        self._special_ids = {name: self._token_id(name, token) for name, token in self._special_tokens.items()}
        # Ids that end generation: the config's eos plus generation_config's, as transformers' generate() does.
        eos_ids = set(extra_eos_token_ids)
        if "eos_token" in self._special_ids:
            eos_ids.add(self._special_ids["eos_token"])
        self._eos_token_ids = frozenset(eos_ids)
        added = backend.get_added_tokens_decoder()
        self._all_special_ids = frozenset(
            {token_id for token_id, token in added.items() if token.special} | set(self._special_ids.values())
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Recipe":
        """Load tokenizer.json, tokenizer_config.json, chat templates and generation_config.json from a folder."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"No tokenizer.json in {folder}: the Recipe needs a fast (tokenizers) tokenizer; "
                "convert a SentencePiece-only model with transformers and save it first."
            )
        backend = Tokenizer.from_file(str(tokenizer_file))
        # Hub files sometimes carry truncation or padding settings; transformers turns
        # them off unless asked, and a server must never cut a prompt silently.
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(folder / "tokenizer_config.json")
        special_tokens = {
            name: content for name in _NAMED_SPECIAL_TOKENS if (content := _token_content(config.get(name))) is not None
        }
        _mark_special(backend, config, special_tokens)
        generation_config = _read_json(folder / "generation_config.json")
        eos_from_generation = generation_config.get("eos_token_id")
        if isinstance(eos_from_generation, int):
            eos_from_generation = [eos_from_generation]
        max_length = config.get("model_max_length")
        templates: dict[str, ChatRenderer] = {
            name: ChatTemplate(source) for name, source in _chat_template_sources(folder, config).items()
        }
        code_format = _CODE_FORMATS.get(_read_json(folder / "config.json").get("model_type"))
        if not templates and code_format is not None:
            # Shipped as code beside the weights (DeepSeek-V4's encoding/encoding_dsv4.py), not as a template.
            templates["default"] = code_format()
        return cls(
            backend,
            special_tokens=special_tokens,
            chat_templates=templates,
            extra_eos_token_ids=eos_from_generation or (),
            model_max_length=max_length if isinstance(max_length, int) and max_length < _NO_MAX_LENGTH else None,
        )

    # --- tokens ---------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; add_special_tokens applies the post-processor (e.g. a leading bos)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean_up_tokenization_spaces: it rewrites " ." to "." and so corrupts code.
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def backend(self) -> Tokenizer:
        """The underlying `tokenizers.Tokenizer` (for grammar engines); do not reconfigure it."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids including added tokens (transformers' `len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_ids.get("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_ids.get("pad_token")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation."""
        return self._eos_token_ids

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of all special tokens (those `decode(..., skip_special_tokens=True)` drops)."""
        return self._all_special_ids

    @property
    def special_tokens(self) -> Mapping[str, str]:
        """transformers' special_tokens_map: bos_token, eos_token, ... to their strings."""
        return dict(self._special_tokens)

    @property
    def model_max_length(self) -> int | None:
        """The longest input the tokenizer config allows, or None if it sets no limit."""
        return self._model_max_length

    # --- chat -----------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    def chat_template_source(self, with_tools: bool = False) -> str | None:
        """The text of the template a conversation (with tools or without) renders with;
        None without a usable one. Tool-call parsers are chosen by what it asks the model for."""
        try:
            return self._select_template([] if with_tools else None).source
        except ValueError:
            return None

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages to the prompt text; kwargs (e.g. documents, enable_thinking) reach the template."""
        template = self._select_template(tools)
        return template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=self._special_tokens,
            **kwargs,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Render then encode without adding special tokens: the template writes bos itself."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def detokenizer(
        self,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> IncrementalDetokenizer:
        """A streaming detokenizer for one request."""
        return IncrementalDetokenizer(
            self._backend,
            prompt_token_ids,
            skip_special_tokens=skip_special_tokens,
            stop=stop,
            include_stop_str_in_output=include_stop_str_in_output,
        )

    def _select_template(self, tools: Sequence[Mapping[str, Any]] | None) -> ChatRenderer:
        # transformers' choice among named templates: "tool_use" when tools are given, else "default".
        if not self._chat_templates:
            raise ValueError(
                "This model has no chat template (none in tokenizer_config.json, chat_template.jinja or "
                "chat_template.json): use the completions API, or add a template to the model folder."
            )
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        raise ValueError(
            f"This model has several chat templates ({sorted(self._chat_templates)}) and none named 'default'."
        )

    def _token_id(self, name: str, token: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"The tokenizer config names {name}={token!r}, which tokenizer.json's vocabulary lacks.")
        return token_id


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as file:
        content = json.load(file)
    if not isinstance(content, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    return content


def _token_content(value: object) -> str | None:
    # Older configs store special tokens as serialized AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _mark_special(backend: Tokenizer, config: Mapping[str, Any], named: Mapping[str, str]) -> None:
    """Make tokens the config calls special special in the backend too, as transformers does on load.

    Otherwise decode(skip_special_tokens=True) would print them and encode could split them.
    """
    contents = set(named.values())
    for entry in config.get("added_tokens_decoder", {}).values():
        if entry.get("special") and isinstance(entry.get("content"), str):
            contents.add(entry["content"])
    # v4 lists extra special tokens as additional_special_tokens; v5 as extra_special_tokens,
    # a list or a dict such as {"image_token": "<image>"}.
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key) or []
        for value in extra.values() if isinstance(extra, dict) else extra:
            if (content := _token_content(value)) is not None:
                contents.add(content)
    already_special = {token.content for token in backend.get_added_tokens_decoder().values() if token.special}
    missing = sorted(content for content in contents - already_special if backend.token_to_id(content) is not None)
    if missing:
        backend.add_special_tokens([AddedToken(content, special=True, normalized=False) for content in missing])


def _chat_template_sources(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named template sources, with transformers' precedence.

    Template files (chat_template.jinja, written by transformers v5's save_pretrained,
    and additional_chat_templates/*.jinja) replace any template in tokenizer_config.json;
    chat_template.json (multimodal processors) is the last resort.
    """
    files: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for template_file in sorted(extra_dir.glob("*.jinja")):
            files[template_file.name.removesuffix(".jinja")] = template_file.read_text(encoding="utf-8")
    if files:
        return files
    in_config = config.get("chat_template")
    if in_config is None:
        in_config = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(in_config, str):
        return {"default": in_config}
    if isinstance(in_config, list):  # the legacy form of several named templates
        return {entry["name"]: entry["template"] for entry in in_config}
    return {}
