"""The contract between the HTTP layer and whatever generates tokens.

The HTTP layer (frontend/api.py) turns an OpenAI request into a GenerationRequest, then
iterates a Generator's events; it owns text: detokenization and stop strings.
Two generators exist: the mesh (router/orchestrator.py: prefill and decode instances
over NATS) and a local engine (local.py: an in-process engine thread, for one
machine or tests of the HTTP layer). Closing the iteration early (a stop string
matched, the client went away) cancels the request everywhere.
"""

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from shared.engine.outputs import TokenLogprobs
from shared.engine.sampling_params import SamplingParams
from shared.multimodal.image import LoadedImage


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    """Stop strings stay with the HTTP layer; the generator sees token-level settings."""
    cache_salt: str | None = None
    priority: int = 0
    """Lower goes first where requests wait for a place (the balancer's queue)."""
    images: list[LoadedImage] = field(default_factory=list)
    """The chat request's images in the order they appear, loaded and named by their hash
    (only for a model whose architecture accepts images); prompt_token_ids holds each
    one's placeholder run, expanded by the front door. The local generator runs the
    model's image processor and hands them to its engine; the mesh sends them to the
    prefill instance, which does (router/wire.py)."""


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    spec_drafted_tokens: int = 0
    """Speculative decoding: drafted tokens verified for the request, and accepted."""
    spec_accepted_tokens: int = 0
    reasoning_tokens: int = 0
    """Of completion_tokens, those in the reasoning (the balancer counts them: reasoning_parsers/count.py)."""


@dataclass(slots=True)
class TokenEvent:
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    """Set on the last event only: "stop", "length" or "abort"."""
    usage: Usage | None = None
    """Usage so far, when the generator knows it (always on the last event). The
    first event should carry it too: a stop string may end the stream early."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """On the first event of a request with params.prompt_logprobs: one entry per
    prompt token, None for the first (nothing predicts it)."""


class GenerationError(Exception):
    """A request could not be served. status is the HTTP status to answer with; param
    the request parameter at fault, where the engine named one (InvalidParam)."""

    def __init__(
        self, message: str, status: int = 503, error_type: str = "service_unavailable", param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.param = param
        self.code = code
        """OpenAI's error code for the body, where one says more than the type (invalid_image)."""


class Generator(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]: ...

    def num_in_flight(self) -> int: ...
