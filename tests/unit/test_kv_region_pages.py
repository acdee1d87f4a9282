"""KVRegion's per-group pages: a dense model's payload is its blocks' memory as it
is (the layout string and byte count of before); a DeepSeek-V4 layout's payload is
only its compressed groups' entries, and a payload written into another region lands
on exactly those rows and channels. The tiny V4 of make-model persists its logical
bytes per token with 128-token blocks (DeepSeek's classical blocks)."""

import pytest
import torch

from shared.kv.memory.region import KVRegion
from shared.kv.spec import CompressedSpec, SlidingWindowSpec, kv_cache_layout, kv_cache_layout_of_specs
from shared.model.models.deepseek_v4_config import CSA
from tools.make_model import make_model
from tools.bench.v4_kv_bytes import logical_bytes, measured_bytes

NUM_BLOCKS, BLOCK, WIDTH = 6, 8, 24


def caches(layout, heads: int = 1, width: int = WIDTH, seed: int = 0) -> list[torch.Tensor]:
    """As CausalLM.allocate_kv_cache lays them out: views of one allocation, random."""
    g = torch.Generator().manual_seed(seed)
    stacked = torch.randn((layout.group_size, 2, NUM_BLOCKS, BLOCK, heads, width), generator=g)
    tensors = list(stacked.unbind(0))
    return [tensors[layout.tensor_of_layer(i)] for i in range(layout.num_layers)]


def test_dense_payload_is_the_block_as_it_is() -> None:
    layout = kv_cache_layout([None, 4, None, 4])  # full attention and a window, alternating
    kv = caches(layout, heads=2)
    region = KVRegion(kv, layout)
    assert region.layout == f"float32:2x2x{BLOCK}x2x{WIDTH}"
    assert region.block_bytes == 2 * 2 * BLOCK * 2 * WIDTH * 4
    full = layout.persistent_groups[0]
    [payload] = region.read_payloads({full: [3]})
    tensors = [kv[layer] for layer in layout.groups[full].layers]
    assert torch.equal(payload.view(torch.float32), torch.cat([t[:, 3].flatten() for t in tensors]))


def v4_layout():
    """Two state caches, a CSA cache (rate 4, entries of 16 channels) and an HCA one (rate 16, 10)."""
    return kv_cache_layout_of_specs(
        [SlidingWindowSpec(8), SlidingWindowSpec(8), CompressedSpec(4, 16), CompressedSpec(16, 10)]
    )


def test_compressed_payload_is_only_the_entries() -> None:
    layout = v4_layout()
    region = KVRegion(caches(layout), layout)
    # CSA: BLOCK / 4 = 2 entries of 16 channels; HCA: a rate above the block, one row of 10.
    assert region.block_bytes == (2 * 16 + 1 * 10) * 4
    csa, hca = layout.persistent_groups
    assert region.layout == "float32:1x1x2x1x16+1x1x1x1x10"
    assert len(region.read_blocks({csa: [1, 2], hca: [4, 5]})) == 2


def test_compressed_payload_round_trips_onto_the_entries_alone() -> None:
    layout = v4_layout()
    csa, hca = layout.persistent_groups
    source, target = caches(layout, seed=1), caches(layout, seed=2)
    # Every cache here is a view of one tensor (group size 1): block ids are pages of it.
    assert len({t.data_ptr() for t in target}) == 1
    expected = target[0].clone()
    payloads = KVRegion(source, layout).read_blocks({csa: [1, 2], hca: [4, 5]})
    into = {csa: [3, 0], hca: [2, 1]}
    assert KVRegion(target, layout).write_blocks(into, payloads) == 2
    pages = {csa: (2, 16), hca: (1, 10)}  # rows, channels
    for group, src_ids in ((csa, [1, 2]), (hca, [4, 5])):
        rows, channels = pages[group]
        for src, dst in zip(src_ids, into[group]):
            expected[0, dst, :rows, :, :channels] = source[0][0, src, :rows, :, :channels]
    assert torch.equal(target[0], expected)  # the entries, and nothing else, were written
    # copy_out / copy_in (the host tier's path) move the same bytes.
    host = torch.zeros((4, len(payloads[0])), dtype=torch.uint8)
    KVRegion(source, layout).copy_out({csa: [1, 2], hca: [4, 5]}, host, [2, 3])
    assert [bytes(row.numpy()) for row in host[2:]] == payloads
    fresh = caches(layout, seed=3)
    expected = fresh[0].clone()
    KVRegion(fresh, layout).copy_in(into, host, [2, 3])
    for group, src_ids in ((csa, [1, 2]), (hca, [4, 5])):
        rows, channels = pages[group]
        for src, dst in zip(src_ids, into[group]):
            expected[0, dst, :rows, :, :channels] = source[0][0, src, :rows, :, :channels]
    assert torch.equal(fresh[0], expected)


def test_a_payload_of_the_wrong_size_is_not_written() -> None:
    layout = v4_layout()
    csa, hca = layout.persistent_groups
    target = caches(layout)
    before = [t.clone() for t in target]
    region = KVRegion(target, layout)
    assert region.write_blocks({csa: [1], hca: [1]}, [b"\0" * (region.block_bytes + 4)]) == 0
    assert all(torch.equal(a, b) for a, b in zip(target, before))


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-v4")
    make_model(path, arch="deepseek_v4", seed=0, tokenizer=False)
    return str(path)


def test_tiny_v4_persists_its_logical_bytes_per_token(tiny_v4: str) -> None:
    from shared.model.config import ModelConfig

    config = ModelConfig.from_pretrained(tiny_v4)
    p = config.deepseek_v4
    assert p is not None and CSA in p.layer_types  # entries with indexer keys among them
    logical = logical_bytes(p, config.head_dim, 4).compressed
    stored = measured_bytes(tiny_v4, num_tokens=256, block_size=128)
    assert stored == pytest.approx(logical)
