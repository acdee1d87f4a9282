"""A vision instance's tower alone (shared/model/tower_loader.py): built and read from
the checkpoint without the language model, it holds the whole model's tower tensors
and nothing else, and encodes images to exactly the whole model's rows, for both Qwen
VL families (Qwen3-VL's checkpoints name the tower model.visual.*). A text-only
checkpoint has no tower to load."""

from pathlib import Path

import pytest
import torch

from shared.model.loader import load_model
from shared.model.multimodal import ImageInputs
from shared.model.tower_loader import NoVisionTower, load_vision_tower
from tools.make_model import make_model

FAMILIES = [("qwen2_5_vl", "tiny-vl"), ("qwen3_vl", "tiny-qwen3-vl")]
GRIDS = ((1, 4, 6), (1, 2, 2))


@pytest.mark.parametrize(("arch", "preset"), FAMILIES)
def test_the_tower_alone_holds_the_towers_tensors_and_encodes_as_the_whole_model(
    arch: str, preset: str, tmp_path: Path
) -> None:
    make_model(tmp_path, arch=arch, preset=preset, seed=4)
    whole = load_model(tmp_path)
    tower = load_vision_tower(tmp_path)
    params = dict(tower.named_parameters())
    assert params and all(name.startswith("visual.") for name in params)  # no embed_tokens, layers, lm_head
    whole_visual = {name: p for name, p in whole.named_parameters() if name.startswith("visual.")}
    assert set(params) == set(whole_visual)
    for name, p in params.items():
        assert torch.equal(p, whole_visual[name]), name  # read from the checkpoint, not left as built
    num_whole = sum(p.numel() for p in whole.parameters())
    assert sum(p.numel() for p in params.values()) < num_whole
    vl = whole.config.vision_language
    assert vl is not None
    num_patches = sum(t * h * w for t, h, w in GRIDS)
    pixels = torch.randn(num_patches, vl.vision.patch_dim, generator=torch.Generator().manual_seed(0))
    images = ImageInputs(pixels, GRIDS)
    got, want = tower.encode_images(images), whole.encode_images(images)  # type: ignore[operator]
    assert [tuple(e.shape) for e in got] == [tuple(e.shape) for e in want]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert tower.config.vision_language == vl


def test_a_text_only_checkpoint_has_no_tower(tmp_path: Path) -> None:
    make_model(tmp_path, arch="llama", seed=1)
    with pytest.raises(NoVisionTower, match="no vision tower"):
        load_vision_tower(tmp_path)
