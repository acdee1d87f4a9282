"""The bodies of /v1/completions and /v1/chat/completions, in vLLM's shapes.

Every field is implemented or refused with a 400 that names it, never silently
ignored: unknown fields are refused (extra="forbid"), fields that only label a
request (user, metadata, ...) are recorded (label_fields.py), and declared ones
whose value we cannot honour (suffix, best_of
with stream). Tools (tools, tool_choice, parallel_tool_calls, tool messages and an
assistant's tool_calls) are typed in tool_bodies.py; the legacy functions and
function_call are unknown fields. Ranges of sampling values
are checked once, by SamplingParams (sampling.py builds them; serving names the
field in its 400).
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator

from services.balancer.frontend.body_fields import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT_CHARS,
    MAX_CHOICES,
    MAX_IMAGE_UUID_CHARS,
    MAX_PROMPTS,
    MAX_STOP_TOKEN_IDS,
    ChatTemplateKwargs,
    ContinueFinalMessage,
    LogitBias,
    RequestId,
    StrictBody,
    Text,
    TokenId,
    valid_unicode,
)
from services.balancer.frontend.label_fields import LabelledBody
from services.balancer.frontend.tool_bodies import MAX_TOOLS, MessageToolCall, ToolChoice, ToolDefinition
from services.balancer.frontend.structured_bodies import ResponseFormat, StructuredOutputs
from shared.engine.sampling_params import MAX_LOGPROBS


class StreamOptions(StrictBody):
    include_usage: bool = False
    """Send a last chunk with empty choices and the usage."""
    continuous_usage_stats: bool = False
    """vLLM's: with include_usage, every chunk also carries the usage so far."""


class GenerationBody(LabelledBody):
    """What completions and chat share: the sampling settings, the vLLM extensions and
    the labels (label_fields.py)."""

    model: Text | None = None
    """One of the served names; may be left out (one model is served), as in vLLM."""
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
    logit_bias: LogitBias | None = None
    """Token id (as a string) to a bias added to its logit; values are clamped to
    [-100, 100] as vLLM does."""
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[Annotated[str, Field(min_length=1), AfterValidator(valid_unicode)]] | None = Field(
        None, max_length=MAX_BAD_WORDS
    )
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(max_length=MAX_CACHE_SALT_CHARS), AfterValidator(valid_unicode)] | None = None
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
    # Structured outputs (structured_outputs.py resolves them; at most one per request).
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(None, min_length=1)
    guided_grammar: Text | None = None
    """vLLM's older names of structured_outputs' json, regex, choice and grammar."""

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


Prompt = str | list[int]


class CompletionRequest(GenerationBody):
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
    response_format: ResponseFormat | None = None
    """As in chat (vLLM takes it on completions too): json_object or json_schema."""

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


class TextPart(StrictBody):
    type: Literal["text"]
    text: Text


class ImageURL(StrictBody):
    url: Annotated[str, Field(min_length=1), AfterValidator(valid_unicode)]
    """A base64 data: URL (data:image/png;base64,...) or an http(s) URL the balancer
    fetches (frontend/images.py; limits in the images settings)."""
    detail: Literal["auto", "low", "high"] = "auto"
    """OpenAI's; passed on with the image to models that have a notion of it (vLLM
    ignores it for every model it serves)."""


class ImagePart(StrictBody):
    type: Literal["image_url"]
    image_url: Annotated[ImageURL | None, Field(validate_default=True)] = None
    uuid: Annotated[str, Field(min_length=1, max_length=MAX_IMAGE_UUID_CHARS), AfterValidator(valid_unicode)] | None = None
    """vLLM's: the client's own stable name for the image, which then names it (its hash
    is over this, not the pixels): the client vouches that one uuid is one image."""

    @field_validator("image_url")
    @classmethod
    def _the_image_itself(cls, image_url: ImageURL | None) -> ImageURL:
        # vLLM lets a uuid alone name an image its cache still holds; we keep no such cache yet.
        if image_url is None:
            raise ValueError('needed: {"url": <a data: URL or an http(s) URL>} (a uuid alone names no image '
                             "here: this server keeps no image cache to look it up in)")
        return image_url


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
"""A chat message's content part, told apart by its type."""


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    """Text, or parts: text and images (several per message, in order)."""
    name: Text | None = None
    """OpenAI's; passed to the chat template, as are the other fields."""
    reasoning_content: Text | None = None
    """vLLM's: an assistant turn's reasoning, for templates that render it."""
    tool_calls: list[MessageToolCall] | None = None
    """An assistant turn's calls (its content may then be null)."""
    tool_call_id: Annotated[Text | None, Field(validate_default=True)] = None
    """A tool message's: the call it answers."""

    @field_validator("tool_calls")
    @classmethod
    def _only_assistant_calls(cls, calls: list[MessageToolCall] | None, info: ValidationInfo) -> Any:
        if calls is not None and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages make tool calls")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _tool_answers_a_call(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if role == "tool" and call_id is None:
            raise ValueError("a tool message must name the call it answers")
        if role != "tool" and call_id is not None:
            raise ValueError("only tool messages answer a call")
        return call_id

    @property
    def image_parts(self) -> list[tuple[int, ImagePart]]:
        """(index in content, part) of each image, in order."""
        if not isinstance(self.content, list):
            return []
        return [(j, part) for j, part in enumerate(self.content) if isinstance(part, ImagePart)]

    @property
    def text(self) -> str:
        """The content's text, its text parts joined (images left out)."""
        if not isinstance(self.content, list):
            return self.content or ""
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True, exclude={"tool_calls", "content"})
        if isinstance(self.content, list):
            # An image is {"type": "image"} to the template, as vLLM renders it (VL templates
            # write their image placeholder for it): its URL, megabytes maybe, is no text.
            message["content"] = [
                part.model_dump() if isinstance(part, TextPart) else {"type": "image"} for part in self.content
            ]
        elif self.content is not None:
            message["content"] = self.content
        if message["role"] == "developer":  # OpenAI's newer name for the system role
            message["role"] = "system"
        if self.tool_calls is not None:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return message


class ChatCompletionRequest(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    """Deprecated by OpenAI in favour of max_completion_tokens, which wins when both are set."""
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """Checked here, not only by SamplingParams: its logprobs is this field in chat."""
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    continue_final_message: ContinueFinalMessage = False
    """vLLM's: leave the last (assistant) message open, so the reply continues it."""
    add_special_tokens: bool = False
    """vLLM's: also add the tokenizer's special tokens (the template usually writes BOS itself)."""
    chat_template_kwargs: ChatTemplateKwargs | None = None
    """vLLM's: extra template variables (e.g. enable_thinking)."""
    tools: list[ToolDefinition] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    """None: "auto" with tools, "none" without (OpenAI's defaults)."""
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    """Passed to chat templates that read it (GPT-OSS's); a 400 for the others (reasoning_output.py)."""
    parallel_tool_calls: bool = True
    """False: at most one call per reply (forced choices are constrained to one; auto
    replies keep their first call)."""

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        names = [tool.function.name for tool in tools or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"function names must be distinct, got {names}")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        tools: list[ToolDefinition] | None = info.data.get("tools")
        if choice is None or choice == "none":
            return choice
        if not tools:
            raise ValueError("needs tools: name the functions the model may call")
        if isinstance(choice, str):
            return choice
        names = [tool.function.name for tool in tools]
        if choice.function.name not in names:
            raise ValueError(f"names the function {choice.function.name!r}, which tools does not offer ({names})")
        return choice

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return top_logprobs

    @property
    def num_samples(self) -> int:
        return self.n or 1

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
