"""Tiny seeded Qwen2.5-VL models saved by transformers, synthetic seeded images, and
prompts holding them: what the vision-language parity tests check our model against.
Every parameter (biases, norm weights, the tower's too) is re-drawn at random, so a
bias or norm we forgot shows up as a logit mismatch."""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# A 3-layer Qwen2 of width 64 (head_dim 16: M-RoPE sections 2/3/3 of 8 pairs) and a
# 3-block tower of width 32 whose windows are 56 px (2x2 merged tokens), block 1 full.
TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
)  # fmt: skip
VISION_CONFIG: dict[str, Any] = dict(
    depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
    window_size=56, fullatt_block_indexes=[1], tokens_per_second=2,
)  # fmt: skip
# Token ids of the vision tokens (inside the vocabulary; the rest are text).
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 500, 501, 502, 503
TEXT_HIGH = 500
# The image processor's pixel bounds: small images, at most 256 merged tokens.
MIN_PIXELS, MAX_PIXELS = 3136, 200704


def save_tiny_vl_model(path: str | Path, seed: int = 0, tie_word_embeddings: bool = False) -> Path:
    import transformers

    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(TEXT_CONFIG), vision_config=dict(VISION_CONFIG), image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        tie_word_embeddings=tie_word_embeddings,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name or "ln_q" in name else 0.05 * noise)
    out = Path(path)
    model.save_pretrained(out)
    return out


def synthetic_images(sizes: Sequence[tuple[int, int]], seed: int) -> list[Any]:
    """Seeded RGB images of the given (width, height): smooth gradients plus noise, so
    neighbouring patches differ and resizing has something to interpolate."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = []
    for width, height in sizes:
        y, x = np.mgrid[0:height, 0:width]
        base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
        pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
        images.append(Image.fromarray(pixels, "RGB"))
    return images


def image_processor() -> Any:
    """transformers' Qwen2-VL image processor (the PIL one: no torchvision here), bounded
    to small images."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})


@dataclass
class VLPrompt:
    token_ids: list[int]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None


def vl_prompt(
    images: Sequence[Any], seed: int, text_lens: Sequence[int] | None = None, processor: Any = None
) -> VLPrompt:
    """Text, then each image as <vision_start> <image_pad> x tokens <vision_end> followed by
    text, as the processor expands a chat prompt; text ids seeded from [3, TEXT_HIGH).
    ``processor``: the image processor (default: Qwen2.5-VL's, ``image_processor()``)."""
    g = torch.Generator().manual_seed(seed)
    lens = list(text_lens) if text_lens is not None else [5 + 2 * i for i in range(len(images) + 1)]
    if images:
        out = (processor or image_processor())(images=list(images), return_tensors="pt")
        pixel_values, grid = out["pixel_values"], out["image_grid_thw"]
    else:
        pixel_values, grid = None, None
    ids = torch.randint(3, TEXT_HIGH, (lens[0],), generator=g).tolist()
    for i in range(len(images)):
        assert grid is not None
        count = int(grid[i].prod()) // 4
        ids += [VISION_START] + [IMAGE_PAD] * count + [VISION_END]
        ids += torch.randint(3, TEXT_HIGH, (lens[i + 1],), generator=g).tolist()
    return VLPrompt(ids, pixel_values, grid)


def hf_vl_model(path: str | Path) -> Any:
    import transformers

    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def hf_inputs(prompt: VLPrompt, extra: Sequence[int] = ()) -> dict[str, torch.Tensor]:
    """transformers' forward/generate arguments for the prompt followed by ``extra`` tokens."""
    ids = torch.tensor([prompt.token_ids + list(extra)])
    inputs: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if prompt.pixel_values is not None:
        assert prompt.image_grid_thw is not None
        inputs.update(
            pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
            mm_token_type_ids=(ids == IMAGE_PAD).to(torch.int32),
        )  # fmt: skip
    return inputs


def folder_chat_prompt(folder: str | Path, messages: list[dict[str, Any]], images: Sequence[Any]) -> VLPrompt:
    """A chat prompt as transformers' Qwen2_5_VLProcessor makes it from a make-model
    folder, offline: the folder's chat template and tokenizer, its image processor
    (preprocessor_config.json), and each image's <|image_pad|> repeated once per merged
    patch. (AutoProcessor itself needs torchvision for its video processor, which is
    not installed here; this is its image path step for step.)"""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pad = "<|image_pad|>"
    pixels = processor(images=list(images), return_tensors="pt") if images else None
    grid = None if pixels is None else pixels["image_grid_thw"]
    pieces = text.split(pad)
    assert len(pieces) == len(images) + 1, "one <|image_pad|> per image in the rendered template"
    expanded = pieces[0]
    for i, piece in enumerate(pieces[1:]):
        assert grid is not None
        expanded += pad * (int(grid[i].prod()) // processor.merge_size**2) + piece
    ids = tokenizer(expanded, add_special_tokens=False)["input_ids"]
    return VLPrompt(ids, None if pixels is None else pixels["pixel_values"], grid)


# Tiny seeded Qwen3-VL: a 3-layer Qwen3 of width 64 (head_dim 16: interleaved M-RoPE
# sections 2/3/3 of 8 pairs), a 3-block tower of width 32 on 16 px patches, a 6 x 6
# position table, blocks 0 and 2 feeding deepstack features into decoder layers 0 and 1.
QWEN3_TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1,
    eos_token_id=2,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 5000000.0,
                     "mrope_interleaved": True},
)  # fmt: skip
QWEN3_VISION_CONFIG: dict[str, Any] = dict(
    depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
    num_position_embeddings=36, deepstack_visual_indexes=[0, 2],
)  # fmt: skip
# Qwen3-VL's image processor: 16 px patches (32 px per merged token), mean/std 0.5.
QWEN3_MIN_PIXELS, QWEN3_MAX_PIXELS = 4096, 262144


def save_tiny_qwen3_vl_model(path: str | Path, seed: int = 0) -> Path:
    import transformers

    config = transformers.Qwen3VLConfig(
        text_config=dict(QWEN3_TEXT_CONFIG), vision_config=dict(QWEN3_VISION_CONFIG), image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen3VLForConditionalGeneration(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            is_norm_weight = "norm" in name and name.endswith("weight")
            param.copy_(1.0 + 0.1 * noise if is_norm_weight else 0.05 * noise)
    out = Path(path)
    model.save_pretrained(out)
    return out


def qwen3_image_processor() -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": QWEN3_MIN_PIXELS, "longest_edge": QWEN3_MAX_PIXELS}, patch_size=16,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )  # fmt: skip


def hf_qwen3_vl_model(path: str | Path) -> Any:
    import transformers

    return transformers.Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
