"""Exact block ids per KV cache group and eviction order of the KV cache
coordinator (no model), in the style of vLLM's tests/v1/core/test_prefix_caching.py."""

from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams
from shared.kv.memory.coordinator import KVCacheCoordinator
from shared.kv.memory.state_cache import SlidingState, SlidingStateCache
from shared.kv.spec import kv_cache_layout

FULL = kv_cache_layout([None])
HYBRID = kv_cache_layout([None, 8, None, 8])  # group 0: full layers 0, 2; group 1: window 8, layers 1, 3


def full_attention_kv(num_blocks: int, block_size: int, model_fingerprint: str) -> KVCacheCoordinator:
    """A coordinator of one full-attention group: the uniform cache of a Llama."""
    return KVCacheCoordinator(FULL, num_blocks, block_size, model_fingerprint)


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def admit(kv: KVCacheCoordinator, req: Request) -> int:
    hit = kv.find_prefix_hit(req)
    assert kv.allocate_slots(req, req.num_tokens - hit.num_computed, hit)
    req.num_computed_tokens = req.num_tokens
    return hit.num_tokens


def test_allocation_takes_blocks_in_order_and_free_returns_them_tail_first():
    kv = full_attention_kv(num_blocks=8, block_size=4, model_fingerprint="fp")
    req = make_request("a", list(range(10)))  # 3 blocks
    assert admit(kv, req) == 0
    assert kv.block_ids("a") == [[0, 1, 2]]
    kv.free(req)
    assert kv.pool.num_free_blocks == 8
    # Free queue: untouched 3..7, then a's blocks tail first: 2, 1, 0.
    assert list(kv.pool._free) == [3, 4, 5, 6, 7, 2, 1, 0]


def test_prefix_hit_reuses_blocks_and_leaves_last_token_to_compute():
    kv = full_attention_kv(num_blocks=16, block_size=4, model_fingerprint="fp")
    a = make_request("a", list(range(12)))  # exactly 3 full blocks
    admit(kv, a)
    b = make_request("b", list(range(12)))
    # All 12 tokens are cached, but the last token must be recomputed for
    # logits, so only 2 full blocks (8 tokens) are adopted.
    assert admit(kv, b) == 8
    assert kv.block_ids("b")[0][:2] == kv.block_ids("a")[0][:2]
    assert kv.block_ids("b")[0][2] != kv.block_ids("a")[0][2]
    assert kv.pool.blocks[0].ref_cnt == 2


def test_freed_cached_blocks_are_hit_until_evicted_lru_first():
    kv = full_attention_kv(num_blocks=6, block_size=4, model_fingerprint="fp")
    a = make_request("a", list(range(9)))  # blocks 0, 1 full, 2 partial
    admit(kv, a)
    kv.free(a)
    # Reuse after free: a request with the same prefix takes blocks 0 and 1 back.
    b = make_request("b", list(range(8)) + [100, 101])
    assert admit(kv, b) == 8
    assert kv.block_ids("b")[0][:2] == [0, 1]
    kv.free(b)
    # Fill the pool with unrelated tokens: blocks come off the LRU front,
    # evicting the cached prefix; afterwards no hit is left.
    c = make_request("c", [500 + i for i in range(24)])
    admit(kv, c)
    kv.free(c)
    d = make_request("d", list(range(9)))
    assert admit(kv, d) == 0


def test_hit_compares_tokens_not_only_hashes():
    kv = full_attention_kv(num_blocks=8, block_size=4, model_fingerprint="fp")
    a = make_request("a", list(range(9)))
    admit(kv, a)
    # Forge a colliding hash: same hash list, other tokens.
    b = make_request("b", [7, 7, 7, 7, 7, 7, 7, 7, 7])
    kv.update_block_hashes(b)
    b.block_hashes = list(a.block_hashes)
    hit = kv.find_prefix_hit(b)
    assert (hit.tables, hit.num_tokens) == ([[]], 0)


def test_allocate_returns_none_and_changes_nothing_when_short():
    kv = full_attention_kv(num_blocks=4, block_size=4, model_fingerprint="fp")
    a = make_request("a", list(range(12)))
    admit(kv, a)
    b = make_request("b", [50 + i for i in range(8)])
    assert not kv.allocate_slots(b, 8)
    assert kv.pool.num_free_blocks == 1
    assert kv.block_ids("b") == [[]]


def test_decode_blocks_are_cached_as_they_fill():
    kv = full_attention_kv(num_blocks=8, block_size=4, model_fingerprint="fp")
    a = make_request("a", [1, 2, 3])
    admit(kv, a)
    for t in (4, 5):  # the 4th token fills block 0
        a.append_output_token(t)
        kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert kv.pool.num_cached_blocks == 1
    b = make_request("b", [1, 2, 3, 4, 9])
    assert admit(kv, b) == 4


