"""make-model's Qwen VL presets (tiny-vl: Qwen2.5-VL; tiny-qwen3-vl: Qwen3-VL): a folder
transformers reads as it wrote it (config.json equal to its own re-save, weights under
the released names), with a tokenizer holding the vision tokens whose ids config.json
names, a chat template and the family's preprocessor config (Qwen2.5-VL: 14 px patches,
CLIP's mean; Qwen3-VL: 16 px, mean and std 0.5); a chat prompt with two images renders
offline, and our greedy tokens and logprobs (Qwen3-VL's deepstack included) equal
transformers' on it."""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.model.multimodal import ImageInputs
from shared.model.vision.mrope import mrope_positions
from tests.helpers.paged_driver import PagedDriver
from tests.helpers.vlm_models import folder_chat_prompt, hf_qwen3_vl_model, hf_vl_model, synthetic_images

transformers = pytest.importorskip("transformers")

NUM_NEW = 6


@dataclass(frozen=True)
class Preset:
    arch: str
    name: str
    hf_model: Callable[[Path], Any]
    patch_size: int
    image_mean: tuple[float, ...]


PRESETS = [
    Preset("qwen2_5_vl", "tiny-vl", hf_vl_model, 14, (0.48145466, 0.4578275, 0.40821073)),
    Preset("qwen3_vl", "tiny-qwen3-vl", hf_qwen3_vl_model, 16, (0.5, 0.5, 0.5)),
]


@pytest.fixture(scope="module", params=PRESETS, ids=lambda p: p.name)
def preset(request: pytest.FixtureRequest) -> Preset:
    return request.param


@pytest.fixture(scope="module")
def folder(preset: Preset, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.make_model import make_model

    path = tmp_path_factory.mktemp(preset.arch)
    make_model(path, arch=preset.arch, preset=preset.name, seed=3)
    return path


def test_config_is_what_transformers_writes(folder: Path, tmp_path: Path) -> None:
    transformers.AutoConfig.from_pretrained(folder).save_pretrained(tmp_path)
    assert json.loads((folder / "config.json").read_text()) == json.loads((tmp_path / "config.json").read_text())


def test_vision_token_ids_are_the_tokenizers(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    names = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
             "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}  # fmt: skip
    for key, token in names.items():
        assert config[key] == tokenizer.convert_tokens_to_ids(token) < config["text_config"]["vocab_size"]
    assert tokenizer.eos_token == "<|im_end|>"


def test_preprocessor_is_the_familys(preset: Preset, folder: Path) -> None:
    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    assert processor.patch_size == preset.patch_size and list(processor.image_mean) == list(preset.image_mean)


def test_chat_with_two_images_matches_transformers(preset: Preset, folder: Path) -> None:
    from shared.model.loader import load_model

    images = synthetic_images([(150, 100), (70, 90)], seed=9)
    messages = [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Compare these two pictures:"}, {"type": "image"},
    ]}]  # fmt: skip
    prompt = folder_chat_prompt(folder, messages, images)
    config = json.loads((folder / "config.json").read_text())
    image_token = config["image_token_id"]
    assert prompt.pixel_values is not None and prompt.image_grid_thw is not None
    ids = torch.tensor([prompt.token_ids])
    hf_inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=prompt.pixel_values,
                     image_grid_thw=prompt.image_grid_thw, mm_token_type_ids=(ids == image_token).to(torch.int32))  # fmt: skip
    hf = preset.hf_model(folder)
    with torch.no_grad():
        greedy = hf.generate(**hf_inputs, max_new_tokens=NUM_NEW, do_sample=False)[0, ids.shape[1] :].tolist()
        full = torch.tensor([prompt.token_ids + greedy])
        hf_inputs.update(input_ids=full, attention_mask=torch.ones_like(full),
                         mm_token_type_ids=(full == image_token).to(torch.int32))  # fmt: skip
        reference = torch.log_softmax(hf(**hf_inputs).logits[0].float(), dim=-1)

    model = load_model(folder)
    grids = [tuple(g) for g in prompt.image_grid_thw.tolist()]
    positions = mrope_positions(prompt.token_ids, grids, image_token, 2)
    embeds = torch.cat(model.encode_images(ImageInputs.from_processor(prompt.pixel_values, prompt.image_grid_thw)))  # type: ignore[operator]
    rows = [i for i, t in enumerate(prompt.token_ids) if t == image_token]
    n = len(prompt.token_ids)
    driver = PagedDriver(model, num_seqs=1, block_size=8)
    out = driver.step({0: prompt.token_ids}, rope_positions={0: positions.rows(0, n)}, embeds={0: (rows, embeds)})[0]
    logprobs, tokens = [torch.log_softmax(out, dim=-1)], [int(out[-1].argmax())]
    for k in range(NUM_NEW - 1):
        step = driver.step({0: [tokens[-1]]}, rope_positions={0: positions.rows(n + k, n + k + 1)})[0]
        logprobs.append(torch.log_softmax(step, dim=-1))
        tokens.append(int(step[-1].argmax()))
    assert tokens == greedy
    torch.testing.assert_close(torch.cat(logprobs), reference[: n + NUM_NEW - 1], rtol=0, atol=1e-4)
