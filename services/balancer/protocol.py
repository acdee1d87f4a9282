"""The OpenAI API's request and response bodies, in the shapes vLLM's OpenAI server uses.

Every request field is implemented or refused with a 400 that names it, never
silently ignored: unknown fields are refused (extra="forbid"), and so are declared
ones whose value we cannot honour (suffix, a response_format other than text,
best_of with stream). Tools are not implemented: tools, tool_choice, functions,
... are unknown fields here, and so is a message's tool_calls.

Types are strict (no 0 for false, no "5" for 5), floats finite, strings valid
Unicode, and values bounded where they cross NATS (token ids are uint32 there; a
message is at most 1 MiB). Ranges of sampling values are checked once, by
SamplingParams (serving.py names the field in its 400).
"""

import json
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_serializer,
    field_validator,
)

from services.balancer.generation import Usage
from shared.engine.outputs import TokenLogprobs
from shared.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

# vLLM's floor: -inf is not valid JSON and clients choke on it.
_MIN_LOGPROB = -9999.0

MAX_CACHE_SALT_CHARS = 1024
"""A salt names a tenant; it travels with the prompt in every NATS message of the request."""
MAX_STOP_TOKEN_IDS = 1024
"""stop_token_ids travel in every NATS message of the request too."""
MAX_LOGIT_BIAS_TOKENS = 300
"""OpenAI's own cap on logit_bias entries; they travel in every NATS message too."""
MAX_ALLOWED_TOKEN_IDS = 1024
MAX_BAD_WORDS = 64
MAX_PROMPTS = 64
"""Prompts in one completions request (each is a request of its own in the mesh)."""
MAX_CHOICES = 16
"""n and best_of: samples per prompt."""
MAX_REQUEST_ID_CHARS = 128

# ---------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------


def _valid_unicode(text: str) -> str:
    # JSON can spell a lone surrogate ("\ud800"), which no UTF-8 tokenizer or encoder takes.
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"not valid Unicode: a lone surrogate at character {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0, lt=1 << 32)]
"""A uint32 on the wire; the engine refuses ids past the model's vocabulary."""


class _Strict(BaseModel):
    """A request body: unknown fields refused, no type coercion, no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    """Send a last chunk with empty choices and the usage."""
    continuous_usage_stats: bool = False
    """vLLM's: with include_usage, every chunk also carries the usage so far."""


def check_request_id(value: str) -> str:
    # It names the response (cmpl-<id>) and the x-request-id header: printable ASCII only.
    if not value or not all(c.isascii() and c.isprintable() and c != " " for c in value):
        raise ValueError("must be printable ASCII without spaces")
    return value


RequestId = Annotated[str, Field(max_length=MAX_REQUEST_ID_CHARS), AfterValidator(check_request_id)]


