"""The HTTP API's guard in front of the app: API key, body size, requests counter."""

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.balancer.frontend.errors import APIError
from services.balancer.frontend.http_metrics import HttpMetrics

_ENDPOINTS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize", "/detokenize",
    "/tokenizer_info", "/version", "/ping", "/openapi.json", "/docs", "/reset_prefix_cache",
})
_PROTECTED = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info", "/reset_prefix_cache")
"""Paths that need the API key: the model's use, its tokenizer and the prefix-cache reset; health,
version and the schema do not."""


# -- the guard: API key, body size, requests counter -------------------------------
# Pure ASGI rather than BaseHTTPMiddleware, so streaming and disconnects pass untouched.


class Guard:
    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, stats: HttpMetrics) -> None:
        self.app = app
        self.expected_auth = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client gets if the app raises before answering

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._guard(scope, receive, send_and_note)
        finally:
            endpoint = scope["path"] if scope["path"] in _ENDPOINTS else "other"  # bounded label values
            self.stats.requests.labels(endpoint, str(status)).inc()

    async def _guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        if self.expected_auth is not None and scope["path"].startswith(_PROTECTED):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected_auth):
                message = "Incorrect or missing API key: send the header Authorization: Bearer <key>."
                await _send_error(send, APIError(401, message, code="invalid_api_key"))
                return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            message = f"The request body is over {self.max_body_bytes} bytes."
            too_large = APIError(413, message, code="request_too_large")
            length = headers.get(b"content-length", b"")
            if length.isdigit() and int(length) > self.max_body_bytes:
                await _send_error(send, too_large)
                return
            # Content-Length can be absent (chunked) or lie: count what actually arrives.
            chunks: list[bytes] = []
            size = 0
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > self.max_body_bytes:
                    await _send_error(send, too_large)
                    return
                more = message.get("more_body", False)
            receive = _replay(b"".join(chunks), receive)
        await self.app(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The already read body first, then the real channel (so the app still hears http.disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


async def _send_error(send: Send, error: APIError) -> None:
    body = error.body().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
