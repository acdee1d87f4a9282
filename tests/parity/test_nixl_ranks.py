"""KV of instances over several ranks (real gloo processes) read through NIXL (issues
28, 33): rank 0's one agent registers every rank's cache (the others' mapped from
shared memory), the handoff describes every rank's tensors and the placement, and
decode's connector reads every rank's part in one transfer whose notification ends
prefill's lease (shared/kv/connectors/nixl.py, shared/kv/memory/ranked_region.py).

- Tensor parallelism over 2 ranks into 2 ranks: path "nixl", every held block loaded,
  each decode rank's cache byte-equal to the same prefill rank's for those blocks (the
  tokens alone would not tell, tests/parity/test_parallel_kv_handoff.py), one process's
  tokens, the lease ended by the read. A one-rank decode (another split) is not read
  through NIXL: the load comes from the link behind, not as an error.
- Data parallelism over 2 ranks (+EP, Qwen3-MoE, batch-invariant): prefill computes on
  rank 1 (a filler keeps rank 0 busy), decode lands on its rank 1; the bytes are read
  rank 1 to rank 1 and the tokens are one process's.
- DeepSeek-V4 over 2 expert-parallel ranks (attention replicated) to and from a one-rank
  instance: read once into one rank, fanned out into both ranks.
Both agents live in this process; UCX moves the bytes as between hosts."""

import multiprocessing
import time

import pytest

from shared.engine.config import EngineConfig
from shared.engine.dp_scheduler import DataParallelScheduler
from shared.engine.engine_request import EngineRequest
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.sampling_params import SamplingParams
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
from shared.kv.connectors.nixl import NixlConnector
from shared.kv.memory.block_pool import BlockPool
from shared.kv.memory.dp_region import DataParallelKVRegion
from shared.kv.memory.ranked_region import RankedKVRegion
from shared.kv.transfer import HeldBlocks, KVTransferParams, PeerSource
from tests.helpers.engine_helpers import run
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model
from tests.helpers.nixl_wheel import skip_without_nixl

pytest.importorskip("transformers")
skip_without_nixl()

BLOCK = 4
ENGINE = dict(block_size=BLOCK, prefill_chunk_size=8, max_num_batched_tokens=24)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0)
HOLD = KVTransferParams(load=True, save=True, wait_for_save=True, hold=True)
PROMPT = random_prompts([29], vocab=500, seed=11)[0]


class Links:
    """Prefill's and decode's NixlConnectors (real agents) over one store, the link behind."""

    def __init__(self) -> None:
        self.store = MemoryKVStore()
        self.prefill = NixlConnector(MemoryConnector(self.store), "prefill-r-a", lambda iid: b"")
        self.fetches: list[str] = []

    def decode(self, name: str) -> NixlConnector:
        def metadata(instance_id: str) -> bytes:
            self.fetches.append(instance_id)
            return self.prefill.metadata()

        return NixlConnector(MemoryConnector(self.store), name, metadata)

    def source(self, engine: LLMEngine, held: HeldBlocks) -> PeerSource:
        return PeerSource("prefill-0", b"", held.block_ids, held.num_blocks, held.deadline, engine.kv_region.layout,
                          held.window_first, held.window, nixl=self.prefill.describe())  # fmt: skip


def _lookup(pool: BlockPool, hashes: list, prompt: list[int]) -> list[int]:  # noqa: ANN001
    blocks = [pool.lookup(h, 0, tuple(prompt[i * BLOCK : (i + 1) * BLOCK])) for i, h in enumerate(hashes)]
    assert all(b is not None for b in blocks)
    return [b.block_id for b in blocks]  # type: ignore[union-attr]


def _until_released(engine: LLMEngine, pool: BlockPool, free: int) -> None:
    """Step the prefill engine until the read's notification has ended its lease."""
    deadline = time.monotonic() + 30
    while pool.num_free_blocks != free and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.01)
    assert pool.num_free_blocks == free and engine.kv_transfer.num_leases_expired == 0  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_model("llama", tmp_path_factory.mktemp("nixl-llama"), seed=3))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("nixl-moe"), seed=1))


