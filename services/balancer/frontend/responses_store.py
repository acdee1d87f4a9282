"""Where /v1/responses keeps a stored response: the interface the frontend is given.

A stored response is its response object (what GET /v1/responses/{id} returns) and
the conversation it closed (the chat messages of its input, earlier turns
included, and of its output), so that a request naming it as previous_response_id
continues that conversation. The store must outlive one balancer and be shared by
all of them (a follow-up may reach another balancer): the mesh's is NATS
JetStream's key-value store (services/balancer/response_kv.py); the frontend sees
only this Protocol, so it never imports the NATS side.
"""

import json
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    """The response object as the API returned it."""
    messages: list[dict[str, Any]]
    """The conversation up to and including this response's output, as chat messages
    (instructions excluded: OpenAI does not carry them over to the next turn)."""

    def to_bytes(self) -> bytes:
        return json.dumps({"response": self.response, "messages": self.messages}, ensure_ascii=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "StoredResponse":
        value = json.loads(data)
        return cls(response=value["response"], messages=value["messages"])


class ResponseStore(Protocol):
    async def get(self, response_id: str) -> StoredResponse | None:
        """The response, or None if unknown, deleted or expired."""
        ...

    async def put(self, response_id: str, stored: StoredResponse) -> None: ...

    async def delete(self, response_id: str) -> bool:
        """False when there was nothing to delete."""
        ...


class MemoryResponseStore:
    """A store in this process only: for the local generator (one process, one
    balancer) and unit tests. The mesh uses JetStream's (several balancers)."""

    def __init__(self) -> None:
        self._items: dict[str, bytes] = {}

    async def get(self, response_id: str) -> StoredResponse | None:
        data = self._items.get(response_id)
        return None if data is None else StoredResponse.from_bytes(data)

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = stored.to_bytes()

    async def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
