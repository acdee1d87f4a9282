"""The fields that only label a request: accepted, recorded on its span, never acted on.

Clients send them unasked (the openai SDK passes `user`, `metadata`, `store` and
`service_tier` through from agent frameworks; LangChain's ChatOpenAI sets `store`
and `service_tier` when configured), and vLLM accepts them. They change nothing
about the output, so refusing them would only break those clients. The values
that would change what the server does are still refused, with the reason:
`store: true` (chat completions are not kept here; /v1/responses keeps responses)
and a service tier other than auto/default (this mesh has one tier).
"""

from typing import Annotated

from pydantic import AfterValidator, Field, field_validator

from services.balancer.frontend.body_fields import StrictBody, Text, valid_unicode

MAX_METADATA_PAIRS = 16
"""OpenAI's limits on metadata: 16 pairs, keys up to 64 characters, values up to 512."""
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_LABEL_CHARS = 512
"""user and safety_identifier: an id, not a document (they are copied onto the span)."""
SERVICE_TIERS = ("auto", "default")
"""The tiers that name what every request here gets: there is one tier."""

MetadataKey = Annotated[str, Field(min_length=1, max_length=MAX_METADATA_KEY_CHARS), AfterValidator(valid_unicode)]
MetadataValue = Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS), AfterValidator(valid_unicode)]
Label = Annotated[str, Field(max_length=MAX_LABEL_CHARS), AfterValidator(valid_unicode)]


class LabelledBody(StrictBody):
    """A generation request's labels (OpenAI's names); span_attributes records them."""

    user: Label | None = None
    """OpenAI's end-user id (deprecated there for safety_identifier and prompt_cache_key)."""
    safety_identifier: Label | None = None
    """OpenAI's: a stable, hashed id of the end user."""
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA_PAIRS)] | None = None
    """OpenAI's: up to 16 string pairs that label the request."""
    service_tier: Text | None = None
    """auto or default (the one tier here); flex and priority are refused."""
    store: bool | None = None
    """Only false: chat and completions are not stored (a 400 for true)."""

    @field_validator("service_tier")
    @classmethod
    def _one_tier(cls, tier: str | None) -> str | None:
        if tier is not None and tier not in SERVICE_TIERS:
            raise ValueError(
                f"{tier!r} is not offered: this server has no service tiers (every request is served alike); "
                f"send one of {list(SERVICE_TIERS)} or leave it out"
            )
        return tier

    @field_validator("store")
    @classmethod
    def _not_stored(cls, store: bool | None) -> bool | None:
        if store:
            raise ValueError(
                "true is not supported: chat completions and completions are not stored here (send false or "
                "leave it out); for responses kept and retrievable by id use /v1/responses with store: true"
            )
        return store

    def span_attributes(self) -> dict[str, str]:
        """The labels as span attributes (request.user, request.metadata.<key>, ...)."""
        out: dict[str, str] = {}
        for name in ("user", "safety_identifier", "service_tier"):
            value = getattr(self, name)
            if value is not None:
                out[f"request.{name}"] = value
        for key, value in (self.metadata or {}).items():
            out[f"request.metadata.{key}"] = value
        return out