def test_a_tensor_parallel_handoff_reads_every_rank_through_nixl(llama: str) -> None:
    links = Links()
    tp = dict(tensor_parallel_size=2)
    prefill = LLMEngine(EngineConfig(model=llama, **tp, **ENGINE), kv_connector=links.prefill)
    decode_link = links.decode("decode-r-a")
    decode = LLMEngine(EngineConfig(model=llama, **tp, **ENGINE), kv_connector=decode_link)
    one_link = links.decode("decode-one-a")
    one = LLMEngine(EngineConfig(model=llama, **ENGINE), kv_connector=one_link)
    try:
        assert isinstance(prefill.kv_region, RankedKVRegion) and isinstance(decode.kv_region, RankedKVRegion)
        assert links.prefill.ready and decode_link.ready and one_link.ready
        free = prefill.kv.pool.num_free_blocks
        first = run(prefill, "r", PROMPT, FIRST, kv_transfer=HOLD)
        held = first.kv.held
        assert held.num_blocks == len(PROMPT) // BLOCK and prefill.kv.pool.num_free_blocks < free
        out = run(decode, "r", PROMPT, GREEDY, resume_token_ids=first.token_ids,
                  kv_transfer=KVTransferParams(load=True, source=links.source(prefill, held)))  # fmt: skip
        assert out.kv.load_path == "nixl" and out.kv.num_loaded_blocks == held.num_blocks and not out.kv.load_failed
        assert out.kv.loaded_direct and links.fetches == ["prefill-0"]
        # Every rank's part moved: both ranks' heads, block_bytes being the whole block's.
        assert decode_link.num_bytes_read == held.num_blocks * decode.kv_region.block_bytes
        ours = _lookup(decode.kv.pool, decode.kv.hash_chain(PROMPT)[: held.num_blocks], PROMPT)
        for theirs_rank, our_rank in zip(prefill.kv_region.ranks, decode.kv_region.ranks, strict=True):
            theirs_kv = theirs_rank.read_payloads({0: held.block_ids[0]})
            assert theirs_kv.any() and theirs_kv.equal(our_rank.read_payloads({0: ours}))
        cold = LLMEngine(EngineConfig(model=llama, enable_prefix_caching=False, **ENGINE))
        try:
            assert out.token_ids == run(cold, "cold", PROMPT, GREEDY).token_ids
        finally:
            cold.close()
        _until_released(prefill, prefill.kv.pool, free)
        # A one-rank decode: the split differs, so no NIXL read; the store behind serves it.
        again = run(prefill, "r2", PROMPT, FIRST, kv_transfer=HOLD)
        loaded = run(one, "r2", PROMPT, GREEDY, resume_token_ids=again.token_ids,
                     kv_transfer=KVTransferParams(load=True, source=links.source(prefill, again.kv.held)))  # fmt: skip
        assert loaded.kv.load_path == "memory" and loaded.kv.num_loaded_blocks == held.num_blocks
        assert not loaded.kv.load_failed and one_link.num_bytes_read == 0 and one_link.num_failures == 0
        assert loaded.token_ids == out.token_ids
    finally:
        one.close()
        decode.close()
        prefill.close()
    assert multiprocessing.active_children() == []


def _drive(engine: LLMEngine) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert not engine.has_unfinished_requests()
    return done


def test_a_data_parallel_handoff_reads_rank_one_into_rank_one(qwen3_moe: str) -> None:
    engine = dict(**ENGINE, batch_invariant=True)
    dp = dict(data_parallel_size=2, enable_expert_parallel=True)
    links = Links()
    prefill = LLMEngine(EngineConfig(model=qwen3_moe, **engine, **dp), kv_connector=links.prefill)
    decode_link = links.decode("decode-dp-a")
    decode = LLMEngine(EngineConfig(model=qwen3_moe, **engine, **dp), kv_connector=decode_link)
    single = LLMEngine(EngineConfig(model=qwen3_moe, **engine))
    try:
        want = run(single, "cold", PROMPT, GREEDY).token_ids
        region = prefill.kv_region
        assert isinstance(region, DataParallelKVRegion) and isinstance(prefill.scheduler, DataParallelScheduler)
        pool = prefill.kv_ranks[1].pool
        free = pool.num_free_blocks
        # A filler keeps rank 0 busy, so the handed-off prompt runs on rank 1.
        filler = random_prompts([40], vocab=500, seed=9)[0]
        prefill.add_request(EngineRequest("filler", filler, SamplingParams(max_tokens=20, temperature=0.0,
                                                                           ignore_eos=True)))  # fmt: skip
        prefill.add_request(EngineRequest("r", PROMPT, FIRST, kv_transfer=HOLD))
        assert prefill.scheduler.rank_of["r"] == 1
        first = _drive(prefill)["r"]
        held = first.kv.held  # type: ignore[union-attr]
        assert held is not None and held.num_blocks == len(PROMPT) // BLOCK
        theirs = _lookup(pool, prefill.kv_ranks[1].hash_chain(PROMPT)[: held.num_blocks], PROMPT)
        assert held.block_ids[0] == [b + region.offsets(1)[0] for b in theirs]  # instance-wide ids of rank 1
        # Decode: rank 0 gets a request first, so the load lands in rank 1.
        decode.add_request(EngineRequest("d-filler", filler, GREEDY))
        decode.add_request(EngineRequest("r", PROMPT, GREEDY, resume_token_ids=first.token_ids,
                                         kv_transfer=KVTransferParams(load=True, source=links.source(prefill, held))))
        assert isinstance(decode.scheduler, DataParallelScheduler) and decode.scheduler.rank_of["r"] == 1
        out = _drive(decode)["r"]
        assert out.kv is not None and out.kv.load_path == "nixl" and not out.kv.load_failed
        assert out.kv.num_loaded_blocks == held.num_blocks and out.token_ids == want
        assert decode_link.num_bytes_read == held.num_blocks * region.block_bytes
        ours = _lookup(decode.kv_ranks[1].pool, decode.kv_ranks[1].hash_chain(PROMPT)[: held.num_blocks], PROMPT)
        theirs_kv = region.ranks[1].read_payloads({0: theirs})
        assert theirs_kv.any() and theirs_kv.equal(decode.kv_region.ranks[1].read_payloads({0: ours}))  # type: ignore[attr-defined]
        _until_released(prefill, pool, free)
    finally:
        single.close()
        decode.close()
        prefill.close()
    assert multiprocessing.active_children() == []


