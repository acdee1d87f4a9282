"""How many placeholder tokens an image takes in a prompt, torch-free: the balancer
expands a chat prompt's image placeholders where it tokenises, before any processor
runs. This is transformers' Qwen2-VL image processor's arithmetic (``smart_resize``:
each side rounded to a multiple of patch x merge, the area brought within
[min_pixels, max_pixels] keeping the aspect), read from the same
preprocessor_config.json; the engine's processor makes the real grid later and the
engine refuses a prompt whose placeholder runs disagree with it, so a drift between
the two is a 400, never wrong output (tests/unit/test_image_grid.py holds them equal)."""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.multimodal.errors import ImageError

MAX_ASPECT_RATIO = 200
"""The processor refuses a longer side past 200 times the shorter."""


class BadAspectRatio(ImageError):
    code = "invalid_image_size"


@dataclass(frozen=True, slots=True)
class PatchGrid:
    """The processor settings that decide an image's grid (Qwen2-VL's defaults)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> "PatchGrid":
        """From preprocessor_config.json, as the processor reads it: ``min_pixels`` and
        ``max_pixels`` win over ``size``'s ``shortest_edge`` and ``longest_edge``."""
        size = settings.get("size") or {}
        default = cls()
        return cls(
            patch_size=int(settings.get("patch_size", default.patch_size)),
            merge_size=int(settings.get("merge_size", default.merge_size)),
            temporal_patch_size=int(settings.get("temporal_patch_size", default.temporal_patch_size)),
            min_pixels=int(settings.get("min_pixels") or size.get("shortest_edge") or default.min_pixels),
            max_pixels=int(settings.get("max_pixels") or size.get("longest_edge") or default.max_pixels),
        )

    def grid(self, width: int, height: int, param: str) -> tuple[int, int, int]:
        """(t, h, w) patches of a still image; BadAspectRatio (naming param) past 200:1."""
        if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
            raise BadAspectRatio(param, f"the image is {width}x{height} pixels: its sides may differ by at most "
                                 f"{MAX_ASPECT_RATIO} times")  # fmt: skip
        factor = self.patch_size * self.merge_size
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return 1, h_bar // self.patch_size, w_bar // self.patch_size

    def num_tokens(self, width: int, height: int, param: str) -> int:
        """The image's placeholder tokens: its patches over merge x merge."""
        t, h, w = self.grid(width, height, param)
        return t * h * w // (self.merge_size * self.merge_size)
