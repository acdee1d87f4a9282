"""The sliding window of a prefill -> decode handoff, without a model: which blocks one
direct load copies (copy_plan), the blocks decode reserves for the window, and when the
window enters decode's prefix index (only after a whole load), so admission replays
nothing; and the window prefill finds to hold."""

from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams
from shared.kv.memory.coordinator import KVCacheCoordinator
from shared.kv.spec import kv_cache_layout
from shared.kv.transfer import KVTransferParams, PeerSource, copy_plan, persistent_ids

HYBRID = kv_cache_layout([None, 8, None, 8])  # group 0: full layers 0, 2; group 1: window 8, layers 1, 3
BLOCK = 4
PROMPT = list(range(20))  # 5 full blocks; a query at 20 sees keys 13..20: blocks 3 and 4


def source(window_first: int = 3, window: dict[int, list[int]] | None = None) -> PeerSource:
    window = {1: [40, 41]} if window is None else window
    return PeerSource("prefill-0", b"", {0: [30, 31, 32, 33, 34]}, 5, 0.0, "x", window_first, window)


def handoff_request(src: PeerSource | None) -> Request:
    """Decode's request after a handoff: the prompt and prefill's first token."""
    req = Request("r", PROMPT + [99], SamplingParams(max_tokens=8), kv_transfer=KVTransferParams(load=True, source=src))
    return req


def coordinator(num_blocks: int = 32) -> KVCacheCoordinator:
    return KVCacheCoordinator(HYBRID, num_blocks, BLOCK, "fp")


# -- copy_plan ---------------------------------------------------------------------------


def test_copy_plan_takes_the_missing_persistent_run_and_the_whole_window():
    # Decode holds blocks 0-1 itself: the load is blocks 2-4, into the reserved ids.
    reserved = {0: [1, 2, 3], 1: [4, 5]}
    assert copy_plan(source(), 2, 3, reserved) == ({0: [32, 33, 34], 1: [40, 41]}, {0: [1, 2, 3], 1: [4, 5]})


def test_copy_plan_without_a_window_copies_the_persistent_groups_only():
    assert copy_plan(source(window={}), 0, 5, {0: [1, 2, 3, 4, 5]}) == ({0: [30, 31, 32, 33, 34]}, {0: [1, 2, 3, 4, 5]})


def test_copy_plan_copies_no_window_the_reservation_has_no_room_for():
    # A reservation made without the window (or too small for it): the window is left out whole.
    assert copy_plan(source(), 0, 5, {0: [1, 2, 3, 4, 5], 1: [6]}) == (
        {0: [30, 31, 32, 33, 34]},
        {0: [1, 2, 3, 4, 5]},
    )


def test_a_store_gets_the_persistent_groups_ids_only():
    assert persistent_ids({0: [1, 2], 1: [3], 2: [4]}, (0, 2)) == {0: [1, 2], 2: [4]}


# -- decode's reservation and index ---------------------------------------------------------


def test_a_load_with_a_window_reserves_blocks_for_it_in_each_sliding_group():
    kv = coordinator()
    req = handoff_request(source())
    kv.update_block_hashes(req)
    assert kv.reserve_for_load(req, 5)
    assert kv.reserved_block_ids("r") == {0: [0, 1, 2, 3, 4], 1: [5, 6]}
    assert kv.pool.num_free_blocks == 32 - 7
    kv.release_reserved("r")
    assert kv.pool.num_free_blocks == 32


def test_a_load_without_a_window_or_with_one_of_another_layout_reserves_none():
    for src in (None, source(window={}), source(window={2: [40, 41]}), source(window={1: [40]})):
        kv = coordinator()
        req = handoff_request(src)
        kv.update_block_hashes(req)
        assert kv.reserve_for_load(req, 5)
        assert kv.reserved_block_ids("r") == {0: [0, 1, 2, 3, 4]}, src


def test_a_window_that_does_not_fit_the_pool_reserves_nothing():
    kv = coordinator(num_blocks=6)  # 5 persistent blocks fit, 5 + 2 do not
    req = handoff_request(source())
    kv.update_block_hashes(req)
    assert not kv.reserve_for_load(req, 5)
    assert kv.reserved_block_ids("r") == {} and kv.pool.num_free_blocks == 6


def admit(kv: KVCacheCoordinator, req: Request) -> tuple[int, int]:
    hit = kv.find_prefix_hit(req)
    assert kv.allocate_slots(req, req.num_tokens - hit.num_computed, hit)
    kv.release_reserved(req.request_id)
    return hit.num_tokens, hit.num_computed


def test_a_whole_load_indexes_the_window_and_admission_replays_nothing():
    kv = coordinator()
    req = handoff_request(source())
    kv.update_block_hashes(req)
    kv.reserve_for_load(req, 5)
    kv.index_loaded(req, 0, 5, window=True)
    assert admit(kv, req) == (20, 20)
    assert kv.num_replays == 0
    null = kv.pool.null_block.block_id
    # The sliding table resumes on the loaded window blocks (5, 6), nulls before block 3.
    assert kv.block_ids("r") == [[0, 1, 2, 3, 4, 7], [null, null, null, 5, 6, 8]]


def test_a_load_that_was_not_whole_indexes_no_window_and_admission_replays():
    kv = coordinator()
    req = handoff_request(source())
    kv.update_block_hashes(req)
    kv.reserve_for_load(req, 5)
    kv.index_loaded(req, 0, 5, window=False)
    window_ids = kv.reserved_block_ids("r")[1]
    for i, block_id in zip((3, 4), window_ids):
        chunk = tuple(PROMPT[i * BLOCK : (i + 1) * BLOCK])
        assert kv.pool.lookup(req.block_hashes[i], 1, chunk) is None
        assert kv.pool.blocks[block_id].block_hash is None
    hit_tokens, computed = admit(kv, req)
    assert hit_tokens == 20 and computed < 20 and kv.num_replays == 1
    # The unused window blocks went back to the pool; the request's table took none of them.
    assert all(kv.pool.blocks[i].ref_cnt == 0 for i in window_ids)
    assert not set(window_ids) & set(kv.block_ids("r")[1])


# -- prefill's window to hold ------------------------------------------------------------------


def test_the_window_to_hold_is_found_in_the_index_after_the_request_freed_it():
    kv = coordinator(num_blocks=16)
    req = Request("p", PROMPT + [7], SamplingParams(max_tokens=1))
    hit = kv.find_prefix_hit(req)
    assert kv.allocate_slots(req, req.num_tokens - hit.num_computed, hit)
    req.num_computed_tokens = req.num_tokens
    sliding = kv.block_ids("p")[1]
    kv.free(req)
    first, window = kv.window_blocks(req, 5)
    assert first == 3 and {g: [b.block_id for b in blocks] for g, blocks in window.items()} == {1: sliding[3:5]}
    # Once a block of it is handed out again, there is no window to hold.
    assert kv.pool.allocate(kv.pool.num_free_blocks) is not None
    assert kv.window_blocks(req, 5) == (0, {})
