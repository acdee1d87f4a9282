"""The KV handoff of instances over several ranks (real gloo processes): every rank's KV
moves, through one region over all of them in rank 0's process
(shared/kv/memory/ranked_region.py).

- Tensor parallelism over 2 ranks, prefill to decode by the direct copy (the prefill
  engine's ranks' caches in shared memory, copied rank to rank): each of decode's ranks
  holds its prefill rank's blocks, byte for byte (the tokens alone would not tell: this
  tiny model's greedy tokens survive rank 1's heads left at zero), and the tokens are a
  one-process cold run's.
- The same prefill saved into a store (the one-rank bytes: every head in order) and a
  one-rank decode loading from it: the tokens are the cold run's too.
- Expert parallelism over 2 ranks (attention replicated): decode loads into every rank.
- DeepSeek-V4 over 2 tensor-parallel ranks (its KV whole on every rank): moved as one
  rank's, by the direct copy into every rank of decode and through a store into one rank.

Greedy tokens, as tests/parity/test_tensor_parallel.py compares them: tensor-parallel
logits are within 1e-5 * max|logit| of one process's, far below these prompts' gaps."""

import pytest

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
from shared.kv.connectors.peer import PeerConnector
from shared.kv.memory.ranked_region import RankedKVRegion
from shared.kv.transfer import KVTransferParams, PeerSource
from tests.helpers.engine_helpers import run
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model

ENGINE = dict(block_size=4, prefill_chunk_size=8, max_num_batched_tokens=24)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
HOLD = KVTransferParams(load=True, save=True, wait_for_save=True, hold=True)
PROMPT = random_prompts([29], vocab=500, seed=11)[0]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_model("llama", tmp_path_factory.mktemp("handoff-llama"), seed=3))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("handoff-moe"), seed=1))


def _cold(model: str) -> list[int]:
    engine = LLMEngine(EngineConfig(model=model, enable_prefix_caching=False, **ENGINE))
    try:
        return run(engine, "cold", PROMPT, GREEDY).token_ids
    finally:
        engine.close()


def _source(prefill: LLMEngine, held) -> PeerSource:  # noqa: ANN001
    region = prefill.kv_region
    return PeerSource("prefill-0", region.share(), held.block_ids, held.num_blocks, held.deadline, region.layout,
                      held.window_first, held.window)  # fmt: skip


@pytest.mark.parametrize("split", ["tp", "ep"])
def test_a_two_rank_prefill_hands_every_rank_s_kv_to_a_two_rank_decode(split: str, llama: str, qwen3_moe: str) -> None:
    model = llama if split == "tp" else qwen3_moe
    parallel = dict(tensor_parallel_size=2, enable_expert_parallel=split == "ep")
    store = MemoryKVStore()
    released: list[str] = []
    prefill = LLMEngine(EngineConfig(model=model, **parallel, **ENGINE), kv_connector=MemoryConnector(store),
                        share_kv=True)  # fmt: skip
    connector = PeerConnector(MemoryConnector(MemoryKVStore()), lambda peer, rid: released.append(rid))
    decode = LLMEngine(EngineConfig(model=model, **parallel, **ENGINE), kv_connector=connector)
    try:
        assert isinstance(prefill.kv_region, RankedKVRegion) and isinstance(decode.kv_region, RankedKVRegion)
        first = run(prefill, "r", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer=HOLD)
        held = first.kv.held
        assert held.num_blocks == len(PROMPT) // 4
        out = run(decode, "r", PROMPT, GREEDY, resume_token_ids=first.token_ids,
                  kv_transfer=KVTransferParams(load=True, source=_source(prefill, held)))  # fmt: skip
        assert out.kv.loaded_direct and out.kv.num_loaded_blocks == held.num_blocks and not out.kv.load_failed
        assert released == ["r"]
        # Every rank of decode holds what the same rank of prefill computed, block for block.
        hashes = decode.kv.hash_chain(PROMPT)[: held.num_blocks]
        ours = [decode.kv.pool.lookup(h, 0, tuple(PROMPT[i * 4 : (i + 1) * 4])) for i, h in enumerate(hashes)]
        assert all(b is not None for b in ours)
        for theirs_rank, our_rank in zip(prefill.kv_region.ranks, decode.kv_region.ranks):
            theirs_kv = theirs_rank.read_payloads({0: held.block_ids[0]})
            assert theirs_kv.any() and theirs_kv.equal(our_rank.read_payloads({0: [b.block_id for b in ours]}))
        assert out.token_ids == _cold(model)
        if split == "tp":
            # The store holds the one-rank bytes (every head, in order, of both ranks):
            # a one-rank decode loads them and gives the cold run's tokens too.
            assert len(store.blocks) == held.num_blocks
            one = LLMEngine(EngineConfig(model=model, **ENGINE), kv_connector=MemoryConnector(store))
            try:
                assert one.kv_region.layout == prefill.kv_region.layout
                again = run(one, "r", PROMPT, GREEDY, resume_token_ids=first.token_ids,
                            kv_transfer=KVTransferParams(load=True))  # fmt: skip
                assert again.kv.num_loaded_blocks == held.num_blocks and not again.kv.load_failed
                assert again.token_ids == out.token_ids
            finally:
                one.close()
    finally:
        decode.close()
        prefill.close()



