"""Image embeddings READ out of a vision instance's arena through NIXL (UCX on the
CPU), where the arena cannot be mapped (shared/stage/embedding_nixl.py): the vision
side registers its arena with its agent, the reader adds that agent's metadata once
and reads an entry into a landing buffer of its own. Both agents live in this process
here (as tests/unit/test_nixl_transfer.py's); tests/mesh/test_mesh_vision_nixl.py
runs them in separate PID namespaces. Checked: equal bytes; an entry the ring came
round to, or one rewritten between the copy and the header read after it (the
seqlock), is refused with ValueError; and StageImages falls to NIXL where the arena
does not map, and to kvcache (refused) where NIXL refuses too."""

import dataclasses
import os

import pytest

from shared.kv.wire.nixl import NixlAgent, agent_name
from shared.proto import mesh_pb2
from shared.stage.embedding_nixl import ArenaRoute, NixlArenaReader, offer_arena
from shared.stage.embedding_share import HEADER, EmbeddingArena, EmbeddingSource
from shared.stage.images import StageImages
from tests.helpers.nixl_wheel import skip_without_nixl

skip_without_nixl()

ENTRY = 300_000
"""An entry's data: three fit the 1 MiB arena, a fourth comes round to the first."""


class Side:
    """A vision instance's arena offered through its agent, and a reader with its own agent."""

    def __init__(self) -> None:
        self.arena = EmbeddingArena(1 << 20)
        self.vision = NixlAgent(agent_name("vision-0"), loopback_only=True)
        registration = offer_arena(self.arena, self.vision, "vision-0")
        self.asks: list[str] = []

        def fetch(instance_id: str) -> bytes:
            self.asks.append(instance_id)
            return self.vision.metadata(only=registration)

        self.agent = NixlAgent(agent_name("prefill-0"), loopback_only=True)
        self.reader = NixlArenaReader(self.agent, fetch, timeout_s=30.0)

    def close(self) -> None:
        self.reader.close()
        self.agent.close()
        self.vision.close()
        self.arena.close()


@pytest.fixture
def side():
    s = Side()
    yield s
    s.close()


def key(k: int) -> bytes:
    return bytes([k]) * 32


def test_an_entry_read_through_nixl_has_the_arenas_bytes_and_the_metadata_is_asked_once(side):
    data = [os.urandom(ENTRY), os.urandom(1000)]
    sources = [side.arena.put(key(k), f"emb1;k{k}", d) for k, d in enumerate(data)]
    assert all(s is not None and s.nixl for s in sources)
    for k, source in enumerate(sources):
        assert side.reader.read(key(k), EmbeddingSource.from_bytes(source.to_bytes())) == (f"emb1;k{k}", data[k])
    assert side.asks == ["vision-0"]
    assert side.reader.num_bytes_read == sum(2 * HEADER.size + len(d) for d in data)


def test_an_entry_the_ring_came_round_to_is_refused(side):
    first = side.arena.put(key(1), "emb1;a", os.urandom(ENTRY))
    for k in range(2, 5):  # the fourth entry wraps to the arena's start, over the first
        side.arena.put(key(k), "emb1;b", os.urandom(ENTRY))
    assert side.arena.get(key(1)) is None
    with pytest.raises(ValueError, match="no longer holds"):
        side.reader.read(key(1), first)
    # The generation alone tells: the same identity written anew is another entry.
    again = side.arena.put(key(1), "emb1;a", os.urandom(ENTRY))
    assert again.offset != first.offset or again.generation != first.generation
    with pytest.raises(ValueError, match="no longer holds"):
        side.reader.read(key(1), dataclasses.replace(first, offset=again.offset))


def test_an_entry_rewritten_during_the_copy_is_refused_by_the_header_read_after_it(side, monkeypatch):
    source = side.arena.put(key(1), "emb1;a", os.urandom(ENTRY))
    read, calls = side.agent.read, []

    def racing_read(*args, **kwargs):  # the ring comes round between the copy and the second header read
        calls.append(args[1][0, 1])
        moved = read(*args, **kwargs)
        if len(calls) == 1:
            for k in range(2, 5):
                side.arena.put(key(k), "emb1;b", os.urandom(ENTRY))
        return moved

    monkeypatch.setattr(side.agent, "read", racing_read)
    with pytest.raises(ValueError, match="overwritten during the copy"):
        side.reader.read(key(1), source)
    assert calls == [HEADER.size + ENTRY, HEADER.size]


def test_no_metadata_or_a_bad_description_is_a_valueerror(side):
    source = side.arena.put(key(1), "emb1;a", os.urandom(100))
    lost = NixlArenaReader(side.agent, lambda iid: (_ for _ in ()).throw(TimeoutError("no answer")), 5.0)
    with pytest.raises(ValueError, match="no NIXL metadata from vision-0"):
        lost.read(key(1), dataclasses.replace(source, nixl=source.nixl.replace(side.vision.name, "vision-0-other")))
    for bad in ("", "{}", '{"instance": "a.b", "agent": "x", "address": 1, "nbytes": 1}',
                '{"instance": "v", "agent": "x y", "address": 1, "nbytes": 1}',
                '{"instance": "v", "agent": "x", "address": 0, "nbytes": 1}'):  # fmt: skip
        with pytest.raises(ValueError):
            side.reader.read(key(1), dataclasses.replace(source, nixl=bad))
    route = ArenaRoute.parse(source.nixl)
    with pytest.raises(ValueError, match="past the arena's end"):
        side.reader.read(key(1), dataclasses.replace(source, offset=route.nbytes - HEADER.size))


def test_stage_images_reads_through_nixl_where_the_arena_does_not_map_and_refuses_a_lost_entry(side):
    data = os.urandom(5000)
    source = side.arena.put(key(1), "emb1;a", data)
    elsewhere = dataclasses.replace(source, region='{"kind": "elsewhere"}')  # a description this process cannot map
    images = StageImages(None, nixl=side.reader)
    held, ways, refused = images._read_peers([mesh_pb2.ImageData(hash=key(1), peer_source=elsewhere.to_bytes())])
    assert (held, ways, refused) == ({key(1): ("emb1;a", data)}, {key(1): "nixl"}, [])
    # Mapped where it can be: the same-namespace copy first.
    held, ways, _ = images._read_peers([mesh_pb2.ImageData(hash=key(1), peer_source=source.to_bytes())])
    assert ways == {key(1): "peer"} and held[key(1)] == ("emb1;a", data)
    for k in range(2, 6):
        side.arena.put(key(k), "emb1;b", os.urandom(ENTRY))
    held, ways, refused = images._read_peers([mesh_pb2.ImageData(hash=key(1), peer_source=elsewhere.to_bytes())])
    assert held == {} and ways == {} and len(refused) == 1 and "NIXL: " in refused[0] and "no longer holds" in refused[0]
    # Without a reader (no agent in this process) the unmappable source goes to kvcache.
    _, ways, refused = StageImages(None)._read_peers([mesh_pb2.ImageData(hash=key(1), peer_source=elsewhere.to_bytes())])
    assert ways == {} and len(refused) == 1 and "NIXL" not in refused[0]
