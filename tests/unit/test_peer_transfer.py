"""Direct prefill -> decode KV transfer on the CPU: the prefill engine's cache lives
in shared memory, holds a finished request's blocks under a lease (with the sliding
window a query at the held boundary sees), and the decode engine's PeerConnector
copies them straight into its own cache, so it replays nothing; kvcache (here an
in-memory store) is only the fallback."""

import subprocess
import sys
import time

import pytest

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
from shared.kv.connectors.peer import LEASE_MARGIN_S, PeerConnector
from shared.kv.memory.share import open_peer
from shared.kv.transfer import KVTransferParams, PeerSource
from shared.proto import mesh_pb2
from shared.stage.kv_handoff import held_kv_source, peer_source
from tests.helpers.hf_models import random_prompts
from tests.helpers.engine_helpers import run
from tests.helpers.engine_pair import GREEDY, HOLD, EnginePair

TINY_MODEL = "qwen2"  # layer 0 full, layers 1-2 sliding (window 6): one persistent group, two sliding
"""The model of model_dir (the root conftest's fixture)."""


class Pair(EnginePair):
    """A prefill engine sharing its cache and a decode engine copying from it."""

    def __init__(self, model_dir: str, lease_s: float = 10.0, peer: type[PeerConnector] = PeerConnector) -> None:
        store = MemoryKVStore()
        self.released: list[tuple[str, str]] = []
        connector = peer(MemoryConnector(store), lambda peer, rid: self.released.append((peer, rid)))
        super().__init__(model_dir, store, MemoryConnector(store), connector, lease_s, share_kv=True)

    def source(self, held) -> PeerSource:
        region = self.prefill.runner.kv_region
        return PeerSource(
            "prefill-0", region.share(), held.block_ids, held.num_blocks, held.deadline, region.layout,
            held.window_first, held.window,
        )  # fmt: skip


def test_decode_copies_the_held_blocks_directly_and_releases_the_lease(model_dir):
    pair = Pair(model_dir)
    prompt = random_prompts([45], vocab=500, seed=1)[0]
    free = pair.prefill.kv.pool.num_free_blocks
    first = run(pair.prefill, "r", prompt, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer=HOLD)
    held = first.kv.held
    assert held.num_blocks == 5 and held.deadline > time.time()
    # A query at 40 sees keys 35..40: block 4 of each sliding group is the window.
    assert held.window_first == 4 and sorted(held.window) == [1, 2] and all(len(w) == 1 for w in held.window.values())
    # The lease keeps the 5 prompt blocks and the 2 window blocks out of the prefill pool
    # after the request ended.
    assert pair.prefill.kv.pool.num_free_blocks == free - 7
    out = pair.resume("r", prompt, first)
    assert out.kv.num_loaded_blocks == 5 and out.kv.loaded_direct and not out.kv.load_failed
    assert out.kv.num_replayed_tokens == 0  # the window came with the blocks
    assert pair.connector.num_direct_blocks == 5
    # The copy's own time is reported, as the connector counted it, within the load's.
    assert 0 < out.kv.copy_seconds == pair.connector.copy_seconds <= out.kv.load_seconds
    assert pair.released == [("prefill-0", "r")]
    cold = run(LLMEngine(EngineConfig(model=model_dir, enable_prefix_caching=False)), "c", prompt, GREEDY)
    assert out.token_ids == cold.token_ids
    # The peer's release frees the held blocks.
    assert pair.prefill.release_kv_lease("r") and pair.prefill.kv.pool.num_free_blocks == free
    assert not pair.prefill.release_kv_lease("r")
    pair.close()


def test_decode_copies_only_what_it_lacks_from_the_right_blocks(model_dir):
    pair = Pair(model_dir)
    prompt = random_prompts([45], vocab=500, seed=5)[0]
    run(pair.decode, "warm", prompt[:17], SamplingParams(max_tokens=1))  # decode holds blocks 0 and 1 itself
    first = run(pair.prefill, "r", prompt, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer=HOLD)
    out = pair.resume("r", prompt, first)
    # Blocks 2-4 come from the peer's blocks 2-4 (not 0-2): the tokens are the cold run's.
    assert out.kv.num_loaded_blocks == 3 and out.kv.loaded_direct and out.num_cached_tokens == 40
    cold = run(LLMEngine(EngineConfig(model=model_dir, enable_prefix_caching=False)), "c", prompt, GREEDY)
    assert out.token_ids == cold.token_ids
    pair.close()


def test_the_handoff_message_carries_the_window(model_dir):
    pair = Pair(model_dir)
    prompt = random_prompts([45], vocab=500, seed=6)[0]
    held = run(pair.prefill, "r", prompt, SamplingParams(max_tokens=1), kv_transfer=HOLD).kv.held
    message = held_kv_source(pair.prefill, "prefill-0", held)
    assert message.window_first == 4 and list(message.window_block_ids) == held.window[1] + held.window[2]
    assert peer_source(pair.decode, mesh_pb2.DecodeHandoff(kv_source=message)) == pair.source(held)
    # A window that does not fit decode's sliding groups is dropped whole: decode replays.
    del message.window_block_ids[-1]
    source = peer_source(pair.decode, mesh_pb2.DecodeHandoff(kv_source=message))
    assert (source.window_first, source.window, source.num_blocks) == (0, {}, 5)
    pair.close()


class ShortPeer(PeerConnector):
    """Copies everything, window included, but reports the last persistent block missing."""

    def _copy(self, request_id, source, route, first, block_ids, num):
        copied, seconds = super()._copy(request_id, source, route, first, block_ids, num)
        return copied - 1, seconds


