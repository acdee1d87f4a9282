"""The OpenAI error body of the balancer's HTTP API: APIError, and the handlers that
turn every failure (a refused request, a generator's error, a validation error, an
unknown URL, a client gone, anything unhandled) into one."""

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

# The bodies from their own file, not through protocol: protocol imports the request
# checks (sampling, structured_outputs), which raise APIError.
from services.balancer.frontend.response_bodies import ErrorInfo, ErrorResponse
from services.balancer.generation import GenerationError

log = logging.getLogger(__name__)

_CLIENT_GONE = 499  # nginx's "client closed request": seen only in metrics, the client has left


class APIError(Exception):
    """A request refused with an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> str:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump_json()

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, media_type="application/json")

    @classmethod
    def of_generation(cls, exc: GenerationError) -> "APIError":
        """A generator's failure as the client sees it, the parameter at fault included
        where the engine named one (a token id past the vocabulary)."""
        return cls(exc.status, str(exc), exc.error_type, param=exc.param, code=exc.code)


class ClientGone(Exception):
    """The client disconnected before the response started; its request was cancelled."""


def _where(error: dict[str, Any]) -> str:
    """The field's dotted path (messages.0.content), without pydantic's union tags (list[int], ...)
    nor a tagged union's member tag (messages.0.content.1, not messages.0.content.1.image_url)."""
    loc = [str(x) for x in error.get("loc", ()) if x != "body"]
    # After "tagged-union[...]" comes the member's tag; after "list[tagged-union[...]]", the index, then the tag.
    tags = {i + (2 if x.startswith("list[") else 1) for i, x in enumerate(loc) if "tagged-union[" in x}
    return ".".join(x for i, x in enumerate(loc) if "[" not in x and i not in tags)


def _wrong_type(error: dict[str, Any]) -> bool:
    return str(error.get("type")).endswith("_type")


def _validation_error(errors: Iterable[Any]) -> APIError:
    """FastAPI's 422 as OpenAI's 400, with pydantic's messages and param the first field at fault."""
    errors = list(errors)
    if any(e.get("type") == "json_invalid" for e in errors):
        return APIError(400, "The body is not valid JSON.")
    # A value that fits no member of a union fails each; the member it was meant for
    # says the useful thing (prompt [-1]: "greater than or equal to 0", not "a valid string").
    fields: dict[Any, list[Any]] = {}
    for error in errors:
        fields.setdefault(tuple(error.get("loc", ()))[:2], []).append(error)
    errors = [e for same in fields.values() for e in ([e for e in same if not _wrong_type(e)] or same)]
    parts: list[str] = []
    for error in errors[:5]:
        where = _where(error)
        if error.get("type") == "extra_forbidden":
            message = "not supported: this server refuses the fields it does not implement"
        else:
            message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    param = _where(errors[0]) if errors else ""
    return APIError(400, "; ".join(parts) or "Invalid request.", param=param or None)


def add_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def generation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, GenerationError)
        return APIError.of_generation(exc).response()

    async def validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(exc.errors()).response()

    async def http_error(http: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        message = f"Invalid URL ({http.method} {http.url.path})" if exc.status_code == 404 else str(exc.detail)
        return APIError(exc.status_code, message).response()

    async def client_gone(_: Request, exc: Exception) -> Response:
        return Response(status_code=_CLIENT_GONE)

    async def internal_error(_: Request, exc: Exception) -> Response:
        log.error("unhandled error", exc_info=exc)  # the traceback stays in the log, never in the body
        return APIError(500, "Internal server error.", "server_error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(GenerationError, generation_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(Exception, internal_error)


def check_model(model: str | None, names: Sequence[str]) -> None:
    """A request's model: left out (one model is served), or one of its served names; else a 404."""
    if model is not None and model not in names:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
