"""Loading a kvcache hit only when it beats recomputing it (shared/kv/connectors/load_cost.py):
the rule, then a real kvcache process: an engine whose measured loads are far slower
than its prefill (as an 8B model on an H200 against kvcache's ~0.4 GB/s) recomputes
the prefix and says so ("recompute"); told to load every hit, it loads."""

import pytest

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.kvcache import KVCacheConnector
from shared.kv.connectors.load_cost import LOAD_SLOWDOWN_LIMIT, LoadCost
from shared.kv.transfer import KVTransferParams
from tests.helpers.engine_helpers import run
from tests.helpers.hf_models import random_prompts

TINY_MODEL = "llama"
"""The model of model_dir (the root conftest's fixture); kvcache is the root conftest's too."""
BLOCK = 8
SAVE = KVTransferParams(save=True, wait_for_save=True)
LOAD = KVTransferParams(load=True)


def test_a_hit_is_loaded_unless_the_load_is_much_slower_than_recomputing():
    cost = LoadCost()
    assert cost.worth_loading(10, 1 << 20, 16)  # nothing measured: load (that is how it gets measured)
    cost.recompute_tokens_per_s = 16_000.0  # 10 blocks of 16 tokens: 10 ms to recompute
    assert cost.worth_loading(10, 1 << 20, 16)  # no load measured yet
    cost.observe_load(100 << 20, 1.0)  # 100 MiB/s: 10 MiB take 100 ms, 10x the recompute
    assert not cost.worth_loading(10, 1 << 20, 16)
    cost.observe_load(100 << 20, 0.01)  # one fast load moves the average by EMA only
    assert cost.bytes_per_s is not None and (100 << 20) < cost.bytes_per_s < (10_000 << 20)
    fast = LoadCost(recompute_tokens_per_s=16_000.0)
    fast.observe_load(10 << 20, 0.01 * LOAD_SLOWDOWN_LIMIT)  # exactly at the limit: still loaded
    assert fast.worth_loading(10, 1 << 20, 16)


@pytest.mark.parametrize("when_faster", [True, False])
def test_an_engine_recomputes_a_hit_that_loads_slower_than_it_prefills(model_dir, kvcache, when_faster):
    seed = 10 * int(when_faster)
    first_prompt, prompt = random_prompts([60, 60], vocab=500, seed=seed)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    writer_connector = KVCacheConnector(kvcache.address)
    writer = LLMEngine(EngineConfig(model=model_dir, block_size=BLOCK, num_kv_blocks=64), kv_connector=writer_connector)
    expected = {}
    for name, p in (("warm", first_prompt), ("again", prompt)):
        out = run(writer, name, p, greedy, kv_transfer=SAVE)
        assert out.kv.num_saved_blocks == 60 // BLOCK
        expected[name] = out.token_ids
    connector = KVCacheConnector(kvcache.address, load_when_faster=when_faster)
    reader = LLMEngine(EngineConfig(model=model_dir, block_size=BLOCK, num_kv_blocks=64), kv_connector=connector)
    assert connector.cost is None or connector.cost.recompute_tokens_per_s > 0  # measured at start
    warm = run(reader, "warm", first_prompt, greedy, kv_transfer=LOAD)  # a first hit is loaded: a bandwidth
    assert warm.kv.num_loaded_blocks == 60 // BLOCK and connector.take_outcome("warm") == "ok"
    assert warm.token_ids == expected["warm"]
    if connector.cost is not None:
        # As an 8B model on an H200 against kvcache: loads 50x slower than the prefill.
        per_token = reader.runner.kv_region.block_bytes / BLOCK
        connector.cost.recompute_tokens_per_s = 50 * LOAD_SLOWDOWN_LIMIT * connector.cost.bytes_per_s / per_token
    again = run(reader, "again", prompt, greedy, kv_transfer=LOAD)  # held by kvcache, not by this engine
    assert again.token_ids == expected["again"]
    if when_faster:
        assert again.kv.num_loaded_blocks == 0 and connector.take_outcome("again") == "recompute"
    else:
        assert again.kv.num_loaded_blocks == 60 // BLOCK and connector.take_outcome("again") == "ok"
    connector.close()
    writer_connector.close()
