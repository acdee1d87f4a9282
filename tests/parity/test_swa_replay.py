"""SWA bounded replay, offline: a prefix hit whose sliding-window KV is gone.

The persistent (full-attention) blocks of a prompt leave one engine as bytes and
enter another, as they do through the kvcache service; sliding-window KV never
travels. The second engine resumes from the hit by replaying the last R tokens
for the sliding-window layers. With swa_replay="exact" (R = L_swa * (W - 1)) the
state after the replay equals a cold run's, so the output must equal a cold run's
logprob for logprob: bit for bit on the batch-invariant path, within rounding (1e-5;
the replay's matmuls have other shapes than the cold prefill's) on the default one;
with "bounded" (R = W) it is approximate by design.

Greedy tokens alone cannot see a replay that is slightly short (every token agrees
with one R - 1 tokens long), nor can logprobs far from the hit: the exact-replay
prompts end one token past the cached blocks, so the first token sampled is
predicted by the query at the hit, whose window reaches back through every sliding
layer to the replay's first token. There a replay one token short is off by 1e-3 to
3e-2 (checked beside each exact replay), a hundred times the tolerance and more.
"""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton variant runs in the interpreter on the CPU

from shared.engine.config import EngineConfig  # noqa: E402
from shared.engine.llm_engine import LLMEngine  # noqa: E402
from shared.engine.request import Request  # noqa: E402
from shared.engine.sampling_params import SamplingParams  # noqa: E402
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore  # noqa: E402
from shared.kv.memory.coordinator import KVCacheCoordinator  # noqa: E402
from shared.kv.transfer import KVTransferParams  # noqa: E402
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model  # noqa: E402
from tests.helpers.engine_helpers import as_tuples, generate, max_logprob_diff, run  # noqa: E402

BLOCK = 4
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
LOGPROBS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
TOLERANCE = 1e-5
"""Logprobs of an exact replay against a cold run's on the default path (measured: 5e-7)."""
SHORT = 1e-4
"""What a replay one token short must be off by, at least (measured: 1.4e-3 to 2.8e-2)."""

# Hybrid layouts: which layers slide, and the window. Each must replay bit-for-bit in exact mode.
HYBRIDS = {
    "qwen2_alternating": ("qwen2", ["full_attention", "sliding_attention"] * 2, 6),
    "qwen3_sliding_first": ("qwen3", ["sliding_attention", "full_attention", "sliding_attention"], 5),
    "qwen2_tail_sliding": ("qwen2", ["full_attention", "full_attention", "sliding_attention"], 7),
    # 3 full + 2 sliding: groups of 2 layers, the second full group only half used.
    "qwen2_uneven": ("qwen2", ["full_attention", "sliding_attention"] * 2 + ["full_attention"], 5),
}

SAVE = KVTransferParams(load=True, save=True)
LOAD = KVTransferParams(load=True)


def make_hybrid(tmp_path_factory, name: str) -> str:
    arch, layer_types, window = HYBRIDS[name]
    path = tmp_path_factory.mktemp(name)
    save_tiny_hf_model(
        arch,
        path,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        use_sliding_window=True,
        sliding_window=window,
        max_window_layers=0,
    )
    return str(path)



def replayed_tokens(
    model: str, prompt: list[int], cached: int, replay: str, **cfg
) -> tuple[list[int], LLMEngine, MemoryKVStore]:
    """Greedy tokens of prompt on an engine that holds only the persistent KV of its
    first `cached` tokens, loaded through its connector from another engine's save."""
    store = MemoryKVStore()
    producer = LLMEngine(EngineConfig(model=model, block_size=BLOCK, **cfg), kv_connector=MemoryConnector(store))
    first = run(producer, "p", prompt[:cached], SamplingParams(max_tokens=1), kv_transfer=SAVE)
    assert first.kv.num_saved_blocks == cached // BLOCK == len(store.blocks)
    consumer = LLMEngine(
        EngineConfig(model=model, block_size=BLOCK, swa_replay=replay, **cfg), kv_connector=MemoryConnector(store)
    )
    out = run(consumer, "c", prompt, GREEDY, kv_transfer=LOAD)
    assert out.kv.num_loaded_blocks == cached // BLOCK
    return out.token_ids, consumer, store


