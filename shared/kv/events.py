"""Block events on the bus: the hashes a cache took in and let go, for cache-aware
routing. A worker publishes its prefix cache's changes every few tens of ms and,
now and then, a snapshot of all it holds (`cleared` on the first message: the
listener drops what it knew of that instance first). Deltas alone would let a
listener's view drift for good: a message lost in a NATS reconnect, or a balancer
restarted after the worker, never hears of blocks stored before. A snapshot bounds
that to one snapshot interval; the sequence numbers let the listener count gaps.

A message holds at most MAX_EVENT_HASHES hashes of each kind: a snapshot of a large
cache goes out as several messages with consecutive sequence numbers.
"""

from collections.abc import Sequence

from shared.kv.block_hash import BlockHash
from shared.proto import mesh_pb2

MAX_EVENT_HASHES = 4096
"""Hashes per KvEvent and kind: 4096 x ~34 bytes stays far below NATS's 1 MiB payload limit."""


def kv_event_messages(
    instance_id: str, first_seq: int, stored: Sequence[BlockHash], removed: Sequence[BlockHash], cleared: bool = False
) -> list[mesh_pb2.KvEvent]:
    """The events that say it, numbered from first_seq; the first carries cleared.
    Nothing to say (no hash and not cleared): no message."""
    events = []
    for start in range(0, max(len(stored), len(removed), 1 if cleared else 0), MAX_EVENT_HASHES):
        end = start + MAX_EVENT_HASHES
        events.append(mesh_pb2.KvEvent(
            instance_id=instance_id, seq=first_seq + len(events), stored=stored[start:end],
            removed=removed[start:end], cleared=cleared and start == 0,
        ))  # fmt: skip
    return events