class _GenerationRequest(_Strict):
    """What completions and chat share: the sampling settings and the vLLM extensions."""

    model: Text
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """vLLM's: None, 0 or -1 keep every token."""
    min_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS_TOKENS)
    """Token id (as a string) to a bias added to its logit; values are clamped to
    [-100, 100] as vLLM does."""
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]] | None = Field(
        None, max_length=MAX_BAD_WORDS
    )
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(max_length=MAX_CACHE_SALT_CHARS), AfterValidator(_valid_unicode)] | None = None
    """vLLM's: requests with different salts never share prefix-cache blocks."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """vLLM's: each prompt token's logprob (none for the first) and this many alternatives."""
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    """vLLM's: keep only the prompt's last k tokens (-1: the context length)."""
    return_token_ids: bool = False
    """vLLM's: the prompt's and each choice's token ids in the response."""
    return_tokens_as_token_ids: bool = False
    """vLLM's: logprobs name tokens as "token_id:<id>" (for tokens that are not valid text alone)."""
    priority: int = Field(0, ge=-(1 << 31), lt=1 << 31)
    """vLLM's: lower goes first in the balancer's queue (see BalancerSettings.max_dispatched_requests)."""
    request_id: RequestId | None = None
    """vLLM's: names the response (cmpl-<request_id>) and the x-request-id header."""

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, logit_bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in logit_bias or {}:
            if not key.isdigit() or int(key) >= 1 << 32:
                raise ValueError(f"keys must be token ids (integers as strings), got {key!r}")
        return logit_bias

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("is only allowed with stream: true")
        return options

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, bad_words_token_ids: list[list[int]] | None = None
    ) -> SamplingParams:
        """Token-level settings for the generator; stop strings stay with the HTTP layer.
        Raises SamplingParams' ValueError for values out of range."""
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=None if self.top_k in (None, 0, -1) else self.top_k,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            stop_token_ids=list(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            seed=self.seed,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias={int(k): min(max(v, -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS) for k, v in (self.logit_bias or {}).items()},
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            bad_words_token_ids=bad_words_token_ids or [],
            prompt_logprobs=self.prompt_logprobs,
        )


Prompt = str | list[int]


class CompletionRequest(_GenerationRequest):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    """One prompt (text or token ids) or a list of them (max MAX_PROMPTS): each
    prompt gets n choices, choice index = prompt index * n + sample index."""
    echo: bool = False
    """Return the prompt before the completion (and, with logprobs, the prompt tokens' logprobs)."""
    max_tokens: int | None = Field(None, ge=0)
    """None: up to the model's context length. 0 only with echo: the prompt alone, scored."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    """Draw best_of samples per prompt, return the n with the highest cumulative logprob."""
    add_special_tokens: bool = True
    """vLLM's: encode a text prompt with the tokenizer's special tokens (BOS)."""

    @field_validator("prompt")
    @classmethod
    def _some_prompts(cls, prompt: str | list[Any]) -> str | list[Any]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("is not supported: this server does not do fill-in-the-middle (send the prefix as the prompt)")
        return value

    @field_validator("best_of")
    @classmethod
    def _at_least_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if best_of is not None and best_of < n:
            raise ValueError(f"must be at least n ({n}), got {best_of}")
        if best_of is not None and best_of > n and info.data.get("stream"):
            raise ValueError("cannot be more than n with stream: true (the best are known only at the end)")
        return best_of

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_with_echo(cls, max_tokens: int | None, info: ValidationInfo) -> int | None:
        if max_tokens == 0 and not info.data.get("echo"):
            raise ValueError("must be at least 1 (0 is allowed only with echo: true)")
        return max_tokens

    @property
    def prompts(self) -> list[Prompt]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]

    @property
    def num_samples(self) -> int:
        return self.best_of or self.n or 1


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    """OpenAI's; passed to the chat template, as are the other fields."""
    reasoning_content: Text | None = None
    """vLLM's: an assistant turn's reasoning, for templates that render it."""

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if message["role"] == "developer":  # OpenAI's newer name for the system role
            message["role"] = "system"
        return message


class ResponseFormat(_Strict):
    type: Literal["text"]
    """Only plain text: json_object and json_schema would need constrained decoding."""


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    """Deprecated by OpenAI in favour of max_completion_tokens, which wins when both are set."""
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """Checked here, not only by SamplingParams: its logprobs is this field in chat."""
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """vLLM's: leave the last (assistant) message open, so the reply continues it."""
    add_special_tokens: bool = False
    """vLLM's: also add the tokenizer's special tokens (the template usually writes BOS itself)."""
    chat_template_kwargs: dict[Text, Any] | None = None
    """vLLM's: extra template variables (e.g. enable_thinking)."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _valid_unicode_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        try:  # every string in it, however deep
            json.dumps(kwargs, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("not valid Unicode: a string in it holds a lone surrogate") from None
        return kwargs

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return top_logprobs

    @field_validator("continue_final_message")
    @classmethod
    def _not_with_generation_prompt(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("cannot be true with add_generation_prompt: true (set it to false)")
        return value

    @property
    def num_samples(self) -> int:
        return self.n or 1

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------------------
# responses
# ---------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, usage: Usage) -> "UsageInfo":
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        )


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "infermesh"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    """None for the prompt's first token (echo): nothing comes before it."""
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one entry of prompt_logprobs."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]
"""Per prompt token (None for the first), its own logprob and the top alternatives, by token id."""


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    """return_token_ids: on the whole response's choice, or a stream's first chunk of the choice."""
    token_ids: list[int] | None = None
    """return_token_ids: the tokens of this choice (of this chunk, when streaming)."""


class CompletionResponse(BaseModel):
    """Both the whole response and each stream chunk (the completions API uses one shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None

    @field_serializer("delta")
    def _only_set_fields(self, delta: DeltaMessage) -> dict[str, Any]:
        # OpenAI sends role in the first delta only, and no null keys in deltas.
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    """return_token_ids: on the first chunk."""


# ---------------------------------------------------------------------------
# logprobs in each API's format
# ---------------------------------------------------------------------------

TokenText = Callable[[int], str]
"""The text of one token id on its own (special tokens included)."""


def _logprob(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def completion_logprobs(
    entries: Sequence[TokenLogprobs | int], token_text: TokenText, text_offset: int
) -> tuple[CompletionLogprobs, int]:
    """The legacy completions format; text_offset is where the first token's text
    starts in the output. Returns the logprobs and the offset after the last token.
    top_logprobs holds the k most likely tokens and the sampled one, as OpenAI's.
    A bare token id (the prompt's first, echoed) has no logprob: None, as vLLM's."""
    out = CompletionLogprobs()
    for entry in entries:
        if isinstance(entry, int):
            token = token_text(entry)
            out.tokens.append(token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            token = token_text(entry.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(_logprob(entry.logprob))
            top = {token_text(token_id): _logprob(lp) for token_id, lp in entry.top}
            top.setdefault(token, _logprob(entry.logprob))
            out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out, text_offset


def prompt_logprobs(entries: Sequence[TokenLogprobs | None], token_text: TokenText) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else its own
    logprob and rank with the top alternatives, keyed by token id."""
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {token_id: PromptLogprob(logprob=_logprob(lp), rank=rank, decoded_token=token_text(token_id))
                  for rank, (token_id, lp) in enumerate(entry.top, start=1)}
        ranked.setdefault(entry.token_id, PromptLogprob(
            logprob=_logprob(entry.logprob), rank=entry.rank, decoded_token=token_text(entry.token_id)))
        out.append({entry.token_id: ranked.pop(entry.token_id), **ranked})
    return out


def _top_logprob(token_id: int, logprob: float, token_text: TokenText) -> TopLogprob:
    token = token_text(token_id)
    return TopLogprob(token=token, logprob=_logprob(logprob), bytes=list(token.encode("utf-8")))


def chat_logprobs(entries: Sequence[TokenLogprobs], token_text: TokenText) -> ChatLogprobs:
    """The chat format: one entry per token with its top_logprobs alternatives."""
    content = []
    for entry in entries:
        chosen = _top_logprob(entry.token_id, entry.logprob, token_text)
        top = [_top_logprob(token_id, lp, token_text) for token_id, lp in entry.top]
        content.append(ChatLogprobEntry(**chosen.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


# ---------------------------------------------------------------------------
# /tokenize and /detokenize (vLLM's shapes)
# ---------------------------------------------------------------------------


class TokenizeCompletionRequest(_Strict):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[Text, Any] | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _not_with_generation_prompt(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("cannot be true with add_generation_prompt: true (set it to false)")
        return value


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