# -- hybrid models: a full-attention group and a sliding-window group ------------


def decode(kv: KVCacheCoordinator, req: Request, tokens: list[int]) -> None:
    for t in tokens:
        req.append_output_token(t)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1


def test_hybrid_groups_get_their_own_blocks_and_sliding_blocks_leave_the_window():
    kv = KVCacheCoordinator(HYBRID, num_blocks=16, block_size=4, model_fingerprint="fp")
    a = make_request("a", list(range(10)))
    assert admit(kv, a) == 0
    assert kv.block_ids("a") == [[0, 1, 2], [3, 4, 5]]
    decode(kv, a, [100] * 6)  # 16 tokens: the full group grows, the window (8) slides
    # The last step computed token 15, in block 3: what a query at 12 (that block's start)
    # sees, keys 5..12, is kept; block 0 (tokens 0..3) left the window and is free again.
    null = kv.pool.null_block.block_id
    assert kv.block_ids("a") == [[0, 1, 2, 6], [null, 4, 5, 7]]
    assert list(kv.pool._free)[-1] == 3
    decode(kv, a, [100, 100])  # tokens 16 and 17: block 1 (tokens 4..7) leaves too
    assert kv.block_ids("a") == [[0, 1, 2, 6, 8], [null, null, 5, 7, 9]]
    assert list(kv.pool._free)[-2:] == [3, 4]


def test_sliding_memory_per_request_is_bounded_by_the_window():
    kv = KVCacheCoordinator(kv_cache_layout([8, 8]), num_blocks=8, block_size=4, model_fingerprint="fp")
    a = make_request("a", [1, 2, 3])
    admit(kv, a)
    decode(kv, a, list(range(200)))  # 203 tokens in an 8-block pool: only a window's worth is held
    held = [b for b in kv.block_ids("a")[0] if b != kv.pool.null_block.block_id]
    assert len(held) <= 8 // 4 + 2
    assert kv.pool.num_free_blocks == 8 - len(held)


def import_full_blocks(kv: KVCacheCoordinator, tokens: list[int], num_blocks: int) -> list[int]:
    """Enter the persistent group's blocks of a prefix, as a load from the kvcache service does."""
    req = make_request("import", tokens)
    kv.update_block_hashes(req)
    new = kv.pool.allocate(num_blocks)
    assert new is not None
    for i, block in enumerate(new):
        kv.pool.cache_block(block, req.block_hashes[i], 0, tuple(tokens[i * 4 : (i + 1) * 4]))
    kv.pool.free(new)
    return [b.block_id for b in new]


def test_hit_without_sliding_state_replays_the_last_window_bounded():
    kv = KVCacheCoordinator(HYBRID, num_blocks=16, block_size=4, model_fingerprint="fp", swa_replay="bounded")
    full = import_full_blocks(kv, list(range(20)), 5)
    assert full == [0, 1, 2, 3, 4]
    b = make_request("b", list(range(20)) + [99])
    hit = kv.find_prefix_hit(b)
    # H = 20 cached tokens; R = W = 8: replay from s = 12, sliding blocks before 12 // 4 = 3 are null.
    assert (hit.num_tokens, hit.num_computed, hit.is_replay) == (20, 12, True)
    assert kv.allocate_slots(b, b.num_tokens - hit.num_computed, hit)
    null = kv.pool.null_block.block_id
    assert kv.block_ids("b") == [[0, 1, 2, 3, 4, 5], [null, null, null, 6, 7, 8]]
    assert (kv.num_replays, kv.num_replayed_tokens) == (1, 8)


def test_exact_replay_length_is_sliding_layers_times_window_minus_one():
    kv = KVCacheCoordinator(HYBRID, num_blocks=16, block_size=4, model_fingerprint="fp", swa_replay="exact")
    assert kv.replay_length == 2 * (8 - 1)
    import_full_blocks(kv, list(range(20)), 5)
    b = make_request("b", list(range(20)) + [99])
    hit = kv.find_prefix_hit(b)
    assert (hit.num_tokens, hit.num_computed) == (20, 6)
    assert kv.allocate_slots(b, b.num_tokens - hit.num_computed, hit)
    null = kv.pool.null_block.block_id
    assert kv.block_ids("b") == [[0, 1, 2, 3, 4, 5], [null, 6, 7, 8, 9, 10]]


