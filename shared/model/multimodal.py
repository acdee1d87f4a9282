"""What a forward takes besides token ids when a prompt holds images (the seam between
the engine and a vision-language model):

- ``ImageInputs``: a request's images as the model's image processor (transformers'
  Qwen2-VL one) gives them, which ``encode_images`` turns into embeddings;
- ``InputEmbeddings``: rows of a step's flat token batch whose input embedding is
  replaced by an encoder's output (the image-pad tokens' rows), and those outputs.

A text-only model never sees either; its forward is unchanged.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.model.vision.mrope import GridTHW


@dataclass(frozen=True, slots=True)
class ImageInputs:
    """One request's images: ``pixel_values`` [patches, channels x temporal patch x
    patch x patch], the images' patches one after another, and each image's (t, h, w)
    patches (the processor's ``image_grid_thw``)."""

    pixel_values: torch.Tensor
    grids: tuple[GridTHW, ...]

    @classmethod
    def from_processor(cls, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> "ImageInputs":
        grids = image_grid_thw.tolist() if isinstance(image_grid_thw, torch.Tensor) else image_grid_thw
        return cls(pixel_values, tuple((int(t), int(h), int(w)) for t, h, w in grids))

    def __post_init__(self) -> None:
        num_patches = sum(t * h * w for t, h, w in self.grids)
        if self.pixel_values.dim() != 2 or self.pixel_values.shape[0] != num_patches:
            raise ValueError(
                f"pixel_values {tuple(self.pixel_values.shape)} must be [{num_patches}, patch values] for grids {self.grids}"
            )


@dataclass(frozen=True, slots=True)
class ImageEmbeddings:
    """One request's images already encoded elsewhere (the vision stage, E/P/D): each
    image's tower output [its image-pad tokens, hidden] and its (t, h, w) grid, which
    the M-RoPE positions need. The engine takes them in place of ``ImageInputs`` and
    runs no tower (shared/engine/images.py)."""

    embeds: tuple[torch.Tensor, ...]
    grids: tuple[GridTHW, ...]

    def __post_init__(self) -> None:
        if len(self.embeds) != len(self.grids) or any(e.dim() != 2 for e in self.embeds):
            raise ValueError(f"{len(self.embeds)} embeddings (each [tokens, hidden]) for {len(self.grids)} grids")


@dataclass(frozen=True, slots=True)
class InputEmbeddings:
    """``embeds`` [N, hidden] replace the input embeddings of the step's token rows
    ``rows`` [N] (int64, on the model's device)."""

    rows: torch.Tensor
    embeds: torch.Tensor

    def __post_init__(self) -> None:
        if self.rows.dim() != 1 or self.embeds.dim() != 2 or self.rows.shape[0] != self.embeds.shape[0]:
            raise ValueError(f"rows {tuple(self.rows.shape)} and embeds {tuple(self.embeds.shape)} must pair up")
