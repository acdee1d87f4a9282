"""KV read out of a peer engine's cache through NIXL (UCX underneath), on the CPU:
the prefill engine registers its cache with its agent and holds a finished
request's blocks under a lease; the decode engine's NixlConnector fetches the
agent's metadata once, reads every held block in one transfer straight into its
own reserved blocks, and prefill's lease ends on the read's notification. Both
agents live in this process here; tests/mesh/test_namespaces.py runs them in
separate network and PID namespaces."""

import time

import numpy as np
import pytest

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
from shared.kv.connectors.nixl import NixlConnector, TensorGeometry, block_runs, descriptors
from shared.kv.transfer import PeerSource
from tests.helpers.engine_helpers import run
from tests.helpers.engine_pair import GREEDY, HOLD, EnginePair
from tests.helpers.hf_models import random_prompts
from tests.helpers.nixl_wheel import skip_without_nixl

skip_without_nixl()

TINY_MODEL = "qwen2"
"""The model of model_dir (the root conftest's fixture)."""


class Pair(EnginePair):
    """A prefill engine whose cache NIXL can read and a decode engine reading it."""

    def __init__(self, model_dir: str, lease_s: float = 10.0, fetch=None) -> None:
        store = MemoryKVStore()
        self.fetches: list[str] = []
        self.prefill_link = NixlConnector(MemoryConnector(store), "prefill-0-a", lambda iid: b"")

        def metadata(instance_id: str) -> bytes:
            self.fetches.append(instance_id)
            return self.prefill_link.metadata()

        connector = NixlConnector(MemoryConnector(store), "decode-0-a", fetch or metadata)
        super().__init__(model_dir, store, self.prefill_link, connector, lease_s)
        assert self.prefill_link.ready and self.connector.ready

    def source(self, held) -> PeerSource:
        layout = self.prefill.runner.kv_region.layout
        return PeerSource("prefill-0", b"", held.block_ids, held.num_blocks, held.deadline, layout,
                          nixl=self.prefill_link.describe())  # fmt: skip


@pytest.fixture(scope="module")
def cold(model_dir):
    engine = LLMEngine(EngineConfig(model=model_dir, enable_prefix_caching=False))
    yield lambda prompt: run(engine, "cold", prompt, GREEDY)
    engine.close()


def test_decode_reads_the_held_blocks_through_nixl_and_the_notification_ends_the_lease(model_dir, cold):
    pair = Pair(model_dir)
    prompt = random_prompts([45], vocab=500, seed=1)[0]
    free = pair.prefill.kv.pool.num_free_blocks
    first = run(pair.prefill, "r", prompt, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer=HOLD)
    held = first.kv.held
    assert held.num_blocks == 5 and pair.prefill.kv.pool.num_free_blocks < free
    out = pair.resume("r", prompt, first)
    assert out.kv.load_path == "nixl" and out.kv.num_loaded_blocks == 5 and not out.kv.load_failed
    assert out.kv.loaded_direct and 0 < out.kv.copy_seconds <= out.kv.load_seconds
    block_bytes = pair.decode.runner.kv_region.block_bytes
    assert pair.connector.num_bytes_read >= 5 * block_bytes
    assert out.token_ids == cold(prompt).token_ids
    # The read's notification reaches prefill's agent; its next poll ends the lease.
    deadline = time.monotonic() + 10
    while pair.prefill.kv.pool.num_free_blocks != free and time.monotonic() < deadline:
        pair.prefill.step()
        time.sleep(0.01)
    assert pair.prefill.kv.pool.num_free_blocks == free and pair.prefill.kv_transfer.num_leases_expired == 0
    # A second request from the same peer reuses its metadata.
    prompt2 = random_prompts([33], vocab=500, seed=2)[0]
    first2 = run(pair.prefill, "r2", prompt2, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer=HOLD)
    out2 = pair.resume("r2", prompt2, first2)
    assert out2.kv.load_path == "nixl" and out2.token_ids == cold(prompt2).token_ids
    assert pair.fetches == ["prefill-0"]
    pair.close()


def test_a_peer_that_is_gone_is_a_visible_recompute(model_dir, cold):
    def gone(instance_id: str) -> bytes:
        raise ConnectionError("no responders")

    pair = Pair(model_dir, fetch=gone)
    prompt = random_prompts([45], vocab=500, seed=3)[0]
    first = run(pair.prefill, "r", prompt, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer=HOLD)
    out = pair.resume("r", prompt, first)
    assert out.kv.load_failed and out.kv.num_loaded_blocks == 0 and pair.connector.num_failures == 1
    assert out.token_ids == cold(prompt).token_ids
    pair.close()


def test_a_restarted_peer_is_not_read_with_its_old_description(model_dir, cold):
    pair = Pair(model_dir)
    prompt = random_prompts([45], vocab=500, seed=4)[0]
    first = run(pair.prefill, "r", prompt, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer=HOLD)
    source = pair.source(first.kv.held)
    # The handoff names an agent the peer no longer is (it restarted meanwhile).
    source.nixl = source.nixl.replace(b"prefill-0-a", b"prefill-0-old")
    out = pair.resume("r", prompt, first, source)
    assert out.kv.load_failed and out.token_ids == cold(prompt).token_ids
    pair.close()


def test_a_source_without_nixl_goes_to_the_link_behind(model_dir):
    pair = Pair(model_dir, lease_s=10.0)
    prompt = random_prompts([45], vocab=500, seed=5)[0]
    first = run(pair.prefill, "r", prompt, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer=HOLD)
    source = pair.source(first.kv.held)
    source.nixl = b""
    out = pair.resume("r", prompt, first, source)
    assert out.kv.load_path == "memory" and out.kv.num_loaded_blocks == 5  # written behind to the store
    pair.close()


def test_runs_coalesce_only_where_both_sides_are_consecutive():
    runs = block_runs([4, 5, 6, 9, 10], [0, 1, 3, 4, 5])
    assert runs.tolist() == [[4, 0, 2], [6, 3, 1], [9, 4, 2]]
    assert block_runs([], []).shape == (0, 3)


def test_descriptors_address_every_layer_and_plane_of_each_run():
    theirs = [TensorGeometry(1000 * (k + 1), 100, 10, 8, 0) for k in range(2)]
    ours = [TensorGeometry(50000 * (k + 1), 300, 20, 8, 0) for k in range(2)]
    remote, local = descriptors({0: [2, 3, 7]}, {0: [5, 6, 1]}, {0: [0, 1]}, theirs, ours)
    # 2 runs x 2 tensors x 2 planes; lengths in bytes (2 blocks, then 1).
    assert len(remote) == len(local) == 8
    assert remote[0].tolist() == [1000 + 2 * 10, 16, 0] and local[0].tolist() == [50000 + 5 * 20, 16, 0]
    assert remote[2].tolist() == [1000 + 100 + 2 * 10, 16, 0]  # plane 1 of tensor 0
    assert local[7].tolist() == [100000 + 300 + 1 * 20, 8, 0]  # plane 1 of tensor 1, block 7 -> 1
    assert np.array_equal(remote[:, 1], local[:, 1])
