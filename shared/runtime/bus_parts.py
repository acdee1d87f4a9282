"""Messages larger than one NATS message, in parts (DESIGN.md, Two planes: "long
prompts and handoffs go in chunks"). A NATS server refuses a message past its
max_payload (1 MiB by default, headers included), while a 1M-token prompt is ~3 MB
of protobuf (token ids are packed varints: at most 3 bytes each below 2**21) and its
handoff to decode ~6 MB with the block hashes. The Bus (bus.py) splits such a
message's bytes into parts that each fit, sent in order on the message's own subject
with an `Im-Part` header; the receiving subscription puts them back together and
handles the whole message once, as if it had come in one piece. A request's reply
inbox rides the last part, so permissions, subjects and replies are the same as for
a small message.

NATS keeps one publisher's messages in order to a subscriber, so parts come in order;
the reassembler still places them by index. A message whose parts stop coming (a
publisher that died mid-message, a reconnect that lost some) is dropped after
PART_TIMEOUT_S, and nothing past MAX_MESSAGE_BYTES is sent or buffered."""

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

PART_HEADER = "Im-Part"
"""`<message id>/<index>/<count>` on each part of a message sent in parts."""
HEADER_ROOM_BYTES = 16 << 10
"""What a part leaves of max_payload for its headers (the trace context, Im-Part, a
reply subject): nats-server counts headers against max_payload, nats-py does not."""
MAX_MESSAGE_BYTES = 128 << 20
"""The largest message sent in parts, and what one subscription buffers at most: a
1M-token handoff is ~6 MB, so this leaves room for long prompts' logprobs and images."""
PART_TIMEOUT_S = 10.0
"""How long a partly received message waits for its next part before it is dropped."""


class MessageTooLarge(ValueError):
    """A message past MAX_MESSAGE_BYTES: not sent."""


class PartsLost(Exception):
    """A part that cannot belong to a message being put together (malformed, past the
    size bound, a count that changed): the message is dropped."""


@dataclass(frozen=True, slots=True)
class Part:
    message_id: str
    index: int
    count: int


def part_size(max_payload: int) -> int:
    """Bytes of message per part under a server's max_payload."""
    if max_payload <= 2 * HEADER_ROOM_BYTES:
        raise ValueError(f"max_payload {max_payload} leaves no room for parts (at least {2 * HEADER_ROOM_BYTES + 1})")
    return max_payload - HEADER_ROOM_BYTES


def split(data: bytes, size: int, max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[Part, bytes]]:
    """data as parts of at most size bytes, each with its header value; one part
    (index 0 of 1) only when data fits. MessageTooLarge past max_message_bytes."""
    if len(data) > max_message_bytes:
        raise MessageTooLarge(f"a message of {len(data)} bytes passes the mesh's {max_message_bytes}-byte limit")
    view = memoryview(data)
    count = max(1, -(-len(data) // size))
    message_id = uuid.uuid4().hex
    return [(Part(message_id, i, count), bytes(view[i * size : (i + 1) * size])) for i in range(count)]


def header_value(part: Part) -> str:
    return f"{part.message_id}/{part.index}/{part.count}"


def parse_part(headers: Mapping[str, str] | None) -> Part | None:
    """The part a message's headers name; None for a whole message. PartsLost when malformed."""
    value = (headers or {}).get(PART_HEADER)
    if value is None:
        return None
    try:
        message_id, index, count = value.split("/")
        part = Part(message_id, int(index), int(count))
    except ValueError:
        raise PartsLost(f"malformed {PART_HEADER} header {value[:80]!r}") from None
    if not message_id or not 0 <= part.index < part.count:
        raise PartsLost(f"malformed {PART_HEADER} header {value[:80]!r}")
    return part


@dataclass(slots=True)
class _Partial:
    count: int
    parts: dict[int, bytes] = field(default_factory=dict)
    num_bytes: int = 0
    last_seen: float = 0.0


class Reassembler:
    """Puts one subscription's messages back together from their parts. Not thread-safe:
    one per subscription, fed from its callback."""

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES, timeout_s: float = PART_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        self.clock = clock
        self._partial: dict[str, _Partial] = {}
        self.num_expired = 0
        """Messages dropped because a part never came."""

    @property
    def buffered_bytes(self) -> int:
        return sum(p.num_bytes for p in self._partial.values())

    def add(self, part: Part, data: bytes) -> bytes | None:
        """The whole message once its last missing part is in, else None. PartsLost
        (and the message dropped) for a part that does not fit the message or the
        size bound. Messages that waited past the timeout are dropped first."""
        now = self.clock()
        self.expire(now)
        if part.count == 1:
            return data
        partial = self._partial.get(part.message_id)
        if partial is None:
            partial = self._partial[part.message_id] = _Partial(part.count)
        if partial.count != part.count or part.index in partial.parts:
            del self._partial[part.message_id]
            raise PartsLost(f"part {part.index} of message {part.message_id} does not fit it (count, duplicate)")
        partial.num_bytes += len(data)
        if partial.num_bytes > self.max_message_bytes or self.buffered_bytes > self.max_message_bytes:
            del self._partial[part.message_id]
            raise PartsLost(f"message {part.message_id} passes the {self.max_message_bytes}-byte bound")
        partial.parts[part.index] = data
        partial.last_seen = now
        if len(partial.parts) < partial.count:
            return None
        del self._partial[part.message_id]
        return b"".join(partial.parts[i] for i in range(partial.count))

    def expire(self, now: float | None = None) -> list[str]:
        """Drop the messages whose next part has not come for timeout_s; their ids."""
        now = self.clock() if now is None else now
        gone = [mid for mid, p in self._partial.items() if now - p.last_seen > self.timeout_s]
        for mid in gone:
            del self._partial[mid]
        self.num_expired += len(gone)
        return gone
