"""A data-parallel instance's KV through its one connector (issue 28, point 1): a
Qwen3-MoE engine over 2 real gloo ranks (``data_parallel_size=2``,
``enable_expert_parallel``) with a KV connector, as a mesh instance runs it
(shared/engine/dp_kv.py, shared/kv/memory/dp_region.py).

- Saves read each request's blocks out of the rank it ran on: the stored bytes are
  that rank's cache's, and the tokens are one process's (greedy, batch-invariant).
- A fresh instance loads a stored prefix into the rank the request is pinned to (rank
  1 here, rank 0 busy), and decodes the one-process tokens from it.
- A handoff between two data-parallel instances by the direct copy: prefill computes
  on rank 1, holds the blocks under instance-wide ids, decode copies them rank to rank
  into the rank it chose.
- The same handoff for GPT-OSS and DeepSeek-V4 (several KV groups): every group and the
  sliding-window blocks copied rank to rank, one process's tokens, no token replayed.
- Block events: a hash held by both ranks goes out once, and "removed" only when the
  last rank lets it go (real block pools).
"""

import multiprocessing

import pytest

from shared.engine.config import EngineConfig
from shared.engine.dp_kv import DataParallelKVTransfer, InstanceBlockEvents
from shared.engine.dp_scheduler import DataParallelScheduler
from shared.engine.engine_request import EngineRequest
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.sampling_params import SamplingParams
from shared.kv.block_hash import BlockHash
from shared.kv.connectors.memory import MemoryConnector, MemoryKVStore
from shared.kv.connectors.peer import PeerConnector
from shared.kv.memory.block_pool import BlockPool
from shared.kv.memory.dp_region import DataParallelKVRegion
from shared.kv.transfer import KVTransferParams, PeerSource
from tests.helpers.hf_models import random_prompts, save_tiny_hf_model

pytest.importorskip("transformers")

BLOCK = 4
ENGINE = dict(block_size=BLOCK, prefill_chunk_size=8, max_num_batched_tokens=24, batch_invariant=True)
DP = dict(data_parallel_size=2, enable_expert_parallel=True)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SAVE = KVTransferParams(save=True, wait_for_save=True)
HOLD = KVTransferParams(load=True, save=True, wait_for_save=True, hold=True)
PROMPTS = random_prompts([21, 17, 13], vocab=500, seed=5)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("dp-kv") / "qwen3_moe", seed=1))


@pytest.fixture(scope="module")
def single(model: str) -> list[list[int]]:
    """One process's greedy tokens of PROMPTS."""
    engine = LLMEngine(EngineConfig(model=model, **ENGINE))
    try:
        done = _drive(engine, {str(i): (p, None) for i, p in enumerate(PROMPTS)})
        return [done[str(i)].token_ids for i in range(len(PROMPTS))]
    finally:
        engine.close()


def _drive(engine: LLMEngine, requests: dict[str, tuple[list[int], KVTransferParams | None]],
           resume: dict[str, list[int]] | None = None, given: dict[str, int] | None = None,
           ) -> dict[str, RequestOutput]:  # fmt: skip
    """Every request to its end; ``given``: filled with the rank each was pinned to."""
    for rid, (prompt, transfer) in requests.items():
        engine.add_request(EngineRequest(rid, prompt, GREEDY, kv_transfer=transfer,
                                         resume_token_ids=(resume or {}).get(rid, [])))  # fmt: skip
        if given is not None and isinstance(engine.scheduler, DataParallelScheduler):
            given[rid] = engine.scheduler.rank_of[rid]
    done: dict[str, RequestOutput] = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    assert not engine.has_unfinished_requests()
    return done


def _held_on_rank_1(prefill: LLMEngine, rid: str, prompt: list[int], vocab: int) -> RequestOutput:
    """A data-parallel prefill's first token of ``prompt``, its blocks held for a peer's
    copy (HOLD): a filler keeps rank 0 busy, so the prompt runs on rank 1 (non-zero
    offsets in the instance's block ids)."""
    prefill.add_request(EngineRequest("filler", random_prompts([40], vocab=vocab, seed=9)[0],
                                      SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))  # fmt: skip
    prefill.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer=HOLD))
    assert isinstance(prefill.scheduler, DataParallelScheduler) and prefill.scheduler.rank_of[rid] == 1
    outs: dict[str, RequestOutput] = {}
    while prefill.has_unfinished_requests():
        outs.update((o.request_id, o) for o in prefill.step() if o.finished)
    return outs[rid]


