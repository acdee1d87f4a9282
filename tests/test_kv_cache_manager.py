"""Exact block ids and eviction order of the KV cache manager (no model)."""

from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def admit(kv: KVCacheManager, req: Request) -> int:
    hits, num_cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_cached, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return num_cached


def test_allocation_takes_blocks_in_order_and_free_returns_them_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=4, model_fingerprint="fp")
    req = make_request("a", list(range(10)))  # 3 blocks
    assert admit(kv, req) == 0
    assert kv.block_ids("a") == [0, 1, 2]
    kv.free(req)
    assert kv.pool.num_free_blocks == 8
    # Free queue: untouched 3..7, then a's blocks tail first: 2, 1, 0.
    assert list(kv.pool._free) == [3, 4, 5, 6, 7, 2, 1, 0]


def test_prefix_hit_reuses_blocks_and_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4, model_fingerprint="fp")
    a = make_request("a", list(range(12)))  # exactly 3 full blocks
    admit(kv, a)
    b = make_request("b", list(range(12)))
    # All 12 tokens are cached, but the last token must be recomputed for
    # logits, so only 2 full blocks (8 tokens) are adopted.
    assert admit(kv, b) == 8
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.block_ids("b")[2] != kv.block_ids("a")[2]
    assert kv.pool.blocks[0].ref_cnt == 2


def test_freed_cached_blocks_are_hit_until_evicted_lru_first():
    kv = KVCacheManager(num_blocks=6, block_size=4, model_fingerprint="fp")
    a = make_request("a", list(range(9)))  # blocks 0, 1 full, 2 partial
    admit(kv, a)
    kv.free(a)
    # Reuse after free: a request with the same prefix takes blocks 0 and 1 back.
    b = make_request("b", list(range(8)) + [100, 101])
    assert admit(kv, b) == 8
    assert kv.block_ids("b")[:2] == [0, 1]
    kv.free(b)
    # Fill the pool with unrelated tokens: blocks come off the LRU front,
    # evicting the cached prefix; afterwards no hit is left.
    c = make_request("c", [500 + i for i in range(24)])
    admit(kv, c)
    kv.free(c)
    d = make_request("d", list(range(9)))
    assert admit(kv, d) == 0


def test_hit_compares_tokens_not_only_hashes():
    kv = KVCacheManager(num_blocks=8, block_size=4, model_fingerprint="fp")
    a = make_request("a", list(range(9)))
    admit(kv, a)
    # Forge a colliding hash: same hash list, other tokens.
    b = make_request("b", [7, 7, 7, 7, 7, 7, 7, 7, 7])
    kv.update_block_hashes(b)
    b.block_hashes = list(a.block_hashes)
    hits, num = kv.get_computed_blocks(b)
    assert (hits, num) == ([], 0)


def test_allocate_returns_none_and_changes_nothing_when_short():
    kv = KVCacheManager(num_blocks=4, block_size=4, model_fingerprint="fp")
    a = make_request("a", list(range(12)))
    admit(kv, a)
    b = make_request("b", [50 + i for i in range(8)])
    assert kv.allocate_slots(b, 8) is None
    assert kv.pool.num_free_blocks == 1
    assert kv.block_ids("b") == []


def test_decode_blocks_are_cached_as_they_fill():
    kv = KVCacheManager(num_blocks=8, block_size=4, model_fingerprint="fp")
    a = make_request("a", [1, 2, 3])
    admit(kv, a)
    for t in (4, 5):  # the 4th token fills block 0
        a.append_output_token(t)
        kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert kv.pool.num_cached_blocks == 1
    b = make_request("b", [1, 2, 3, 4, 9])
    assert admit(kv, b) == 4