def replay_one_token_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built from now to the test's end replay R - 1 tokens where exact needs R."""
    exact = KVCacheCoordinator.replay_length.fget
    monkeypatch.setattr(KVCacheCoordinator, "replay_length", property(lambda self: exact(self) - 1))


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_exact_replay_equals_a_cold_run_logprob_for_logprob(tmp_path_factory, monkeypatch, name, batch_invariant):
    model = make_hybrid(tmp_path_factory, name)
    prompt = random_prompts([61], vocab=500, seed=3)[0]  # 15 cached blocks, then the query at the hit
    cfg = dict(model=model, block_size=BLOCK, batch_invariant=batch_invariant)
    cold, cold_logprobs = generate(LLMEngine(EngineConfig(**cfg)), "cold", prompt, LOGPROBS)
    store = MemoryKVStore()
    producer = LLMEngine(EngineConfig(**cfg), kv_connector=MemoryConnector(store))
    run(producer, "p", prompt[:60], SamplingParams(max_tokens=1), kv_transfer=SAVE)

    def replay() -> tuple[list[int], list, int]:
        engine = LLMEngine(EngineConfig(**cfg, swa_replay="exact"), kv_connector=MemoryConnector(store))
        out, logprobs = generate(engine, "c", prompt, LOGPROBS, kv_transfer=LOAD)
        assert out.kv.num_loaded_blocks == 15 and engine.kv.num_replays == 1  # resumed by a replay
        return out.token_ids, logprobs, engine.kv.num_replayed_tokens

    tokens, logprobs, replayed = replay()
    assert tokens == cold.token_ids
    if batch_invariant:
        assert as_tuples(logprobs) == as_tuples(cold_logprobs)
    else:
        assert max_logprob_diff(logprobs, cold_logprobs) < TOLERANCE
    layout = producer.model.kv_layout
    assert replayed == layout.num_sliding_layers * (layout.max_window - 1)

    # The same replay one token short: the tokens agree (greedy cannot see it), the logprobs do not.
    replay_one_token_short(monkeypatch)
    short_tokens, short_logprobs, short_replayed = replay()
    assert short_replayed == replayed - 1
    assert short_tokens == cold.token_ids
    assert max_logprob_diff(short_logprobs, cold_logprobs) > SHORT


def test_bounded_replay_replays_one_window_and_runs(tmp_path_factory):
    model = make_hybrid(tmp_path_factory, "qwen2_alternating")
    prompt = random_prompts([70], vocab=500, seed=4)[0]
    tokens, engine, _ = replayed_tokens(model, prompt, 60, "bounded")
    assert (engine.kv.num_replays, engine.kv.num_replayed_tokens) == (1, 6)
    assert len(tokens) == GREEDY.max_tokens


def test_replay_never_overwrites_the_cached_full_attention_kv(tmp_path_factory):
    model = make_hybrid(tmp_path_factory, "qwen2_alternating")
    prompt = random_prompts([70], vocab=500, seed=5)[0]
    _, engine, store = replayed_tokens(model, prompt, 60, "bounded")
    # After the replay, the loaded blocks still hold exactly the producer's bytes.
    request = Request("x", prompt[:60], SamplingParams())
    engine.kv.update_block_hashes(request)
    num, blocks = engine.kv.persistent_blocks(request, 0, 15)
    assert num == 15
    region = engine.runner.kv_region
    ids = {g: [b.block_id for b in group] for g, group in zip(engine.kv.layout.persistent_groups, blocks)}
    assert region.read_blocks(ids) == [store.blocks[(region.layout, h)] for h in request.block_hashes[:15]]