@pytest.mark.parametrize("peer", [PeerConnector, ShortPeer])
def test_the_window_enters_decodes_index_only_after_a_whole_direct_load(model_dir, monkeypatch, peer):
    pair = Pair(model_dir, peer=peer)
    prompt = random_prompts([45], vocab=500, seed=7)[0]
    first = run(pair.prefill, "r", prompt, SamplingParams(max_tokens=1), kv_transfer=HOLD)
    kv = pair.decode.kv
    index_loaded = kv.index_loaded
    calls = []

    def record(request, first_block, num_blocks, window=False):
        calls.append((first_block, num_blocks, window))
        index_loaded(request, first_block, num_blocks, window)

    monkeypatch.setattr(kv, "index_loaded", record)
    out = pair.resume("r", prompt, first)
    if peer is ShortPeer:
        assert calls == [(0, 4, False)] and out.kv.load_failed and out.kv.num_replayed_tokens > 0
    else:
        assert calls == [(0, 5, True)] and not out.kv.load_failed and out.kv.num_replayed_tokens == 0
    pair.close()


def test_an_unreleased_lease_expires(model_dir):
    pair = Pair(model_dir, lease_s=0.2)
    prompt = random_prompts([45], vocab=500, seed=2)[0]
    free = pair.prefill.kv.pool.num_free_blocks
    run(pair.prefill, "r", prompt, SamplingParams(max_tokens=1), kv_transfer=HOLD)
    assert pair.prefill.kv.pool.num_free_blocks == free - 7  # 5 prompt blocks and 2 window blocks
    time.sleep(0.3)
    pair.prefill.step()  # an idle step expires leases
    assert pair.prefill.kv.pool.num_free_blocks == free
    assert pair.prefill.kv_transfer.num_leases_expired == 1
    pair.close()


def test_a_lease_about_to_run_out_sends_decode_to_the_fallback(model_dir):
    pair = Pair(model_dir, lease_s=LEASE_MARGIN_S / 2)
    prompt = random_prompts([45], vocab=500, seed=3)[0]
    first = run(pair.prefill, "r", prompt, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer=HOLD)
    # Written behind to the store: the fallback finds the blocks there.
    out = pair.resume("r", prompt, first)
    assert out.kv.num_loaded_blocks == 5 and not out.kv.loaded_direct
    assert pair.connector.num_direct_blocks == 0 and pair.released == []
    # A store keeps no window: its blocks reserved for the load stay out of the index,
    # and decode replays it (exact: still the cold run's tokens).
    assert out.kv.num_replayed_tokens > 0
    cold = run(LLMEngine(EngineConfig(model=model_dir, enable_prefix_caching=False)), "c", prompt, GREEDY)
    assert out.token_ids == cold.token_ids
    pair.close()


def test_a_lease_that_runs_out_during_the_copy_is_a_visible_recompute(model_dir):
    pair = Pair(model_dir)
    prompt = random_prompts([45], vocab=500, seed=4)[0]
    first = run(pair.prefill, "r", prompt, SamplingParams(max_tokens=1), kv_transfer=HOLD)
    source = pair.source(first.kv.held)
    connector = pair.connector
    params = KVTransferParams(load=True, source=source)
    hashes = first.kv.block_hashes
    assert connector.lookup("x", hashes, params) == 5
    source.lease_deadline = time.time() + LEASE_MARGIN_S / 2  # as if the copy started too late
    connector.start_load("x", 0, hashes, {0: [1, 2, 3, 4, 5]}, params)
    deadline = time.monotonic() + 10
    loads = []
    while not loads and time.monotonic() < deadline:
        loads, _ = connector.poll()
    assert loads[0].num_blocks == 0 and "lease" in loads[0].error and connector.num_failures == 1
    assert pair.released == []  # nothing copied, nothing released: the peer's lease runs out by itself
    pair.close()


PEER = """
import sys, time, torch
from shared.kv.memory.share import SharedMemoryAllocator, describe
alloc = SharedMemoryAllocator()
t = alloc((2, 4, 8), torch.float32)
t.fill_(7.0)
sys.stdout.write(describe([t], alloc, "float32:1x2x4x8").decode() + "\\n")
sys.stdout.flush()
time.sleep(60)
"""


def test_a_peer_killed_before_or_during_a_copy(tmp_path):
    peer = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True)
    try:
        description = peer.stdout.readline().encode()
        layout, (mapped,) = open_peer(description, __import__("torch").device("cpu"))
        assert layout == "float32:1x2x4x8" and float(mapped.sum()) == 7.0 * 64
    finally:
        peer.kill()
        peer.wait(10)
    # Mapped before it died: the memory stays readable, the copy completes.
    assert float(mapped.sum()) == 7.0 * 64
    # Not mapped yet: the peer is gone, so there is no direct path (the fallback serves).
    with pytest.raises(ValueError, match="cannot map"):
        open_peer(description, __import__("torch").device("cpu"))


def test_a_description_from_the_wire_is_data_not_a_path_to_anything(tmp_path):
    import json
    import os

    import torch

    def shm(paths, files):
        desc = {"layout": "x", "shape": [2, 2], "dtype": "float32", "kind": "shm", "paths": paths, "files": files}
        return json.dumps(desc).encode()

    with pytest.raises(ValueError, match="not a shared KV file"):
        open_peer(shm(["/etc/passwd"], [[0, 0]]), torch.device("cpu"))
    # A /proc/<pid>/fd/<fd> that names some other file here (a peer in another container
    # whose pid and fd collide with ours) is refused, not read as KV.
    fd = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, 16)
    try:
        with pytest.raises(ValueError, match="another file"):
            open_peer(shm([f"/proc/{os.getpid()}/fd/{fd}"], [[1, 2]]), torch.device("cpu"))
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="unreadable"):
        open_peer(b"{not json", torch.device("cpu"))
