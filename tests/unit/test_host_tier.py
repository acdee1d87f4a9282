"""The host tier in front of a store: saved blocks come back from host memory after
the device cache evicted them, the rest from the store behind; bounded by bytes."""


from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.host_tier import HostTierConnector
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
from shared.kv.transfer import KVTransferParams
from tests.helpers.hf_models import random_prompts
from tests.helpers.engine_helpers import run

SAVE = KVTransferParams(load=True, save=True)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


TINY_MODEL = "llama"
"""The model of model_dir (the root conftest's fixture)."""


class CountingStore(MemoryConnector):
    """A store that counts the blocks it was asked to load."""

    def __init__(self, store: MemoryKVStore) -> None:
        super().__init__(store)
        self.loaded: list[int] = []

    def start_load(self, request_id, first_block, hashes, block_ids, params, trace=None):
        self.loaded.append(len(hashes))
        super().start_load(request_id, first_block, hashes, block_ids, params, trace)



def engine_with_tier(model_dir: str, capacity_blocks: int, store: MemoryKVStore):
    behind = CountingStore(store)
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=8, num_kv_blocks=32), kv_connector=None)
    block_bytes = engine.runner.kv_region.block_bytes
    tier = HostTierConnector(behind, capacity_bytes=capacity_blocks * block_bytes)
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=8, num_kv_blocks=32), kv_connector=tier)
    return engine, tier, behind


def evict_everything(engine: LLMEngine) -> None:
    """Unrelated prompts that take every block of the pool, so no cached block survives."""
    for i, prompt in enumerate(random_prompts([240, 240], vocab=500, seed=90)):
        run(engine, f"filler{i}", prompt, SamplingParams(max_tokens=1))


def test_a_prefix_evicted_from_the_device_comes_back_from_host_memory(model_dir):
    prompt = random_prompts([45], vocab=500, seed=21)[0]
    engine, tier, behind = engine_with_tier(model_dir, capacity_blocks=64, store=MemoryKVStore())
    run(engine, "a", prompt, SamplingParams(max_tokens=1), kv_transfer=SAVE)
    evict_everything(engine)
    out = run(engine, "b", prompt, GREEDY, kv_transfer=SAVE)
    assert out.kv.num_loaded_blocks == 5 and out.num_cached_tokens == 40
    assert tier.num_hit_blocks == 5 and behind.loaded == []  # nothing asked of the store
    cold = run(LLMEngine(EngineConfig(model=model_dir, enable_prefix_caching=False)), "c", prompt, GREEDY)
    assert out.token_ids == cold.token_ids


def test_a_load_takes_the_leading_blocks_here_and_the_rest_from_behind(model_dir):
    prompt = random_prompts([45], vocab=500, seed=22)[0]
    store = MemoryKVStore()
    # Another engine stored all 5 blocks behind; this one's tier (2 blocks) has blocks 0-1 only.
    other = LLMEngine(EngineConfig(model=model_dir, block_size=8), kv_connector=MemoryConnector(store))
    run(other, "full", prompt, SamplingParams(max_tokens=1), kv_transfer=SAVE)
    engine, tier, behind = engine_with_tier(model_dir, capacity_blocks=2, store=store)
    run(engine, "a", prompt[:17], SamplingParams(max_tokens=1), kv_transfer=KVTransferParams(save=True))
    assert tier.num_bytes == 2 * engine.runner.kv_region.block_bytes
    evict_everything(engine)
    out = run(engine, "b", prompt, GREEDY, kv_transfer=SAVE)
    assert out.kv.num_loaded_blocks == 5 and not out.kv.load_failed
    assert tier.num_hit_blocks == 2 and behind.loaded == [3]  # blocks 0-1 from here, 2-4 from behind
    cold = run(LLMEngine(EngineConfig(model=model_dir, enable_prefix_caching=False)), "c", prompt, GREEDY)
    assert out.token_ids == cold.token_ids


def test_the_tier_keeps_at_most_its_capacity_least_recently_used_first(model_dir):
    engine, tier, _ = engine_with_tier(model_dir, capacity_blocks=3, store=MemoryKVStore())
    first, second = random_prompts([25, 17], vocab=500, seed=23)
    run(engine, "a", first, SamplingParams(max_tokens=1), kv_transfer=KVTransferParams(save=True))  # 3 blocks
    run(engine, "b", second, SamplingParams(max_tokens=1), kv_transfer=KVTransferParams(save=True))  # 2 more
    engine.step()  # the saves' copies report
    a_hashes = engine.kv.hash_chain(first)[:3]
    b_hashes = engine.kv.hash_chain(second)[:2]
    assert list(tier._slots) == [a_hashes[2], *b_hashes]