def _rank_blocks(engine: LLMEngine, rank: int, prompt: list[int]) -> list[int] | None:
    """The rank's cache's block ids of the prompt's full blocks, None if it lacks one."""
    kv = engine.kv_ranks[rank]
    ids = []
    for i, h in enumerate(kv.hash_chain(prompt)[: len(prompt) // BLOCK]):
        block = kv.pool.lookup(h, 0, tuple(prompt[i * BLOCK : (i + 1) * BLOCK]))
        if block is None:
            return None
        ids.append(block.block_id)
    return ids


def test_saves_and_loads_go_through_the_rank_the_request_is_pinned_to(model: str, single: list[list[int]]) -> None:
    store = MemoryKVStore()
    engine = LLMEngine(EngineConfig(model=model, **ENGINE, **DP), kv_connector=MemoryConnector(store),
                       record_kv_events=True)  # fmt: skip
    try:
        region = engine.kv_region
        assert isinstance(region, DataParallelKVRegion) and isinstance(engine.scheduler, DataParallelScheduler)
        given: dict[str, int] = {}
        done = _drive(engine, {str(i): (p, SAVE) for i, p in enumerate(PROMPTS)}, given=given)
        assert given == {"0": 0, "1": 1, "2": 1}  # by KV tokens held, as added
        assert [done[str(i)].token_ids for i in range(len(PROMPTS))] == single
        for rid, rank in given.items():
            prompt = PROMPTS[int(rid)]
            assert done[rid].kv is not None and done[rid].kv.num_saved_blocks == len(prompt) // BLOCK
            ids = _rank_blocks(engine, rank, prompt)
            assert ids is not None and _rank_blocks(engine, 1 - rank, prompt) is None  # computed on its rank alone
            # What was stored is what the request's rank holds, byte for byte.
            ours = region.ranks[rank].read_payloads({0: ids})
            hashes = engine.kv_ranks[rank].hash_chain(prompt)[: len(ids)]
            stored = [store.blocks[(region.layout, h)] for h in hashes]
            assert ours.any() and [bytes(row.numpy().tobytes()) for row in ours] == stored
        stored_events, removed_events = engine.drain_kv_events()
        prompt_hashes = {h for i, p in enumerate(PROMPTS)
                         for h in engine.kv_ranks[given[str(i)]].hash_chain(p)[: len(p) // BLOCK]}  # fmt: skip
        assert len(stored_events) == len(set(stored_events)) and prompt_hashes <= set(stored_events)
        assert removed_events == []
        # Every save reported: the connector's views track no request any more (none leaks).
        transfer = engine.kv_transfer
        assert isinstance(transfer, DataParallelKVTransfer) and transfer.num_tracked == 0
    finally:
        engine.close()
    # A fresh instance: rank 0 is busy with a long request, so the stored prompt goes to rank 1 and loads there.
    fresh = LLMEngine(EngineConfig(model=model, **ENGINE, **DP), kv_connector=MemoryConnector(store))
    try:
        scheduler = fresh.scheduler
        assert isinstance(scheduler, DataParallelScheduler)
        busy = random_prompts([40], vocab=500, seed=9)[0]
        load = KVTransferParams(load=True)
        fresh.add_request(EngineRequest("busy", busy, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)))
        done = _drive(fresh, {"hit": (PROMPTS[0], load)})
        assert scheduler.rank_of == {} and "hit" in done
        hit = done["hit"]
        assert hit.kv is not None and hit.kv.num_loaded_blocks == len(PROMPTS[0]) // BLOCK and not hit.kv.load_failed
        assert hit.token_ids == single[0]
        ids = _rank_blocks(fresh, 1, PROMPTS[0])
        assert ids is not None and _rank_blocks(fresh, 0, PROMPTS[0]) is None  # loaded into rank 1 alone
        hashes = fresh.kv_ranks[1].hash_chain(PROMPTS[0])[: len(ids)]
        loaded = fresh.kv_region.ranks[1].read_payloads({0: ids})  # type: ignore[attr-defined]
        assert [bytes(row.numpy().tobytes()) for row in loaded] == [store.blocks[(fresh.kv_region.layout, h)]
                                                                     for h in hashes]  # fmt: skip
    finally:
        fresh.close()
    assert multiprocessing.active_children() == []


def test_a_handoff_between_data_parallel_instances_copies_rank_to_rank(model: str, single: list[list[int]]) -> None:
    released: list[str] = []
    prefill = LLMEngine(EngineConfig(model=model, **ENGINE, **DP), kv_connector=MemoryConnector(MemoryKVStore()),
                        share_kv=True)  # fmt: skip
    connector = PeerConnector(MemoryConnector(MemoryKVStore()), lambda peer, rid: released.append(rid))
    decode = LLMEngine(EngineConfig(model=model, **ENGINE, **DP), kv_connector=connector)
    try:
        first = _held_on_rank_1(prefill, "r", PROMPTS[1], vocab=500)
        held = first.kv.held  # type: ignore[union-attr]
        assert held is not None and held.num_blocks == len(PROMPTS[1]) // BLOCK
        region = prefill.kv_region
        assert isinstance(region, DataParallelKVRegion)
        # The handoff names rank 1's blocks by their instance-wide ids.
        local = _rank_blocks(prefill, 1, PROMPTS[1])
        assert local is not None and held.block_ids[0] == [b + region.offsets(1)[0] for b in local]
        source = PeerSource("prefill-0", region.share(), held.block_ids, held.num_blocks, held.deadline,
                            region.layout, held.window_first, held.window)  # fmt: skip
        # Decode: rank 0 gets a request first, so the import lands in rank 1 too; then one into rank 0.
        decode.add_request(EngineRequest("d-filler", PROMPTS[2], GREEDY))
        done = _drive(decode, {"r": (PROMPTS[1], KVTransferParams(load=True, source=source))},
                      resume={"r": first.token_ids})  # fmt: skip
        out = done["r"]
        assert out.kv is not None and out.kv.loaded_direct and out.kv.num_loaded_blocks == held.num_blocks
        assert released == ["r"] and out.token_ids == single[1]
        ours = _rank_blocks(decode, 1, PROMPTS[1])
        assert ours is not None
        theirs = region.ranks[1].read_payloads({0: local})
        ours_kv = decode.kv_region.ranks[1].read_payloads({0: ours})  # type: ignore[attr-defined]
        assert theirs.any() and theirs.equal(ours_kv)
    finally:
        decode.close()
        prefill.close()
    assert multiprocessing.active_children() == []


def test_the_instance_holds_a_hash_while_any_rank_does() -> None:
    pools = [BlockPool(1, record_events=True), BlockPool(1, record_events=True)]
    events = InstanceBlockEvents(pools)
    h = BlockHash(b"\x01" * 32)
    blocks = []
    for pool in pools:
        (block,) = pool.allocate(1) or []
        pool.cache_block(block, h, 0, (1, 2))
        blocks.append(block)
    assert events.drain() == ([h], [])  # both ranks took it in: one "stored"
    pools[0].free([blocks[0]])
    pools[0].allocate(1)  # rank 0's only block reused: its copy of h is evicted
    assert events.drain() == ([], [])  # rank 1 still holds it
    assert events.snapshot() == [h]
    pools[1].free([blocks[1]])
    pools[1].allocate(1)
    assert events.drain() == ([], [h])  # the last rank let it go


def _family_case(tmp_path, family: str) -> tuple[str, dict, list[int], list[int]]:
    """A family with several KV groups: its seeded tiny checkpoint, the engine arguments,
    a prompt and one process's greedy tokens of it. GPT-OSS batch-invariant (exact
    tokens across DP ranks); DeepSeek-V4 with exact replay (its default, bounded, drifts on
    random weights by design) and a prompt well past the replay after a load, so that the
    loaded compressed blocks are what its attention reads."""
    if family == "gpt_oss":
        model, mode = str(save_tiny_hf_model(family, tmp_path / family, seed=1)), dict(batch_invariant=True)
    else:
        from tests.helpers.deepseek_v4_models import save_tiny_v4

        model, mode = str(save_tiny_v4("mixed", tmp_path / family, seed=1)), dict(swa_replay="exact")
    engine_args = {**{k: v for k, v in ENGINE.items() if k != "batch_invariant"}, **mode}
    prompt = random_prompts([29 if family == "gpt_oss" else 321], vocab=200, seed=7)[0]
    one = LLMEngine(EngineConfig(model=model, **engine_args))
    try:
        expected = _drive(one, {"x": (prompt, None)})["x"].token_ids
    finally:
        one.close()
    return model, engine_args, prompt, expected


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v4"])
def test_every_kv_group_saves_and_loads_through_its_rank(tmp_path, family: str) -> None:
    """The families with several KV groups (GPT-OSS's sliding and full layers, V4's
    compressed caches beside its window caches, whose pools differ in size): the persistent
    groups' ids shift by their own stride in the region (dp_region.py), so a prompt stored
    from one DP instance on rank 1 and loaded into a fresh one lands in the pinned rank and
    decodes one process's tokens; an offset by another group's stride reads and writes
    other rows."""
    model, engine_args, prompt, expected = _family_case(tmp_path, family)
    store = MemoryKVStore()
    first = LLMEngine(EngineConfig(model=model, **engine_args, **DP), kv_connector=MemoryConnector(store))
    try:
        # A request on rank 0 first, so that the stored prompt runs on rank 1 (non-zero offsets).
        first.add_request(EngineRequest("busy", random_prompts([20], vocab=200, seed=8)[0], GREEDY))
        given: dict[str, int] = {}
        saved = _drive(first, {"x": (prompt, SAVE)}, given=given)["x"]
        assert given == {"x": 1} and saved.token_ids == expected
        assert saved.kv is not None and saved.kv.num_saved_blocks > 0
        assert isinstance(first.kv_region, DataParallelKVRegion) and len(first.kv_region.strides) > 1
    finally:
        first.close()
    fresh = LLMEngine(EngineConfig(model=model, **engine_args, **DP), kv_connector=MemoryConnector(store))
    try:
        fresh.add_request(EngineRequest("busy", random_prompts([20], vocab=200, seed=8)[0], GREEDY))
        given = {}
        loaded = _drive(fresh, {"x": (prompt, KVTransferParams(load=True))}, given=given)["x"]
        assert given == {"x": 1}
        assert loaded.kv is not None and loaded.kv.num_loaded_blocks == saved.kv.num_saved_blocks
        assert not loaded.kv.load_failed and loaded.token_ids == expected
    finally:
        fresh.close()
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v4"])
def test_a_handoff_carries_every_kv_group_and_the_window_rank_to_rank(tmp_path, family: str) -> None:
    """The direct copy between two data-parallel instances of the families with several
    KV groups: prefill computes on rank 1 (rank 0 busy) and holds the prompt's full blocks
    of every persistent group plus the sliding-window blocks a query at the handoff sees;
    decode copies them into the rank it chose (rank 1 too, rank 0 busy) and continues
    with one process's tokens without replaying a token (issue 26, point 2: the window
    travels in the handoff). A window block copied from the wrong rank or group would
    change the tokens (V4: a 321-token prompt, well past its window, so the compressed
    entries and the window both matter)."""
    model, engine_args, prompt, expected = _family_case(tmp_path, family)
    released: list[str] = []
    prefill = LLMEngine(EngineConfig(model=model, **engine_args, **DP), kv_connector=MemoryConnector(MemoryKVStore()),
                        share_kv=True)  # fmt: skip
    connector = PeerConnector(MemoryConnector(MemoryKVStore()), lambda peer, rid: released.append(rid))
    decode = LLMEngine(EngineConfig(model=model, **engine_args, **DP), kv_connector=connector)
    try:
        first = _held_on_rank_1(prefill, "x", prompt, vocab=200)
        held = first.kv.held  # type: ignore[union-attr]
        assert held is not None and held.window, "prefill held no sliding-window blocks for the handoff"
        region = prefill.kv_region
        source = PeerSource("prefill-0", region.share(), held.block_ids, held.num_blocks, held.deadline,
                            region.layout, held.window_first, held.window)  # fmt: skip
        decode.add_request(EngineRequest("d-filler", random_prompts([17], vocab=200, seed=3)[0], GREEDY))
        given: dict[str, int] = {}
        done = _drive(decode, {"x": (prompt, KVTransferParams(load=True, source=source))},
                      resume={"x": first.token_ids}, given=given)  # fmt: skip
        out = done["x"]
        assert given == {"x": 1}
        assert out.kv is not None and out.kv.loaded_direct and not out.kv.load_failed
        assert out.kv.num_loaded_blocks == held.num_blocks and out.kv.num_replayed_tokens == 0
        assert released == ["x"] and out.token_ids == expected
    finally:
        decode.close()
        prefill.close()
    assert multiprocessing.active_children() == []
