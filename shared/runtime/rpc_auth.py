"""Who calls a gRPC server, and what it may call: a token per identity, checked
by every server of the mesh (shared/runtime/rpc.py installs the check).

Each gRPC client of the mesh has an identity (prefill, decode, vision, balancer:
IDENTITIES) and a random token of its own (worker.grpc_token), sent as
`authorization: Bearer <token>`. A server knows the identities by the SHA-256 of
their tokens (worker.grpc_peers, `identity:hex,identity:hex`), never the tokens:

- no service holds anything that makes another's credentials (unlike one secret
  from which per-identity tokens are derived by HMAC, which every server, the
  workers included, would have to hold, and which would let a prefill mint a
  decode's token);
- the peers list is not secret (hashes of 192-bit random values), so it is the
  same one line for every service of a deployment: the operator hands each
  service its own token and everyone the one list, and a leaked token is
  replaced alone (its token and its line).

A call with no token or one not in the list is refused UNAUTHENTICATED; a server
given an access table (kvcache, services/kvcache/access.py) refuses an identity
that a method is not for with PERMISSION_DENIED, and a method the table does not
name for everyone: closed by default. grpc.health.v1 stays open (Kubernetes'
and compose's probes cannot send metadata; it tells one bit).

Fail closed: a server bound beyond loopback refuses to start without a peers
list (require_credentials): with no list, nothing is checked, which only a
server only this host can reach may do (tests that start a service by hand).
Mutual TLS (worker.tls_*) comes on top: it keeps the plane private and
authenticates the machine, the token names the caller's role."""

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from shared.runtime.settings import is_loopback

IDENTITIES = ("prefill", "decode", "vision", "balancer")
"""The mesh's gRPC clients, one token each (what `up`, compose and Helm make)."""

AUTH_HEADER = "authorization"
OPEN_METHOD_PREFIX = "/grpc.health.v1.Health/"
"""Methods that need no token (probes cannot send one)."""

Access = Mapping[str, frozenset[str]]
"""A server's table: full method name (/package.Service/Method) -> the identities that may call it."""


def token_digest(token: str) -> str:
    """What a peers list holds of a token: its SHA-256, hex."""
    return hashlib.sha256(token.encode()).hexdigest()


def peers_setting(tokens: Mapping[str, str]) -> str:
    """worker.grpc_peers for these tokens (identity -> token)."""
    return ",".join(f"{identity}:{token_digest(token)}" for identity, token in tokens.items())


@dataclass(frozen=True, slots=True)
class Peers:
    """The identities a server knows, by the digest of their tokens."""

    by_digest: Mapping[str, str]

    @classmethod
    def parse(cls, text: str | None) -> "Peers | None":
        """worker.grpc_peers read; None when unset or empty; a ValueError saying what is wrong otherwise."""
        if not text or not text.strip():
            return None
        by_digest: dict[str, str] = {}
        for entry in text.split(","):
            identity, sep, digest = entry.strip().partition(":")
            digest = digest.lower()
            if not sep or not identity or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"worker.grpc_peers: {entry.strip()!r} is not identity:<sha256 hex of its token>")
            if digest in by_digest:
                raise ValueError(f"worker.grpc_peers: {by_digest[digest]} and {identity} have the same token")
            by_digest[digest] = identity
        return cls(by_digest)

    @property
    def identities(self) -> frozenset[str]:
        return frozenset(self.by_digest.values())

    def identity(self, metadata: Any) -> str | None:
        """Whose token the call's metadata carries; None: none, or one not known. The
        lookup is by the token's digest: its timing tells nothing of the token itself."""
        for key, value in metadata or ():
            if key != AUTH_HEADER:
                continue
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme == "Bearer" and token and (found := self.by_digest.get(token_digest(token))):
                return found
        return None


def require_credentials(host: str, peers: Peers | None) -> None:
    """Fail closed: a server reachable beyond this host must know who calls it."""
    if peers is None and not is_loopback(host):
        raise ValueError(
            f"refusing to serve gRPC on {host} (beyond loopback) without credentials: set worker.grpc_peers "
            "(identity:sha256-of-token pairs; `python -m deploy.nats_users --env` makes them), or bind "
            "worker.bind_host to 127.0.0.1")


def _refusal(code: grpc.StatusCode, message: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same call shape that aborts with code before anything runs."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover  (makes this an async generator)

    make: Callable[..., grpc.RpcMethodHandler]
    if handler.request_streaming and handler.response_streaming:
        make, behaviour = grpc.stream_stream_rpc_method_handler, streaming
    elif handler.request_streaming:
        make, behaviour = grpc.stream_unary_rpc_method_handler, unary
    elif handler.response_streaming:
        make, behaviour = grpc.unary_stream_rpc_method_handler, streaming
    else:
        make, behaviour = grpc.unary_unary_rpc_method_handler, unary
    return make(behaviour)


class IdentityInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call whose token is not a known identity's (UNAUTHENTICATED) and,
    with an access table, one from an identity the method is not for (PERMISSION_DENIED)."""

    def __init__(self, peers: Peers, access: Access | None = None) -> None:
        self.peers = peers
        self.access = access

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):  # noqa: ANN001
        handler = await continuation(details)
        if details.method.startswith(OPEN_METHOD_PREFIX) or handler is None:
            return handler  # health; or an unknown method: UNIMPLEMENTED either way
        identity = self.peers.identity(details.invocation_metadata)
        if identity is None:
            return _refusal(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token", handler)
        if self.access is not None and identity not in self.access.get(details.method, frozenset()):
            return _refusal(grpc.StatusCode.PERMISSION_DENIED, f"{identity} may not call {details.method}", handler)
        return handler
