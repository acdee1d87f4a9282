"""KV blocks leave one engine as bytes and enter another (what prefill and
decode do through the kvcache service), without changing a single token."""

import pytest

from shared.engine.config import EngineConfig
from shared.engine.dtypes import torch_dtype
from shared.engine.engine_request import EngineRequest, KVTransferParams
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from tests.hf_models import random_prompts, save_tiny_hf_model

EXPORT_ALL = KVTransferParams(export_from_block=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv-transfer")
    save_tiny_hf_model("qwen3", path)
    return str(path)


def run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, **kw):
    engine.add_request(EngineRequest(rid, prompt, params, **kw))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def test_exported_blocks_imported_elsewhere_give_the_same_tokens(model_dir):
    prompt = random_prompts([45], vocab=500, seed=7)[0]  # 5 full blocks of 8 + 5 tokens
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cfg = dict(model=model_dir, block_size=8)

    producer = LLMEngine(EngineConfig(**cfg))
    first = run(producer, "p", prompt, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer=EXPORT_ALL)
    assert [h for h, _ in first.exported_kv] == producer.kv.hash_chain(prompt)[:5]
    layout = producer.block_layout
    assert all(len(data) == producer.model.kv_bytes_per_block(8, torch_dtype(producer.config.dtype)) for _, data in first.exported_kv)

    consumer = LLMEngine(EngineConfig(**cfg))
    assert consumer.block_layout == layout
    hashes = [h for h, _ in first.exported_kv]
    assert consumer.import_blocks(prompt, 0, hashes, [d for _, d in first.exported_kv]) == 5
    assert consumer.num_local_prefix_blocks(prompt, hashes) == 5
    # Continue after the first token, as decode does.
    out = run(consumer, "d", prompt, greedy, resume_token_ids=first.token_ids)
    assert out.num_cached_tokens == 40

    cold = run(LLMEngine(EngineConfig(**cfg, enable_prefix_caching=False)), "c", prompt, greedy)
    assert out.token_ids == cold.token_ids


def test_import_refuses_hashes_that_do_not_name_the_tokens(model_dir):
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=8))
    prompt = random_prompts([20], vocab=500, seed=8)[0]
    other = random_prompts([20], vocab=500, seed=9)[0]
    bogus = engine.kv.hash_chain(other)
    payload = bytes(engine.model.kv_bytes_per_block(8, torch_dtype(engine.config.dtype)))
    assert engine.import_blocks(prompt, 0, bogus, [payload, payload]) == 0
    assert engine.kv.pool.num_cached_blocks == 0


def test_seeded_request_resumes_its_generator_after_handoff(model_dir):
    prompt = random_prompts([19], vocab=500, seed=10)[0]
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=77, ignore_eos=True)
    whole = run(LLMEngine(EngineConfig(model=model_dir)), "w", prompt, seeded).token_ids
    first = run(LLMEngine(EngineConfig(model=model_dir)), "f", prompt, SamplingParams(max_tokens=1, temperature=1.0, seed=77))
    assert first.token_ids == whole[:1]
    rest = run(
        LLMEngine(EngineConfig(model=model_dir)), "r", prompt, seeded,
        resume_token_ids=first.token_ids, sampler_state=first.generator_state,
    )
    assert rest.token_ids == whole
