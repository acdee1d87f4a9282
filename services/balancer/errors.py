"""The OpenAI error body of the balancer's HTTP API: APIError, and the handlers that
turn every failure (a refused request, a generator's error, a validation error, an
unknown URL, a client gone, anything unhandled) into one."""

import logging
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.balancer import protocol as p
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
        info = p.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return p.ErrorResponse(error=info).model_dump_json()

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, media_type="application/json")


class ClientGone(Exception):
    """The client disconnected before the response started; its request was cancelled."""


def _validation_error(errors: Iterable[Any]) -> APIError:
    """FastAPI's 422 as OpenAI's 400, with pydantic's messages."""
    parts: list[str] = []
    params: list[str] = []
    for error in list(errors)[:5]:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc)}: {message}" if loc else message)
        params += loc[:1]
    return APIError(400, "; ".join(parts) or "Invalid request.", param=params[0] if params else None)


def add_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def generation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, GenerationError)
        return APIError(exc.status, str(exc), exc.error_type).response()

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
