"""The bodies the API answers with, in the shapes of OpenAI's and vLLM's servers:
errors, usage, models, and completions and chat (whole and streamed)."""

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, field_serializer

from services.balancer.generation import Usage


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None

class ErrorResponse(BaseModel):
    error: ErrorInfo

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0

class CompletionTokensDetails(BaseModel):
    """OpenAI's prediction-token counts, which say what speculative decoding did: drafted
    tokens the model accepted, and those it rejected; and its reasoning tokens (present
    when speculation ran or the reply was read for reasoning)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    reasoning_tokens: int = 0

class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None

    @classmethod
    def of(cls, usage: Usage, reasoning: bool = False) -> "UsageInfo":
        """reasoning: the reply was read for reasoning (its count is reported, 0 included)."""
        details = None
        if usage.spec_drafted_tokens or reasoning:
            details = CompletionTokensDetails(
                accepted_prediction_tokens=usage.spec_accepted_tokens,
                rejected_prediction_tokens=usage.spec_drafted_tokens - usage.spec_accepted_tokens,
                reasoning_tokens=usage.reasoning_tokens,
            )
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
            completion_tokens_details=details,
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
    system_fingerprint: str | None = None
    """OpenAI's; here the seed the request ran with, "infermesh-seed-<seed>" (seeds.py)."""

class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]

class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]

class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry]

class FunctionCallOut(BaseModel):
    name: str
    arguments: str
    """The arguments' JSON object as text, as the model wrote it."""

class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut

class DeltaFunctionCall(BaseModel):
    name: str | None = None
    """In the call's first delta only."""
    arguments: str | None = None
    """The next piece of the arguments' text."""

class DeltaToolCall(BaseModel):
    index: int
    """The call's position in the message (a client gathers the pieces by it)."""
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    """None when the reply is tool calls and nothing else."""
    tool_calls: list[ToolCallOut] | None = Field(None, exclude_if=lambda calls: calls is None)
    reasoning_content: str | None = Field(None, exclude_if=lambda reasoning: reasoning is None)
    """vLLM's: a reasoning model's thinking, split off the content (reasoning_parsers)."""

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
    system_fingerprint: str | None = None
    """OpenAI's; here the seed the request ran with, "infermesh-seed-<seed>" (seeds.py)."""
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None

class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    """vLLM's: a piece of the reasoning (a chunk carries reasoning or content, as it arrives)."""
    tool_calls: list[DeltaToolCall] | None = None

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
    system_fingerprint: str | None = None
    """As on the whole response, on every chunk (OpenAI's chunks carry it too)."""
    prompt_token_ids: list[int] | None = None
    """return_token_ids: on the first chunk."""

