"""The bodies of /tokenize and /detokenize, in vLLM's shapes."""

from typing import Any, Literal

from pydantic import BaseModel, Field

from services.balancer.frontend.body_fields import ContinueFinalMessage, StrictBody, Text, TokenId
from services.balancer.frontend.request_bodies import ChatMessage
from services.balancer.frontend.tool_bodies import ToolDefinition


class TokenizeCompletionRequest(StrictBody):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(StrictBody):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: ContinueFinalMessage = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[Text, Any] | None = None
    tools: list[ToolDefinition] | None = Field(None, min_length=1)
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    """As in chat: the count is of the prompt chat renders with it."""
    """Rendered as chat renders them: the count is the prompt a chat request with them makes."""


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictBody):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
