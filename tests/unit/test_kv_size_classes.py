"""A size class per page size: DeepSeek-V4's caches take the bytes of their own rows,
not of the widest row; uniform models keep one class and their old cache."""

import torch

from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams
from shared.kv.memory.coordinator import KVCacheCoordinator, blocks_for_one_request, blocks_in_budget, blocks_per_class
from shared.kv.memory.region import KVRegion, per_tensor
from shared.kv.memory.share import SharedMemoryAllocator, open_peer
from shared.kv.spec import CacheRow, CompressedSpec, SlidingWindowSpec, kv_cache_layout, kv_cache_layout_of_specs
from shared.model.config import ModelConfig
from shared.model.models.deepseek_v4 import DeepseekV4ForCausalLM, entry_width
from shared.model.models.deepseek_v4_config import SLIDING
from tests.helpers.deepseek_v4_models import save_tiny_v4

BLOCK = 4


def _allocated_bytes(caches: list[torch.Tensor]) -> int:
    """Bytes of the distinct allocations behind the cache tensors."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in caches}
    return sum(storages.values())


def test_v4_bytes_per_token_are_the_sum_of_its_true_row_widths(tmp_path) -> None:
    config = ModelConfig.from_pretrained(save_tiny_v4("mixed", tmp_path, seed=3))
    model = DeepseekV4ForCausalLM(config)
    p = config.deepseek_v4
    assert p is not None
    # What each cache holds per token, from the layers themselves: a state row's plane 0
    # (window K = V, compressor and indexer kv) and plane 1 (their gates); an entry.
    # A compressed cache keeps an entry per `rate` raw tokens: a block of BLOCK tokens holds
    # BLOCK / rate rows (one row when the rate exceeds the block), not BLOCK.
    true_width = sum(layer.self_attn.row.plane0 + layer.self_attn.row.plane1 for layer in model.model.layers)
    entries = [(entry_width(config, t), r) for t, r in zip(p.layer_types, p.compress_rates) if t != SLIDING]
    assert any(r > BLOCK for _, r in entries)  # an HCA layer: one row a block
    block_elements = BLOCK * true_width + sum(width * max(1, BLOCK // r) for width, r in entries)
    true_width += sum(width for width, _ in entries)
    num_blocks = 10
    caches = model.allocate_kv_cache(num_blocks, BLOCK, torch.float32, "cpu")
    element = 4
    assert _allocated_bytes(caches) == num_blocks * block_elements * element
    assert model.kv_bytes_per_block(BLOCK, torch.float32) == block_elements * element
    assert block_elements < BLOCK * true_width
    # The padded layout took a block of every group at two planes of the widest state
    # plane 0 (or entry) in group_size tensors: more than twice as much here.
    widest = max(layer.self_attn.row.plane0 for layer in model.model.layers)
    layout = model.kv_layout
    padded = len(layout.groups) * layout.group_size * 2 * widest * BLOCK * element
    assert 2 * model.kv_bytes_per_block(BLOCK, torch.float32) < padded


def test_uniform_layout_keeps_one_class_and_its_stacked_cache() -> None:
    layout = kv_cache_layout([None, 8, None, 8, 8])
    assert layout.size_classes == (None,) and set(layout.size_class_of_group) == {0}
    assert [layout.tensor_index(i) for i in range(5)] == [layout.tensor_of_layer(i) for i in range(5)]
    assert layout.elements_per_block(BLOCK, CacheRow(2, 4, 8)) == BLOCK * 2 * 4 * 8 * layout.group_size
    assert blocks_for_one_request(layout, 9, BLOCK) == 3 * len(layout.groups)


def _mixed_layout():
    # A sliding group of caches 0 and 1 (rows 6 and 10), a compressed one of 2 and 3 (6, 6).
    specs = [SlidingWindowSpec(8), SlidingWindowSpec(8), CompressedSpec(4, 6), CompressedSpec(4, 6)]
    rows = [CacheRow(1, 1, 6), CacheRow(1, 1, 10), CacheRow(1, 1, 6), CacheRow(1, 1, 6)]
    return kv_cache_layout_of_specs(specs, rows)


def test_rows_that_differ_give_every_group_a_class_of_its_own() -> None:
    layout = _mixed_layout()
    assert [g.layers for g in layout.groups] == [(0, 1), (2, 3)]
    assert layout.size_class_of_group == (0, 1)
    assert layout.size_classes == ((CacheRow(1, 1, 6), CacheRow(1, 1, 10)), (CacheRow(1, 1, 6),) * 2)
    assert layout.num_tensors == 4 and [layout.tensor_index(i) for i in range(4)] == [0, 1, 2, 3]
    # The compressed group (rate 4, BLOCK 4) keeps one entry row a block, not BLOCK.
    assert [layout.block_rows(c, BLOCK) for c in range(2)] == [BLOCK, 1]
    assert layout.elements_per_block(BLOCK) == BLOCK * (6 + 10) + (6 + 6)
    assert blocks_for_one_request(layout, 9, BLOCK) == 3  # each class serves one group


def test_each_class_has_its_own_blocks_and_admission_checks_each() -> None:
    layout = _mixed_layout()
    kv = KVCacheCoordinator(layout, num_blocks=3, block_size=BLOCK, model_fingerprint="t", enable_prefix_caching=False)
    assert kv.pool.num_total_blocks == 6
    a = Request("a", list(range(8)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(a, 8)  # 2 blocks in each group, each from its own class
    assert kv.block_ids("a") == [[0, 1], [0, 1]]  # every class counts from 0: its own tensors
    assert [kv.pool.num_free(c) for c in range(2)] == [1, 1]
    b = Request("b", list(range(8)), SamplingParams(max_tokens=1))
    assert not kv.allocate_slots(b, 8)  # 2 more in classes of 1 free
    assert [kv.pool.num_free(c) for c in range(2)] == [1, 1]  # nothing taken
    kv.free(a)
    assert kv.allocate_slots(b, 8)


def test_region_moves_blocks_of_rows_of_different_widths() -> None:
    layout = _mixed_layout()
    gen = torch.Generator().manual_seed(0)
    narrow = torch.rand(1, 6, BLOCK, 1, 6, generator=gen)
    wide = torch.rand(1, 6, BLOCK, 1, 10, generator=gen)
    entries = [torch.rand(1, 6, BLOCK, 1, 6, generator=gen) for _ in range(2)]
    region = KVRegion([narrow, wide, *entries], layout)
    assert all(a is b for a, b in zip(region.tensors, [narrow, wide, *entries]))
    assert region.block_bytes == 2 * 6 * 4  # the compressed pages: 1 entry row of 6 in each of 2 caches
    payloads = region.read_payloads({1: [1, 5]})
    assert torch.equal(payloads[1].view(torch.float32), torch.cat([entries[0][0, 5, 0, 0], entries[1][0, 5, 0, 0]]))
    # The state cache's round trip over the sliding group (rows of 6 and 10).
    saved = region.gather({0: [1, 2]})
    assert saved.shape == (2, BLOCK * (6 + 10))
    fresh = [torch.zeros(1, 6, BLOCK, 1, 6), torch.zeros(1, 6, BLOCK, 1, 10)]
    other = KVRegion([*fresh, torch.zeros(1, 6, BLOCK, 1, 6), torch.zeros(1, 6, BLOCK, 1, 6)], layout)
    other.scatter({0: [4, 5]}, saved)
    assert torch.equal(fresh[0][:, 4:6], narrow[:, 1:3]) and torch.equal(fresh[1][:, 4:6], wide[:, 1:3])
    # A peer's cache, copied group by group into the group's own tensors.
    other.copy_from_peer([narrow, wide, *entries], {0: [5]}, {0: [2]})
    assert torch.equal(fresh[0][:, 2], narrow[:, 5]) and torch.equal(fresh[1][:, 2], wide[:, 5])


def test_v4_cache_of_mixed_rows_is_mapped_and_copied_by_a_peer(tmp_path) -> None:
    """A peer on this host maps every size class's tensors (one shared file each) from the
    region's description, and a copy lands each group's blocks in its own tensors."""
    model = DeepseekV4ForCausalLM(ModelConfig.from_pretrained(save_tiny_v4("mixed", tmp_path, seed=3)))
    layout = model.kv_layout
    allocator = SharedMemoryAllocator()
    ours = KVRegion(model.allocate_kv_cache(6, BLOCK, torch.float32, "cpu", allocator), layout, allocator)
    theirs_alloc = SharedMemoryAllocator()
    theirs = KVRegion(model.allocate_kv_cache(6, BLOCK, torch.float32, "cpu", theirs_alloc), layout, theirs_alloc)
    gen = torch.Generator().manual_seed(1)
    for t in theirs.tensors:
        t.copy_(torch.rand(t.shape, generator=gen))
    _, mapped = open_peer(theirs.share(), torch.device("cpu"))
    assert [t.shape for t in per_tensor(mapped)] == [t.shape for t in theirs.tensors]
    groups = range(len(layout.groups))
    ours.copy_from_peer(mapped, {g: [4, 1] for g in groups}, {g: [0, 2] for g in groups})
    for t, src in zip(ours.tensors, theirs.tensors):
        assert torch.equal(t[:, 0], src[:, 4]) and torch.equal(t[:, 2], src[:, 1])
    ours.close()
    theirs.close()


def test_a_sliding_class_gets_a_window_of_blocks_per_request_not_one_per_token() -> None:
    layout = _mixed_layout()  # window 8, blocks of 4
    # 2 requests * (ceil(8 / 4) + 2) + 2 * ceil(8 step tokens / 4) = 12; the compressed class keeps 100.
    assert blocks_per_class(layout, 100, BLOCK, max_num_seqs=2, max_step_tokens=8) == (12, 100)
    assert blocks_per_class(layout, 10, BLOCK, max_num_seqs=2, max_step_tokens=8) == (10, 10)  # never more than tokens
    assert blocks_per_class(kv_cache_layout([None, 8]), 100, BLOCK, 2, 8) == (100,)  # one class: nothing apart


def test_the_budget_the_sliding_class_leaves_goes_to_the_persistent_class() -> None:
    layout = _mixed_layout()
    class_bytes = [e * 4 for e in layout.class_elements_per_block(BLOCK)]
    assert class_bytes == [BLOCK * (6 + 10) * 4, (6 + 6) * 4]
    budget = 100_000
    n = blocks_in_budget(layout, class_bytes, budget, BLOCK, max_num_seqs=2, max_step_tokens=8)
    counts = blocks_per_class(layout, n, BLOCK, 2, 8)
    spent = sum(c * b for c, b in zip(counts, class_bytes))
    assert counts[0] == 12 < counts[1] == n
    assert spent <= budget < spent + class_bytes[1]  # no persistent block more would fit
    assert n > 6 * (budget // sum(class_bytes))  # 2019 against 328 when every class had n blocks


def test_requests_decoding_long_past_the_window_fit_the_sliding_class() -> None:
    """Two requests, prompts chunked under an 8-token budget, then decoding far past the
    window with prefix caching on: every step's allocation succeeds in a sliding class of
    12 blocks (the compressed class grows with the tokens), dropped window blocks point at
    the sliding class's own null block (id 12, a row its tensors have), and freeing
    returns every block."""
    layout = _mixed_layout()
    counts = blocks_per_class(layout, 60, BLOCK, max_num_seqs=2, max_step_tokens=8)
    kv = KVCacheCoordinator(layout, counts, BLOCK, "t")
    assert kv.pool.blocks_per_class == (12, 60)
    requests = [Request(r, list(range(i, i + 19)), SamplingParams(max_tokens=100)) for i, r in enumerate("ab")]
    for r in requests:
        assert kv.allocate_slots(r, 0, kv.find_prefix_hit(r))
    for step in range(90):
        budget = 8
        for r in requests:
            num_new = min(r.num_tokens - r.num_computed_tokens, budget)
            if num_new == 0:
                continue
            assert kv.allocate_slots(r, num_new), f"step {step}: the sliding class ran short"
            budget -= num_new
            r.num_computed_tokens += num_new
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token(1000 + step)
    window_blocks = [b for b in kv.block_ids("a")[0] if b != 12]
    assert kv.block_ids("a")[0][0] == 12 and len(window_blocks) <= 8 // BLOCK + 2
    assert 60 not in kv.block_ids("a")[1] and len(kv.block_ids("a")[1]) == -(-requests[0].num_computed_tokens // BLOCK)
    for r in requests:
        kv.free(r)
    assert [kv.pool.num_free(c) for c in range(2)] == [12, 60]
