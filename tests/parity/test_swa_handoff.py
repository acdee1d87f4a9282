"""A prefill -> decode handoff of a hybrid sliding-window model equals the same request
on one engine, token for token and logprob for logprob: prefill holds the sliding
window with the persistent blocks and decode copies both straight out of its cache
(shared memory on the CPU), so decode replays nothing. Without the window it would
replay, and in bounded mode its logprobs would drift from one engine's."""

import pytest

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput, TokenLogprobs
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
from shared.kv.connectors.peer import PeerConnector
from shared.kv.transfer import KVTransferParams, PeerSource
from tests.helpers.engine_helpers import as_tuples, generate
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model

BLOCK = 4
NUM_NEW = 12
HOLD = KVTransferParams(load=True, save=True, wait_for_save=False, hold=True)

# (architecture, layer types, window): the sliding layers' window is far shorter than the prompts.
HYBRIDS = {
    "qwen2_alternating": ("qwen2", ["full_attention", "sliding_attention"] * 2, 6),
    "qwen3_sliding_first": ("qwen3", ["sliding_attention", "full_attention", "sliding_attention"], 5),
}


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    arch, layer_types, window = HYBRIDS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_hf_model(
        arch, path, num_hidden_layers=len(layer_types), layer_types=layer_types,
        use_sliding_window=True, sliding_window=window, max_window_layers=0,
    )  # fmt: skip
    return str(path)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3)


def handoff(model: str, prompt: list[int], window: bool = True, **cfg) -> tuple[RequestOutput, list[TokenLogprobs], LLMEngine]:
    """Prefill (hold=True) samples the first token; decode continues from the blocks it
    copies out of prefill's cache (with the window, or as if prefill had held none)."""
    store = MemoryKVStore()
    prefill = LLMEngine(EngineConfig(model=model, block_size=BLOCK), kv_connector=MemoryConnector(store), share_kv=True)
    first, first_logprobs = generate(prefill, "r", prompt, params(1), kv_transfer=HOLD)
    held = first.kv.held
    assert held is not None and held.num_blocks == len(prompt) // BLOCK
    region = prefill.runner.kv_region
    source = PeerSource(
        "prefill-0", region.share(), held.block_ids, held.num_blocks, held.deadline, region.layout,
        held.window_first if window else 0, held.window if window else {},
    )  # fmt: skip
    connector = PeerConnector(MemoryConnector(store), lambda peer, rid: None)
    decode = LLMEngine(EngineConfig(model=model, block_size=BLOCK, **cfg), kv_connector=connector)
    out, logprobs = generate(
        decode, "r", prompt, params(NUM_NEW + 1),  # max_tokens counts the resumed first token
        resume_token_ids=first.token_ids, kv_transfer=KVTransferParams(load=True, source=source),
    )  # fmt: skip
    assert out.kv.loaded_direct and out.kv.num_loaded_blocks == held.num_blocks and not out.kv.load_failed
    prefill.close()
    return out, first_logprobs + logprobs, decode


def test_a_handoff_equals_one_engine_token_for_token_and_logprob_for_logprob(hybrid):
    # The prompt ends on a block boundary: decode's first step computes the first token
    # alone, as one engine's does, over KV copied bit for bit, so every float agrees.
    prompt = random_prompts([68], vocab=500, seed=11)[0]
    one, one_logprobs = generate(LLMEngine(EngineConfig(model=hybrid, block_size=BLOCK)), "one", prompt, params(NUM_NEW + 1))
    out, logprobs, decode = handoff(hybrid, prompt)
    assert decode.kv.swa_replay == "exact"  # the default of a model not trained for bounded replay
    assert out.kv.num_replayed_tokens == 0 and decode.kv.num_replays == 0
    assert out.num_cached_tokens == 68
    assert out.token_ids == one.token_ids
    assert as_tuples(logprobs) == as_tuples(one_logprobs)


def test_a_handoff_of_a_prompt_ending_inside_a_block_replays_nothing_and_agrees(hybrid):
    # Decode recomputes the partial last block (2 tokens) with the first token in one
    # step, where one engine computed them with the prompt: other matmul shapes, so the
    # CPU's sums round differently (~5e-7), while the window came whole and the tokens agree.
    prompt = random_prompts([70], vocab=500, seed=11)[0]
    one, one_logprobs = generate(LLMEngine(EngineConfig(model=hybrid, block_size=BLOCK)), "one", prompt, params(NUM_NEW + 1))
    out, logprobs, _ = handoff(hybrid, prompt)
    assert out.kv.num_replayed_tokens == 0 and out.num_cached_tokens == 68
    assert out.token_ids == one.token_ids
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in one_logprobs], abs=1e-5)


def test_without_the_window_decode_replays_and_bounded_replay_drifts(hybrid):
    prompt = random_prompts([68], vocab=500, seed=11)[0]
    _, one_logprobs = generate(LLMEngine(EngineConfig(model=hybrid, block_size=BLOCK)), "one", prompt, params(NUM_NEW + 1))
    exact, exact_logprobs, _ = handoff(hybrid, prompt, window=False)
    assert exact.kv.num_replayed_tokens > 0
    bounded, bounded_logprobs, _ = handoff(hybrid, prompt, window=False, swa_replay="bounded")
    assert bounded.kv.num_replayed_tokens > 0
    # Bounded replay's first replayed queries saw a truncated window: the logprobs differ.
    assert [lp.logprob for lp in bounded_logprobs] != [lp.logprob for lp in one_logprobs]
    # With the window, bounded mode changes nothing: there is nothing to replay.
    windowed, windowed_logprobs, _ = handoff(hybrid, prompt, swa_replay="bounded")
    assert windowed.kv.num_replayed_tokens == 0
    assert as_tuples(windowed_logprobs) == as_tuples(one_logprobs)
