"""The direct path of image embeddings (shared/stage/embedding_share.py): a vision
instance's ring in shared memory, read by another process on the same host through the
mapping KV's peer copy uses. Checked: another process copies an image's blob out
exactly; an entry the ring came round to, a description whose file is another one here
(another PID namespace or host) and a dead owner are each refused (ValueError), never
read as embeddings, except that with a directory both see (engine.kv_share_dir) the
owner hands its file over a socket to a reader in another namespace; prefill's StageImages takes what it can copy and asks kvcache only
for the rest, counting each image's path."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from opentelemetry import trace

from shared.proto import mesh_pb2
from shared.runtime.metrics import Metrics
from shared.stage.embedding_share import HEADER, ArenaReader, EmbeddingArena, EmbeddingSource
from shared.stage.embeddings import to_blob
from shared.stage.images import StageImages

OWNER = """
import sys
from shared.stage.embedding_share import EmbeddingArena
arena = EmbeddingArena(4096, sys.argv[1])
source = arena.put(bytes([7]) * 32, "emb1;uint8;2x3;1x2x3", bytes(range(6)))
print(source.to_bytes().decode(), flush=True)
sys.stdin.readline()  # alive until the test closes stdin
"""


def blob(seed: int, rows: int = 4) -> tuple[str, bytes]:
    return to_blob(torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed)), (1, 2 * rows, 2))


@pytest.mark.parametrize("share_dir", [False, True])
def test_another_process_copies_the_blob_and_a_dead_owner_is_refused(share_dir: bool, tmp_path: Path) -> None:
    directory = str(tmp_path / "share") if share_dir else ""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, directory], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    blob = ("emb1;uint8;2x3;1x2x3", bytes(range(6)))
    try:
        source = EmbeddingSource.from_bytes(owner.stdout.readline().encode())
        assert ArenaReader().read(bytes([7]) * 32, source) == blob
        with pytest.raises(ValueError, match="no longer holds"):  # another image's identity: not its bytes
            ArenaReader().read(bytes([8]) * 32, source)
        # As a reader in another PID namespace sees it: another file behind the /proc path.
        desc = json.loads(source.region)
        desc["files"] = [[desc["files"][0][0], desc["files"][0][1] + 1]]
        elsewhere = EmbeddingSource(json.dumps(desc), source.offset, source.generation, source.nbytes, source.layout)
        if share_dir:  # the owner hands its file over the socket in the shared directory
            assert ArenaReader().read(bytes([7]) * 32, elsewhere) == blob
        else:
            with pytest.raises(ValueError, match="another file"):
                ArenaReader().read(bytes([7]) * 32, elsewhere)
    finally:
        owner.stdin.close()
        owner.wait(30)
    with pytest.raises(ValueError, match="cannot (map|reach)"):  # its /proc/<pid>/fd path and socket went with it
        ArenaReader().read(bytes([7]) * 32, source)


def test_an_entry_the_ring_came_round_to_is_refused() -> None:
    first, second = blob(1), blob(2)
    size = HEADER.size + len(first[1])
    arena = EmbeddingArena(size + size // 2)  # one entry fits, two do not
    try:
        a = arena.put(b"a" * 32, *first)
        assert a is not None and arena.put(b"a" * 32, *first) == a  # held: the same entry
        assert ArenaReader().read(b"a" * 32, a) == first
        b = arena.put(b"b" * 32, *second)  # wraps to the start: a's entry is gone
        assert b is not None and b.offset == a.offset and b.generation > a.generation
        assert arena.get(b"a" * 32) is None
        with pytest.raises(ValueError, match="no longer holds"):
            ArenaReader().read(b"a" * 32, a)
        assert ArenaReader().read(b"b" * 32, b) == second
        assert arena.put(b"c" * 32, "emb1;uint8;1x1;1x1x1", bytes(arena.nbytes)) is None  # larger than the ring
        with pytest.raises(ValueError, match="past the arena"):
            ArenaReader().read(b"b" * 32, EmbeddingSource(b.region, arena.nbytes - 8, b.generation, b.nbytes, b.layout))
    finally:
        arena.close()


class BlobStore:
    """kvcache's blob calls over a dict (what the vision instance stored), counting what is asked."""

    def __init__(self, blobs: dict[bytes, tuple[str, bytes]]) -> None:
        self.blobs = blobs
        self.asked: list[bytes] = []

    async def get_blobs(self, keys, timeout_s=None):  # noqa: ANN001, ANN201
        self.asked += keys
        return {k: self.blobs[k] for k in keys if k in self.blobs}


def test_prefill_copies_what_it_can_and_asks_kvcache_for_the_rest() -> None:
    first, second = blob(1), blob(2, rows=3)
    size = HEADER.size + len(first[1])
    arena = EmbeddingArena(size + size // 2)
    try:
        a = arena.put(b"a" * 32, *first)
        b = arena.put(b"b" * 32, *second)  # overwrites a
        store = BlobStore({b"a" * 32: first, b"b" * 32: second})
        metrics = Metrics("prefill")
        images = StageImages(object(), store, metrics=metrics)  # type: ignore[arg-type]
        messages = [mesh_pb2.ImageData(hash=b"a" * 32, embedded=True, peer_source=a.to_bytes()),
                    mesh_pb2.ImageData(hash=b"b" * 32, embedded=True, peer_source=b.to_bytes())]  # fmt: skip
        got = asyncio.run(images.request_images(messages, trace.get_tracer("test")))
        assert got is not None and store.asked == [b"a" * 32]  # b came straight from the arena
        embeds = got.inputs
        torch.testing.assert_close(embeds.embeds[1], torch.frombuffer(bytearray(second[1]), dtype=torch.float32).view(3, 8))
        assert embeds.grids == ((1, 8, 2), (1, 6, 2))
        loaded = {s.labels["path"]: s.value for f in metrics.registry.collect() for s in f.samples
                  if s.name == "infermesh_prefill_image_embeddings_loaded_total"}  # fmt: skip
        assert loaded == {"peer": 1.0, "nixl": 0.0, "kvcache": 1.0}
    finally:
        arena.close()
