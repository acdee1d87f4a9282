"""The balancer's torch-free count of an image's placeholder tokens (shared/multimodal/grid.py)
equals the grid transformers' processor makes (shared/model/vision/processor.py, from a
make-model folder's preprocessor_config.json) over sizes that round up, round down,
grow past min_pixels and shrink past max_pixels; an extreme aspect is refused by name."""

import json
from pathlib import Path

import numpy as np
import pytest

from shared.multimodal.grid import BadAspectRatio, PatchGrid

pytest.importorskip("transformers")

SIZES = [(60, 60), (112, 168), (140, 84), (200, 150), (13, 400), (500, 460), (29, 29), (1000, 30), (43, 97)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.make_model import make_model

    path = tmp_path_factory.mktemp("tiny_vl_grid")
    make_model(path, arch="qwen2_5_vl", preset="tiny-vl", seed=3)
    return path


def test_grid_equals_the_processors(folder: Path) -> None:
    from shared.model.vision.processor import ImageProcessor

    settings = json.loads((folder / "preprocessor_config.json").read_text())
    grid = PatchGrid.from_settings(settings)
    assert (grid.min_pixels, grid.max_pixels) == (settings["min_pixels"], settings["max_pixels"])
    processor = ImageProcessor(folder)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for w, h in SIZES]
    inputs = processor(images)
    assert list(inputs.grids) == [grid.grid(w, h, "p") for w, h in SIZES]
    assert [grid.num_tokens(w, h, "p") for w, h in SIZES] == [t * h * w // 4 for t, h, w in inputs.grids]
    assert len({g for g in inputs.grids}) > 5  # the sizes really take different paths


def test_extreme_aspect_is_refused() -> None:
    with pytest.raises(BadAspectRatio) as info:
        PatchGrid().grid(2010, 10, "messages.0.content.1")
    assert info.value.param == "messages.0.content.1" and "200" in info.value.message