def test_a_deepseek_v4_tensor_parallel_instance_moves_its_kv_as_one_rank_s(tmp_path) -> None:  # noqa: ANN001
    """DeepSeek-V4 under TP splits its query heads but keeps its one KV head and
    compressed caches whole on every rank: its region is the replicated one (rank 0's
    description, read from rank 0, written to every rank). A 2-rank prefill hands a
    321-token prompt (past the exact replay, so the loaded compressed blocks are what the
    attention reads) to a 2-rank decode by the direct copy, and saves it for a one-rank
    decode; both give a cold one-process run's tokens, and each of decode's ranks holds
    the prefill's persisted blocks byte for byte (a rank the copy skipped would hold zeros)."""
    from tests.helpers.deepseek_v4_models import save_tiny_v4

    model = str(save_tiny_v4("mixed", tmp_path / "v4", seed=1))
    engine = dict(block_size=16, swa_replay="exact")
    prompt = random_prompts([321], vocab=500, seed=7)[0]
    cold_engine = LLMEngine(EngineConfig(model=model, enable_prefix_caching=False, **engine))
    try:
        cold = run(cold_engine, "cold", prompt, GREEDY).token_ids
    finally:
        cold_engine.close()
    store = MemoryKVStore()
    prefill = LLMEngine(EngineConfig(model=model, tensor_parallel_size=2, **engine), kv_connector=MemoryConnector(store),
                        share_kv=True)  # fmt: skip
    connector = PeerConnector(MemoryConnector(MemoryKVStore()), lambda peer, rid: None)
    decode = LLMEngine(EngineConfig(model=model, tensor_parallel_size=2, **engine), kv_connector=connector)
    one = LLMEngine(EngineConfig(model=model, **engine), kv_connector=MemoryConnector(store))
    try:
        for instance in (prefill, decode):
            region = instance.kv_region
            assert isinstance(region, RankedKVRegion) and not region.tensor_parallel and len(region.ranks) == 2
            assert instance.model.parallel.tp_size == 2  # type: ignore[attr-defined]
        assert prefill.kv_region.layout == one.kv_region.layout  # the one-rank form, to peers and stores
        first = run(prefill, "r", prompt, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer=HOLD)
        held = first.kv.held
        out = run(decode, "r", prompt, GREEDY, resume_token_ids=first.token_ids,
                  kv_transfer=KVTransferParams(load=True, source=_source(prefill, held)))  # fmt: skip
        assert out.kv.loaded_direct and out.kv.num_loaded_blocks == held.num_blocks > 0 and not out.kv.load_failed
        assert out.token_ids == cold
        hashes = decode.kv.hash_chain(prompt)[: held.num_blocks]
        for g in decode.kv.layout.persistent_groups:
            ours = [decode.kv.pool.lookup(h, g, tuple(prompt[i * 16 : (i + 1) * 16])) for i, h in enumerate(hashes)]
            theirs = prefill.kv_region.ranks[0].read_payloads({g: held.block_ids[g]})
            assert theirs.any() and all(b is not None for b in ours)
            for rank in decode.kv_region.ranks:
                assert theirs.equal(rank.read_payloads({g: [b.block_id for b in ours]}))  # type: ignore[union-attr]
        again = run(one, "r", prompt, GREEDY, resume_token_ids=first.token_ids, kv_transfer=KVTransferParams(load=True))
        assert again.kv.num_loaded_blocks == held.num_blocks and not again.kv.load_failed
        assert again.token_ids == cold
    finally:
        one.close()
        decode.close()
        prefill.close()
