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
