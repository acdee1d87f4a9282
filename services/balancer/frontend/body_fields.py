"""The field types, limits and checks that the API's request bodies share.

Types are strict (no 0 for false, no "5" for 5), floats finite, strings valid
Unicode, and values bounded where they cross NATS (token ids are uint32 there; a
message is at most 1 MiB). A check that two bodies need is written here once, as
an annotated type, so completions, chat and /tokenize cannot drift apart.
"""

import json
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo

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
MAX_IMAGE_UUID_CHARS = 256
"""A client's name for an image (the uuid of an image_url part); it goes into the image's hash."""


class StrictBody(BaseModel):
    """A request body: unknown fields refused, no type coercion, no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def valid_unicode(text: str) -> str:
    # JSON can spell a lone surrogate ("\ud800"), which no UTF-8 tokenizer or encoder takes.
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"not valid Unicode: a lone surrogate at character {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(valid_unicode)]
TokenId = Annotated[int, Field(ge=0, lt=1 << 32)]
"""A uint32 on the wire; the engine refuses ids past the model's vocabulary."""


def check_request_id(value: str) -> str:
    # It names the response (cmpl-<id>) and the x-request-id header: printable ASCII only.
    if not value or not all(c.isascii() and c.isprintable() and c != " " for c in value):
        raise ValueError("must be printable ASCII without spaces")
    return value


RequestId = Annotated[str, Field(max_length=MAX_REQUEST_ID_CHARS), AfterValidator(check_request_id)]


def _token_id_keys(logit_bias: dict[str, float]) -> dict[str, float]:
    for key in logit_bias:
        if not key.isdigit() or int(key) >= 1 << 32:
            raise ValueError(f"keys must be token ids (integers as strings), got {key!r}")
    return logit_bias


LogitBias = Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS_TOKENS), AfterValidator(_token_id_keys)]
"""Token id (as a string) to a bias added to its logit."""


def _not_with_generation_prompt(value: bool, info: ValidationInfo) -> bool:
    # add_generation_prompt is declared before continue_final_message in every body that has both.
    if value and info.data.get("add_generation_prompt"):
        raise ValueError("cannot be true with add_generation_prompt: true (set it to false)")
    return value


ContinueFinalMessage = Annotated[bool, AfterValidator(_not_with_generation_prompt)]
"""vLLM's continue_final_message: leave the last (assistant) message open, so the reply continues it."""


def _valid_unicode_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    try:  # every string in it, however deep
        json.dumps(kwargs, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode: a string in it holds a lone surrogate") from None
    return kwargs


ChatTemplateKwargs = Annotated[dict[Text, Any], AfterValidator(_valid_unicode_kwargs)]
"""vLLM's chat_template_kwargs: extra template variables (e.g. enable_thinking)."""
