"""KV blocks leave one engine through its connector and enter another's (what
prefill and decode do through the kvcache service), without changing a single
token; the engine, not its caller, drives the connector."""

import pytest

from shared.engine.config import EngineConfig
from shared.engine.dtypes import torch_dtype
from shared.engine.engine_request import EngineRequest
from shared.engine.llm_engine import LLMEngine
from shared.engine.request import RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.base import LoadResult, SaveResult
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
from shared.kv.transfer import KVTransferParams
from tests.helpers.hf_models import random_prompts
from tests.helpers.engine_helpers import run

SAVE = KVTransferParams(load=True, save=True)
LOAD = KVTransferParams(load=True)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


TINY_MODEL = "qwen3"
"""The model of model_dir (the root conftest's fixture)."""



def make(model_dir: str, connector=None, **cfg) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, block_size=8, **cfg), kv_connector=connector)


def test_saved_blocks_loaded_by_another_engine_give_the_same_tokens(model_dir):
    prompt = random_prompts([45], vocab=500, seed=7)[0]  # 5 full blocks of 8 + 5 tokens
    store = MemoryKVStore()
    producer = make(model_dir, MemoryConnector(store))
    first = run(producer, "p", prompt, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer=SAVE)
    # The last output came once the blocks were stored, and says which.
    assert first.kv.block_hashes == producer.kv.hash_chain(prompt)[:5]
    assert first.kv.num_saved_blocks == 5 and len(store.blocks) == 5
    block_bytes = producer.model.kv_bytes_per_block(8, torch_dtype(producer.config.dtype))
    assert {len(d) for d in store.blocks.values()} == {block_bytes}

    consumer = make(model_dir, MemoryConnector(store))
    # Continue after the first token, as decode does: the prompt's blocks come through the connector.
    out = run(consumer, "d", prompt, GREEDY, resume_token_ids=first.token_ids, kv_transfer=LOAD)
    assert out.kv.num_loaded_blocks == 5 and not out.kv.load_failed
    assert out.num_cached_tokens == 40
    cold = run(make(model_dir, enable_prefix_caching=False), "c", prompt, GREEDY)
    assert out.token_ids == cold.token_ids


def test_a_save_skips_what_the_source_holds_and_a_load_what_the_cache_holds(model_dir):
    store = MemoryKVStore()
    prompt = random_prompts([45], vocab=500, seed=11)[0]
    engine = make(model_dir, MemoryConnector(store))
    run(engine, "a", prompt[:25], SamplingParams(max_tokens=1), kv_transfer=SAVE)  # blocks 0-2
    assert len(store.blocks) == 3
    out = run(make(model_dir, MemoryConnector(store)), "b", prompt, SamplingParams(max_tokens=1), kv_transfer=SAVE)
    assert (out.kv.num_loaded_blocks, out.kv.num_saved_blocks) == (3, 2)  # loads 0-2, saves 3-4 only
    # The same engine again: everything is local, nothing is loaded.
    again = run(engine, "c", prompt[:25], SamplingParams(max_tokens=1), kv_transfer=SAVE)
    assert again.kv.num_loaded_blocks == 0 and again.num_cached_tokens == 24


class FailingConnector(MemoryConnector):
    """Promises blocks, then delivers only the first `deliver` of them."""

    def __init__(self, store: MemoryKVStore, deliver: int) -> None:
        super().__init__(store)
        self.deliver = deliver

    def start_load(self, request_id, first_block, hashes, block_ids, params, trace=None):
        super().start_load(request_id, first_block, hashes[: self.deliver], block_ids, params, trace)
        self._loads[-1] = LoadResult(request_id, self._loads[-1].num_blocks, "connection reset")


@pytest.mark.parametrize("deliver", [0, 2])
def test_a_failed_load_is_recomputed_visibly(model_dir, deliver):
    store = MemoryKVStore()
    prompt = random_prompts([45], vocab=500, seed=12)[0]
    run(make(model_dir, MemoryConnector(store)), "p", prompt, SamplingParams(max_tokens=1), kv_transfer=SAVE)
    engine = make(model_dir, FailingConnector(store, deliver))
    free_before = engine.kv.pool.num_free_blocks
    out = run(engine, "d", prompt, GREEDY, kv_transfer=LOAD)
    assert out.kv.load_failed and out.kv.num_loaded_blocks == deliver
    assert engine.scheduler.num_kv_load_failures == 1
    assert out.num_cached_tokens == 8 * deliver
    cold = run(make(model_dir, enable_prefix_caching=False), "c", prompt, GREEDY)
    assert out.token_ids == cold.token_ids
    # Nothing leaked: the reservation was returned.
    assert engine.kv.pool.num_free_blocks == free_before


