"""The prefix-cache reset behind the balancer's POST /reset_prefix_cache: an engine
forgets the blocks it keeps for reuse (device prefix cache, host tier) while the store
behind keeps its copies, so the same prompt then loads from the store, as after a
restart; blocks in use keep their content but leave the index; the endpoint wants the
API key."""

import asyncio

import httpx
from fastapi import FastAPI

from services.balancer.frontend.guard import Guard
from services.balancer.frontend.http_metrics import HttpMetrics
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.host_tier import HostTierConnector
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
from shared.kv.memory.coordinator import KVCacheCoordinator
from shared.kv.spec import kv_cache_layout
from shared.kv.transfer import KVTransferParams
from shared.runtime.metrics import Metrics
from tests.helpers.engine_helpers import run
from tests.helpers.hf_models import random_prompts

TINY_MODEL = "llama"
SAVE = KVTransferParams(load=True, save=True)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class CountingStore(MemoryConnector):
    """A store that counts the blocks it was asked to load."""

    def __init__(self, store: MemoryKVStore) -> None:
        super().__init__(store)
        self.loaded: list[int] = []

    def start_load(self, request_id, first_block, hashes, block_ids, params, trace=None):  # noqa: ANN001
        self.loaded.append(len(hashes))
        super().start_load(request_id, first_block, hashes, block_ids, params, trace)


def test_after_a_reset_the_prompt_comes_from_the_store_behind_the_host_tier(model_dir: str) -> None:
    prompt = random_prompts([45], vocab=500, seed=31)[0]  # 5 full blocks of 8, the last token computed
    behind = CountingStore(MemoryKVStore())
    tier = HostTierConnector(behind, capacity_bytes=64 << 20)
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=8, num_kv_blocks=32), kv_connector=tier)
    run(engine, "a", prompt, SamplingParams(max_tokens=1), kv_transfer=SAVE)
    held = run(engine, "held", prompt, GREEDY, kv_transfer=SAVE)
    assert held.num_cached_tokens == 40 and held.kv.num_loaded_blocks == 0  # the device cache had it
    # The device cache: the prompt's 5 blocks and a 6th that held's tokens filled; the host tier: the 5 stored.
    assert engine.reset_prefix_cache() == (6, 5)
    assert engine.kv.pool.num_cached_blocks == 0 and tier.num_bytes == 0
    out = run(engine, "b", prompt, GREEDY, kv_transfer=SAVE)
    assert out.kv.num_loaded_blocks == 5 and out.num_cached_tokens == 40
    assert behind.loaded == [5] and tier.num_hit_blocks == 0  # all from the store, none from host memory
    assert out.token_ids == held.token_ids
    assert engine.reset_prefix_cache()[0] == 6  # cached again (the loaded 5 and b's 6th), and dropped again


def test_a_reset_empties_the_index_and_leaves_the_blocks_in_use_to_their_holders() -> None:
    kv = KVCacheCoordinator(kv_cache_layout([None]), 16, 4, "fp", record_events=True)
    done, running = Request("done", list(range(12)), SamplingParams()), Request("run", list(range(50, 62)),
                                                                                 SamplingParams())
    for req in (done, running):
        hit = kv.find_prefix_hit(req)
        assert kv.allocate_slots(req, req.num_tokens - hit.num_computed, hit)
        req.num_computed_tokens = req.num_tokens
    kv.free(done)
    kv.pool.drain_events()
    held = kv.block_ids("run")
    free_before = kv.pool.num_free_blocks
    assert kv.pool.drop_cached() == 6  # done's 3 full blocks (free) and run's 3 (in use)
    stored, removed = kv.pool.drain_events()
    assert stored == [] and sorted(removed) == sorted(done.block_hashes[:3] + running.block_hashes[:3])
    for tokens in (list(range(12)), list(range(50, 62))):  # neither prompt hits any more
        assert kv.find_prefix_hit(Request("again", tokens, SamplingParams())).num_tokens == 0
    # run keeps its blocks (ids, references): nothing was freed or handed out.
    assert kv.block_ids("run") == held and kv.pool.num_free_blocks == free_before
    assert all(kv.pool.blocks[b].ref_cnt == 1 for b in held[0])
    assert kv.pool.drop_cached() == 0


def test_the_reset_endpoint_wants_the_api_key() -> None:
    app = FastAPI()
    app.add_middleware(Guard, api_key="key", max_body_bytes=1 << 20, stats=HttpMetrics(Metrics("balancer"), "m", 64))
    app.post("/reset_prefix_cache")(lambda: {"instances": {}})

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://b") as client:
            return (await client.post("/reset_prefix_cache"),
                    await client.post("/reset_prefix_cache", headers={"Authorization": "Bearer key"}))

    refused, taken = asyncio.run(go())
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert taken.status_code == 200