def test_a_replicated_attention_instance_and_a_one_rank_instance_hand_off_through_nixl(tmp_path) -> None:  # noqa: ANN001
    """DeepSeek-V4 over 2 expert-parallel ranks keeps its attention replicated: every rank
    holds the whole KV. Its blocks are read once into a one-rank decode (the first copy),
    and a one-rank prefill's blocks are fanned out into both of its ranks (twice the bytes,
    and rank 1's cache equal to rank 0's). Exact replay and a 321-token prompt, as
    tests/parity/test_data_parallel_kv.py runs V4: its compressed blocks and the window
    both matter to the tokens."""
    from tests.helpers.deepseek_v4_models import save_tiny_v4

    model = str(save_tiny_v4("mixed", tmp_path / "v4", seed=1))
    args = dict(model=model, block_size=BLOCK, prefill_chunk_size=8, max_num_batched_tokens=24, swa_replay="exact")
    ep = dict(tensor_parallel_size=2, enable_expert_parallel=True)
    prompt = random_prompts([321], vocab=200, seed=7)[0]
    links = Links()
    cold = LLMEngine(EngineConfig(**args))
    try:
        want = run(cold, "cold", prompt, GREEDY).token_ids
    finally:
        cold.close()
    # Replicated prefill into one rank.
    prefill = LLMEngine(EngineConfig(**args, **ep), kv_connector=links.prefill)
    one_link = links.decode("decode-v4-one-a")
    one = LLMEngine(EngineConfig(**args), kv_connector=one_link)
    try:
        assert isinstance(prefill.kv_region, RankedKVRegion) and prefill.kv_region.placement.kind == "replicated"
        free = prefill.kv.pool.num_free_blocks
        first = run(prefill, "x", prompt, FIRST, kv_transfer=HOLD)
        out = run(one, "x", prompt, GREEDY, resume_token_ids=first.token_ids,
                  kv_transfer=KVTransferParams(load=True, source=links.source(prefill, first.kv.held)))  # fmt: skip
        assert out.kv.load_path == "nixl" and out.kv.num_loaded_blocks == first.kv.held.num_blocks
        assert not out.kv.load_failed and out.token_ids == want and one_link.num_bytes_read > 0
        _until_released(prefill, prefill.kv.pool, free)
    finally:
        one.close()
        prefill.close()
    # One-rank prefill into a replicated decode: every rank gets the blocks.
    links = Links()
    prefill = LLMEngine(EngineConfig(**args), kv_connector=links.prefill)
    ep_link = links.decode("decode-v4-ep-a")
    decode = LLMEngine(EngineConfig(**args, **ep), kv_connector=ep_link)
    try:
        first = run(prefill, "x", prompt, FIRST, kv_transfer=HOLD)
        out = run(decode, "x", prompt, GREEDY, resume_token_ids=first.token_ids,
                  kv_transfer=KVTransferParams(load=True, source=links.source(prefill, first.kv.held)))  # fmt: skip
        assert out.kv.load_path == "nixl" and out.kv.num_loaded_blocks == first.kv.held.num_blocks
        assert not out.kv.load_failed and out.token_ids == want
        assert ep_link.num_bytes_read == 2 * one_link.num_bytes_read  # the same blocks, into both ranks
        ranks = decode.kv_region.ranks  # type: ignore[attr-defined]
        # Rank 1 holds every loaded block as rank 0 does: they differ at most in the 3 blocks
        # decode computed after the load (10 tokens past 321; the ranks' rounding may differ
        # there). Had rank 1 missed the fan-out, its loaded blocks would be zeros.
        layout = decode.kv_region.kv_layout
        for g in decode.kv_region.persistent_groups:
            for layer in layout.groups[g].layers:
                t = layout.tensor_index(layer)
                mine, theirs = ranks[0].tensors[t].transpose(0, 1).flatten(1), ranks[1].tensors[t].transpose(0, 1).flatten(1)
                assert int((mine != theirs).any(1).sum()) <= 3 and int((mine != 0).any(1).sum()) >= 20, (g, layer)
    finally:
        decode.close()
        prefill.close()
    assert multiprocessing.active_children() == []