class SlowLookups(MemoryConnector):
    """Answers a lookup only the second time it is asked, as a remote store answers later."""

    def __init__(self, store: MemoryKVStore) -> None:
        super().__init__(store)
        self.asked: dict[str, int] = {}

    def lookup(self, request_id, hashes, params, trace=None):
        self.asked[request_id] = self.asked.get(request_id, 0) + 1
        return super().lookup(request_id, hashes, params) if self.asked[request_id] >= 2 else None


def test_a_pending_lookup_holds_up_no_other_request_and_reserves_before_loading(model_dir):
    store = MemoryKVStore()
    prompt = random_prompts([45], vocab=500, seed=13)[0]
    run(make(model_dir, MemoryConnector(store)), "p", prompt, SamplingParams(max_tokens=1), kv_transfer=SAVE)
    connector = SlowLookups(store)
    engine = make(model_dir, connector)
    engine.add_request(EngineRequest("slow", prompt, GREEDY, kv_transfer=LOAD))
    engine.add_request(EngineRequest("plain", [t + 1 for t in prompt[:10]], GREEDY))
    engine.step()
    sched = engine.scheduler
    assert [r.request_id for r in sched.running] == ["plain"]  # admitted past the pending lookup
    assert sched.requests["slow"].status == RequestStatus.WAITING
    engine.step()  # the answer: the store holds 5 blocks; they are reserved, then loaded
    assert sched.requests["slow"].status == RequestStatus.WAITING_FOR_KV
    reserved = engine.kv.reserved_block_ids("slow")[0]
    assert len(reserved) == 5 and all(engine.kv.pool.blocks[b].ref_cnt == 1 for b in reserved)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert outs["slow"].kv.num_loaded_blocks == 5 and connector.asked["slow"] == 2


def test_aborting_a_request_waiting_for_kv_returns_its_blocks(model_dir):
    store = MemoryKVStore()
    prompt = random_prompts([45], vocab=500, seed=14)[0]
    run(make(model_dir, MemoryConnector(store)), "p", prompt, SamplingParams(max_tokens=1), kv_transfer=SAVE)
    engine = make(model_dir, MemoryConnector(store))
    free = engine.kv.pool.num_free_blocks
    engine.add_request(EngineRequest("a", prompt, GREEDY, kv_transfer=LOAD))
    engine.step()
    assert engine.scheduler.requests["a"].status == RequestStatus.WAITING_FOR_KV
    engine.abort_request("a")
    # The connector may be writing into the reserved blocks: they stay out of the pool
    # until the load reports, then come back unindexed.
    assert engine.kv.pool.num_free_blocks == free - 5
    assert engine.has_unfinished_requests()
    engine.step()
    assert engine.kv.pool.num_free_blocks == free
    assert engine.kv.pool.num_cached_blocks == 0
    assert not engine.has_unfinished_requests()


def test_seeded_request_continues_after_handoff(model_dir):
    # No sampler state travels: the draws are keyed by (seed, position), so the
    # resumed engine draws the second token's noise as the whole run did.
    prompt = random_prompts([19], vocab=500, seed=10)[0]
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=77, ignore_eos=True)
    whole = run(LLMEngine(EngineConfig(model=model_dir)), "w", prompt, seeded).token_ids
    first = run(LLMEngine(EngineConfig(model=model_dir)), "f", prompt, SamplingParams(max_tokens=1, temperature=1.0, seed=77))
    assert first.token_ids == whole[:1]
    rest = run(
        LLMEngine(EngineConfig(model=model_dir)), "r", prompt, seeded,
        resume_token_ids=first.token_ids,
    )  # fmt: skip
    assert rest.token_ids == whole


class FailingStores(MemoryConnector):
    def start_save(self, request_id, hashes, block_ids, params, trace=None):
        self._saves.append(SaveResult(request_id, 0, "store unreachable"))


def test_a_failed_store_is_counted_whether_waited_for_or_written_behind(model_dir):
    engine = make(model_dir, FailingStores(MemoryKVStore()))
    prompt = random_prompts([45], vocab=500, seed=15)[0]
    out = run(engine, "a", prompt, SamplingParams(max_tokens=1), kv_transfer=SAVE)
    assert out.kv.save_error == "store unreachable" and out.kv.num_saved_blocks == 0
    behind = KVTransferParams(save=True, wait_for_save=False)
    out = run(engine, "b", prompt[:30], SamplingParams(max_tokens=1), kv_transfer=behind)
    assert out.kv.save_error is None  # not waited for: the output went out before the store answered
    engine.step()  # the store's answer arrives
    assert engine.load().num_kv_save_failures == 2
