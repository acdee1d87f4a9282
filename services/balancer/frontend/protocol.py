"""The OpenAI API's bodies, in the shapes vLLM's OpenAI server uses, under one name
(`from services.balancer.frontend import protocol as p`). Each part lives in a file of its own:

  body_fields.py      the field types, limits and checks the request bodies share;
  request_bodies.py   completions and chat requests (every field implemented or
                      refused with a 400 that names it);
  sampling.py         a request body as the engine's SamplingParams;
  response_bodies.py  errors, usage, models, completions and chat responses and chunks;
  logprob_format.py   logprobs in each API's format;
  tokenize_bodies.py  /tokenize and /detokenize.
"""

from services.balancer.frontend.body_fields import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT_CHARS,
    MAX_CHOICES,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PROMPTS,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_TOKEN_IDS,
    RequestId,
    Text,
    TokenId,
    check_request_id,
)
from services.balancer.frontend.logprob_format import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs
from services.balancer.frontend.request_bodies import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    GenerationBody,
    ImagePart,
    ImageURL,
    Prompt,
    ResponseFormat,
    StreamOptions,
    TextPart,
)
from services.balancer.frontend.response_bodies import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorInfo,
    FunctionCallOut,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)
from services.balancer.frontend.sampling import sampling_params
from services.balancer.frontend.tokenize_bodies import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

__all__ = [
    "MAX_ALLOWED_TOKEN_IDS", "MAX_BAD_WORDS", "MAX_CACHE_SALT_CHARS", "MAX_CHOICES", "MAX_LOGIT_BIAS_TOKENS",
    "MAX_PROMPTS", "MAX_REQUEST_ID_CHARS", "MAX_STOP_TOKEN_IDS", "RequestId", "Text", "TokenId", "check_request_id",
    "TokenText", "chat_logprobs", "completion_logprobs", "prompt_logprobs",
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "ContentPart", "GenerationBody", "ImagePart",
    "ImageURL", "Prompt", "ResponseFormat", "StreamOptions", "TextPart",
    "ChatChoice", "ChatCompletionChunk", "ChatCompletionResponse", "ChatLogprobEntry", "ChatLogprobs",
    "ChatResponseMessage", "ChatStreamChoice", "CompletionChoice", "CompletionLogprobs", "CompletionResponse",
    "DeltaMessage", "ErrorInfo", "ErrorResponse", "ModelCard", "ModelList", "PromptLogprob", "PromptLogprobs",
    "PromptTokensDetails", "TopLogprob", "UsageInfo",
    "DeltaFunctionCall", "DeltaToolCall", "FunctionCallOut", "ToolCallOut",
    "sampling_params",
    "DetokenizeRequest", "DetokenizeResponse", "TokenizeChatRequest", "TokenizeCompletionRequest", "TokenizeResponse",
]  # fmt: skip