def test_a_hit_no_longer_than_the_replay_is_recomputed_from_the_start():
    kv = KVCacheCoordinator(HYBRID, num_blocks=16, block_size=4, model_fingerprint="fp", swa_replay="exact")
    import_full_blocks(kv, list(range(12)), 3)  # H = 12 <= R = 14
    b = make_request("b", list(range(12)) + [99])
    hit = kv.find_prefix_hit(b)
    assert (hit.num_tokens, hit.num_computed, hit.tables) == (0, 0, [[], []])


def test_local_hit_takes_the_sliding_window_blocks_from_the_index():
    kv = KVCacheCoordinator(HYBRID, num_blocks=32, block_size=4, model_fingerprint="fp")
    a = make_request("a", list(range(20)))
    admit(kv, a)
    ids_a = kv.block_ids("a")
    kv.free(a)
    b = make_request("b", list(range(20)) + [99])
    hit = kv.find_prefix_hit(b)
    assert (hit.num_tokens, hit.num_computed, hit.state) == (20, 20, None)
    assert kv.allocate_slots(b, 1, hit)
    null = kv.pool.null_block.block_id
    # A query at 20 sees keys 13..20: the sliding window needs a's blocks 3 and 4 only.
    assert kv.block_ids("b")[0][:5] == ids_a[0][:5]
    assert kv.block_ids("b")[1][:5] == [null, null, null, ids_a[1][3], ids_a[1][4]]


def test_state_cache_saves_the_window_at_the_end_and_resumes_without_replay():
    cache = SlidingStateCache(capacity_bytes=1 << 20, ttl_s=600)
    kv = KVCacheCoordinator(HYBRID, num_blocks=16, block_size=4, model_fingerprint="fp", state_cache=cache)
    a = make_request("a", list(range(18)))
    admit(kv, a)
    a.append_output_token(5)  # sampled, its KV not written: the state is taken at 16 tokens
    save = kv.free(a)
    assert save is not None
    # Window of a query at 16: keys 9..15, blocks 2 and 3 of the sliding group (ids 7, 8).
    assert (save.num_blocks, save.first_block, save.block_ids) == (4, 2, {1: [7, 8]})
    assert save.block_hash == a.block_hashes[3]
    cache.put(save.block_hash, SlidingState(save.num_blocks, save.first_block, "payload", 100))
    # Another worker's sliding blocks are gone: a fresh coordinator with only the full blocks.
    kv2 = KVCacheCoordinator(HYBRID, num_blocks=16, block_size=4, model_fingerprint="fp", state_cache=cache)
    import_full_blocks(kv2, list(range(16)), 4)
    b = make_request("b", list(range(16)) + [5, 6])
    hit = kv2.find_prefix_hit(b)
    assert (hit.num_tokens, hit.num_computed, hit.state.payload) == (16, 16, "payload")
    assert kv2.allocate_slots(b, 2, hit)
    null = kv2.pool.null_block.block_id
    assert kv2.block_ids("b") == [[0, 1, 2, 3, 4], [null, null, 5, 6, 7]]
    assert kv2.state_block_ids("b", hit.state) == {1: [5, 6]}


def test_state_cache_is_bounded_by_bytes_and_expires():
    now = [0.0]
    cache = SlidingStateCache(capacity_bytes=250, ttl_s=60, clock=lambda: now[0])
    for i in range(3):
        cache.put(bytes([i]) * 32, SlidingState(1, 0, i, 100))  # type: ignore[arg-type]
    assert len(cache) == 2 and cache.get(bytes([0]) * 32) is None  # the oldest went for room
    assert cache.get(bytes([2]) * 32).payload == 2
    now[0] = 61.0
    assert cache.get(bytes([2]) * 32) is None and cache.num_bytes == 0


def test_a_snapshot_lists_the_persistent_group_now_cached_and_drops_pending_events():
    kv = KVCacheCoordinator(HYBRID, num_blocks=12, block_size=4, model_fingerprint="fp", record_events=True)
    a = make_request("a", list(range(13)))  # 3 full blocks per group
    admit(kv, a)
    kv.free(a)
    assert kv.pool.drain_events() == (kv.hash_chain(list(range(12))), [])  # group 0's only
    # Unrelated tokens take the free blocks, evicting a's oldest-freed cached ones.
    c = make_request("c", [500 + i for i in range(20)])
    admit(kv, c)
    stored, removed = kv.pool.stored_events[:], kv.pool.removed_events[:]
    assert stored and removed  # pending: c's blocks in, some of a's out
    held = [h for h in kv.hash_chain(list(range(12))) + kv.hash_chain(c.prompt_token_ids) if h not in removed]
    assert sorted(kv.pool.snapshot_events()) == sorted(held)
    assert kv.pool.drain_events() == ([], [])  # the snapshot said it all
