"""Messages in parts (shared/runtime/bus_parts.py): split within a server's
max_payload, put back together in any order, dropped when a part never comes or the
message passes the size bound; and a 1M-token prompt and its handoff as parts of
nats-server's default 1 MiB."""

import os

import pytest

from shared.kv.block_hash import HASH_BYTES
from shared.proto import mesh_pb2
from shared.runtime.bus_parts import (
    HEADER_ROOM_BYTES,
    PART_HEADER,
    MessageTooLarge,
    Part,
    PartsLost,
    Reassembler,
    header_value,
    parse_part,
    part_size,
    split,
)

NATS_DEFAULT_MAX_PAYLOAD = 1 << 20
MILLION = 1 << 20


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_split_sizes_and_headers_round_trip() -> None:
    data = os.urandom(2500)
    parts = split(data, 1000)
    assert [len(chunk) for _, chunk in parts] == [1000, 1000, 500]
    assert [p.index for p, _ in parts] == [0, 1, 2] and {p.count for p, _ in parts} == {3}
    assert len({p.message_id for p, _ in parts}) == 1
    assert b"".join(chunk for _, chunk in parts) == data
    assert parse_part({PART_HEADER: header_value(parts[1][0])}) == parts[1][0]
    assert parse_part({"traceparent": "x"}) is None and parse_part(None) is None
    assert [len(c) for _, c in split(b"x" * 1000, 1000)] == [1000]  # exactly one part's size: one message
    assert split(b"", 1000)[0][0].count == 1
    assert split(data, 1000)[0][0].message_id != parts[0][0].message_id  # a fresh id per message


@pytest.mark.parametrize("value", ["abc", "m/1", "m/3/3", "m/-1/3", "/0/2", "m/x/2"])
def test_a_malformed_part_header_is_refused(value: str) -> None:
    with pytest.raises(PartsLost, match="malformed"):
        parse_part({PART_HEADER: value})


def test_size_bound_on_both_ends() -> None:
    with pytest.raises(MessageTooLarge, match="1000-byte limit"):
        split(b"x" * 1001, 100, max_message_bytes=1000)
    assert len(split(b"x" * 1000, 100, max_message_bytes=1000)) == 10
    parts = Reassembler(max_message_bytes=250)
    first, second, third = split(b"y" * 300, 100)
    assert parts.add(*first) is None and parts.add(*second) is None
    with pytest.raises(PartsLost, match="250-byte bound"):
        parts.add(*third)
    assert parts.buffered_bytes == 0  # the message is dropped, not kept half-made
    with pytest.raises(ValueError, match="no room"):
        part_size(2 * HEADER_ROOM_BYTES)


def test_parts_are_put_together_in_any_order_and_messages_interleave() -> None:
    a, b = os.urandom(350), os.urandom(250)
    pa, pb = split(a, 100), split(b, 100)
    parts = Reassembler()
    got: list[bytes] = []
    # a's parts reordered, b's interleaved with them
    for part, chunk in (pa[2], pb[0], pa[0], pb[1], pa[3], pa[1], pb[2]):
        whole = parts.add(part, chunk)
        if whole is not None:
            got.append(whole)
    assert got == [a, b]
    assert parts.buffered_bytes == 0


def test_a_duplicate_or_inconsistent_part_drops_the_message() -> None:
    parts = Reassembler()
    first, second, _ = split(b"z" * 250, 100)
    parts.add(*first)
    with pytest.raises(PartsLost, match="does not fit"):
        parts.add(*first)
    parts.add(*second)  # a new message under that id now; its count is 3
    with pytest.raises(PartsLost, match="does not fit"):
        parts.add(Part(second[0].message_id, 0, 2), b"q")


def test_a_missing_part_times_out_and_the_message_is_dropped() -> None:
    clock = FakeClock()
    parts = Reassembler(timeout_s=10.0, clock=clock)
    lost = split(b"a" * 300, 100)
    kept = split(b"b" * 300, 100)
    assert parts.add(*lost[0]) is None and parts.add(*lost[2]) is None  # part 1 never comes
    clock.now += 9.0
    assert parts.add(*kept[0]) is None
    assert parts.expire() == []  # 9 s: still waiting
    clock.now += 2.0
    assert parts.expire() == [lost[0][0].message_id]
    assert parts.num_expired == 1
    assert parts.buffered_bytes == 100  # kept's first part, which is 2 s old
    assert parts.add(*kept[1]) is None and parts.add(*kept[2]) == b"b" * 300
    # A late part of the dropped message starts it anew and never completes it.
    assert parts.add(*lost[1]) is None


def test_a_million_token_prompt_and_its_handoff_go_as_parts_of_one_mib() -> None:
    # Token ids are packed varints: ids below 2**21 (every real vocabulary) take at most
    # 3 bytes, so a 1M-token prompt is ~3 MB, not the ~7 MB of a JSON list.
    ids = [(i * 7919) % 150_000 for i in range(MILLION)]
    request = mesh_pb2.PrefillRequest(request_id="cmpl-" + "f" * 32, prompt_token_ids=ids)
    data = request.SerializeToString()
    assert 2 * MILLION < len(data) <= 3 * MILLION + 64
    num_blocks = MILLION // 16
    handoff = mesh_pb2.DecodeHandoff(
        request_id="cmpl-" + "f" * 32, prompt_token_ids=ids, output_token_ids=[7],
        block_hashes=[b"\xff" * HASH_BYTES] * num_blocks,
        kv_source=mesh_pb2.KvSource(block_ids=list(range(num_blocks)), num_blocks=num_blocks),
    )  # fmt: skip
    size = part_size(NATS_DEFAULT_MAX_PAYLOAD)
    for message in (request, handoff):
        data = message.SerializeToString()
        parts = split(data, size)
        assert len(parts) == -(-len(data) // size) > 1
        assert all(len(chunk) + HEADER_ROOM_BYTES <= NATS_DEFAULT_MAX_PAYLOAD for _, chunk in parts)
        joined = Reassembler()
        wholes = [w for w in (joined.add(p, c) for p, c in parts) if w is not None]
        back = type(message)()
        back.ParseFromString(wholes[0])
        assert len(wholes) == 1 and len(back.prompt_token_ids) == MILLION and back.prompt_token_ids[-1] == ids[-1]