def test_exact_replay_on_the_triton_kernels(tmp_path_factory):
    model = make_hybrid(tmp_path_factory, "qwen3_sliding_first")
    prompt = random_prompts([29], vocab=500, seed=6)[0]  # 7 cached blocks, then the query at the hit
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    cold_engine = LLMEngine(EngineConfig(model=model, block_size=BLOCK, kernels="triton"))
    cold, cold_logprobs = generate(cold_engine, "cold", prompt, params)
    store = MemoryKVStore()
    producer = LLMEngine(EngineConfig(model=model, block_size=BLOCK, kernels="triton"), kv_connector=MemoryConnector(store))
    run(producer, "p", prompt[:28], SamplingParams(max_tokens=1), kv_transfer=SAVE)
    consumer = LLMEngine(
        EngineConfig(model=model, block_size=BLOCK, kernels="triton", swa_replay="exact"),
        kv_connector=MemoryConnector(store),
    )
    out, logprobs = generate(consumer, "c", prompt, params, kv_transfer=LOAD)
    assert consumer.kv.num_replays == 1
    assert out.token_ids == cold.token_ids
    assert max_logprob_diff(logprobs, cold_logprobs) < TOLERANCE


def test_state_cache_resumes_a_conversation_with_no_replay(tmp_path_factory):
    model = make_hybrid(tmp_path_factory, "qwen2_alternating")
    prompt = random_prompts([70], vocab=500, seed=8)[0]
    cold = run(LLMEngine(EngineConfig(model=model, block_size=BLOCK)), "cold", prompt, GREEDY).token_ids
    # The first turn's sliding-window blocks leave the prefix index (as eviction would take
    # them), so only the host state cache can resume the second turn without a replay.
    engine = LLMEngine(EngineConfig(model=model, block_size=BLOCK, swa_replay="exact"))
    run(engine, "turn1", prompt[:61], SamplingParams(max_tokens=1))
    assert len(engine.kv.state_cache) == 1
    engine.kv.pool._cached = {k: b for k, b in engine.kv.pool._cached.items() if k[1] == 0}  # drop sliding entries
    out = run(engine, "turn2", prompt, GREEDY)
    assert engine.kv.num_replays == 0
    assert engine.kv.state_cache.num_hits == 1
    assert out.num_cached_tokens == 60
    assert out.token_ids == cold


def test_a_half_sliding_model_persists_half_the_bytes_per_token(tmp_path_factory):
    hybrid = make_hybrid(tmp_path_factory, "qwen2_alternating")
    full = tmp_path_factory.mktemp("qwen2_full")
    save_tiny_hf_model("qwen2", full, num_hidden_layers=4, layer_types=["full_attention"] * 4)
    prompt = random_prompts([41], vocab=500, seed=9)[0]
    per_token = {}
    for name, model in (("hybrid", hybrid), ("full", str(full))):
        store = MemoryKVStore()
        engine = LLMEngine(EngineConfig(model=model, block_size=BLOCK), kv_connector=MemoryConnector(store))
        run(engine, "p", prompt, SamplingParams(max_tokens=1), kv_transfer=SAVE)
        assert len(store.blocks) == 10
        per_token[name] = sum(len(d) for d in store.blocks.values()) / (10 * BLOCK)
    assert per_token["hybrid"] / per_token["full"] == 0.5


def test_an_all_sliding_model_resumes_from_its_window_and_persists_nothing(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral")
    save_tiny_hf_model("mistral", path)  # window 8 in every layer
    model = str(path)
    prompt, tail = random_prompts([50, 9], vocab=500, seed=10)
    cold = run(LLMEngine(EngineConfig(model=model, block_size=BLOCK)), "cold", prompt + tail, GREEDY).token_ids
    store = MemoryKVStore()
    engine = LLMEngine(EngineConfig(model=model, block_size=BLOCK), kv_connector=MemoryConnector(store))
    first = run(engine, "a", prompt, SamplingParams(max_tokens=1), kv_transfer=SAVE)
    assert first.kv.num_saved_blocks == 0 and not store.blocks  # nothing persistent to store
    out = run(engine, "b", prompt + tail, GREEDY)
    # The hit ends where a's window blocks are still indexed: 48 tokens (12 full blocks).
    assert out.num_cached_tokens == 48 and engine.kv.num_replays == 0
    assert out.token_ids == cold
