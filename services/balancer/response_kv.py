"""The Responses store of the mesh: NATS JetStream's key-value store, one bucket
shared by every balancer (a previous_response_id may reach any of them), entries
expiring after the bucket's TTL (the stream's max_age).

The balancer's NATS user may touch this bucket only (tools/launch/nats_auth.py
grants `$KV.<bucket>.>` and the JetStream API calls on its stream, nothing else of
JetStream); workers cannot read it. Keys are response ids (resp_<hex>), which are
valid KV keys as they are.
"""

import logging

from nats.aio.client import Client as NATS
from nats.js.errors import BadRequestError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from services.balancer.frontend.responses_store import StoredResponse

log = logging.getLogger(__name__)


class JetStreamResponseStore:
    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    @classmethod
    async def open(cls, nc: NATS, bucket: str, ttl_s: float) -> "JetStreamResponseStore":
        """The bucket, made if missing. Another balancer may have made it already with
        another TTL: the existing bucket is then used as it is (and that is logged)."""
        js = nc.jetstream()
        try:
            kv = await js.create_key_value(bucket=bucket, ttl=ttl_s, history=1)
        except BadRequestError as exc:
            log.warning("responses bucket %s exists with other settings (%s): using it as it is", bucket, exc)
            kv = await js.key_value(bucket)
        return cls(kv)

    async def get(self, response_id: str) -> StoredResponse | None:
        try:
            entry = await self.kv.get(response_id)
        except (KeyNotFoundError, NotFoundError):
            return None
        if entry.value is None:
            return None
        return StoredResponse.from_bytes(entry.value)

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        await self.kv.put(response_id, stored.to_bytes())

    async def delete(self, response_id: str) -> bool:
        if await self.get(response_id) is None:
            return False
        await self.kv.delete(response_id)
        return True


class UnavailableResponseStore:
    """What the balancer serves with when the bucket cannot be opened (a NATS without
    JetStream, a user without the grants): every other endpoint still works; a
    response is answered but not kept, and previous_response_id, GET and DELETE
    answer 503 (the frontend maps the error) rather than the balancer not starting."""

    def __init__(self, why: str) -> None:
        self.why = why

    async def get(self, response_id: str) -> StoredResponse | None:
        raise RuntimeError(f"no responses store: {self.why}")

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        raise RuntimeError(f"no responses store: {self.why}")

    async def delete(self, response_id: str) -> bool:
        raise RuntimeError(f"no responses store: {self.why}")


async def open_response_store(
    nc: NATS, bucket: str, ttl_s: float
) -> "JetStreamResponseStore | UnavailableResponseStore":
    try:
        return await JetStreamResponseStore.open(nc, bucket, ttl_s)
    except Exception as exc:  # nats-py's errors and timeouts alike
        log.error("responses bucket %s cannot be opened (%r): /v1/responses stores nothing", bucket, exc)
        return UnavailableResponseStore(repr(exc))
