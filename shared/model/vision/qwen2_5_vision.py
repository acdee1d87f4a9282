"""Qwen2.5-VL's vision transformer: patches of ``pixel_values`` (as the Qwen2-VL image
processor gives them) -> one embedding per merged 2x2 patch, in the language model's
width. Written to follow transformers' ``Qwen2_5_VisionTransformerPretrainedModel``
operation for operation (float32 results agree to rounding):

- a patch embedding (a Conv3d whose kernel is the whole patch);
- blocks of pre-norm attention and a SiLU-gated MLP (biases everywhere), each attending
  within windows of ``window_size`` pixels, or over a whole image in the
  ``fullatt_block_indexes`` blocks; the patches are permuted window by window once, so
  a window is a contiguous run of rows;
- a 2D rotary (height and width halves) over each head;
- the patch merger: RMSNorm, then the 4 patches of a 2x2 block side by side through a
  GELU MLP; merged rows are put back in the image's raster order.

Parameter names are transformers' under ``visual.`` (the checkpoint's).
"""

from collections.abc import Sequence

import torch
from torch import nn

from shared.model.layers import MLP, Linear, RMSNorm
from shared.model.models.qwen2_5_vl_config import VisionTowerParams
from shared.model.vision.tower import (
    GridTHW, PatchEmbed, VisionAttention, axial_inv_freq, axial_rotary, image_bounds, vision_positions,
)  # fmt: skip

_NORM_EPS = 1e-6  # hard-coded in transformers' vision blocks and merger


def window_order(grids: Sequence[GridTHW], merge: int, window_merged: int) -> tuple[torch.Tensor, list[int]]:
    """(the merged rows in window order [merged patches], the cumulative patch counts
    of the windows): each frame cut into windows of ``window_merged`` x
    ``window_merged`` merged patches (partial ones at the right and bottom edges)."""
    order: list[torch.Tensor] = []
    bounds = [0]
    base = 0
    for t, h, w in grids:
        mh, mw = h // merge, w // merge
        index = torch.arange(t * mh * mw).reshape(t, mh, mw)
        for frame in range(t):
            for r in range(0, mh, window_merged):
                for c in range(0, mw, window_merged):
                    cells = index[frame, r : r + window_merged, c : c + window_merged].flatten()
                    order.append(cells + base)
                    bounds.append(bounds[-1] + cells.numel() * merge * merge)
        base += t * mh * mw
    return torch.cat(order), bounds


class VisionBlock(nn.Module):
    def __init__(self, p: VisionTowerParams, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.norm1 = RMSNorm(p.hidden_size, _NORM_EPS, dtype, device)
        self.norm2 = RMSNorm(p.hidden_size, _NORM_EPS, dtype, device)
        self.attn = VisionAttention(p.hidden_size, p.num_heads, dtype, device)
        self.mlp = MLP(p.hidden_size, p.intermediate_size, True, dtype, device)

    def forward(self, x: torch.Tensor, bounds: Sequence[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), bounds, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, p: VisionTowerParams, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.width = p.hidden_size * p.spatial_merge_size**2
        self.ln_q = RMSNorm(p.hidden_size, _NORM_EPS, dtype, device)
        # nn.Sequential for transformers' names: mlp.0 and mlp.2.
        self.mlp = nn.Sequential(
            Linear(self.width, self.width, True, dtype, device),
            nn.GELU(),
            Linear(self.width, p.out_hidden_size, True, dtype, device),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2_5_VisionTransformer(nn.Module):
    """``visual.``: ``forward(pixel_values, grids)`` -> [merged patches, out_hidden_size],
    the images one after another, each in raster order of its merged patches."""

    def __init__(self, p: VisionTowerParams, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.params = p
        self.patch_embed = PatchEmbed(p.in_channels, p.temporal_patch_size, p.patch_size, p.hidden_size, False, dtype,
                                      device)  # fmt: skip
        self.blocks = nn.ModuleList(VisionBlock(p, dtype, device) for _ in range(p.depth))
        self.merger = PatchMerger(p, dtype, device)
        inv_freq = axial_inv_freq(p.head_dim, p.rope_theta, device)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.merger.ln_q.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.merger.ln_q.weight.device

    def num_tokens(self, grid: GridTHW) -> int:
        """The image's embeddings (image-pad tokens of the prompt)."""
        t, h, w = grid
        return t * h * w // self.params.spatial_merge_size**2

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grids: Sequence[GridTHW]) -> torch.Tensor:
        p = self.params
        merge, unit = p.spatial_merge_size, p.spatial_merge_size**2
        num_patches = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape != (num_patches, p.patch_dim):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} for grids {list(grids)}: "
                             f"expected ({num_patches}, {p.patch_dim})")  # fmt: skip
        device = pixel_values.device
        order, window_bounds = window_order(grids, merge, p.window_size // merge // p.patch_size)
        order = order.to(device)
        full_bounds = image_bounds(grids)

        def windowed(t: torch.Tensor) -> torch.Tensor:
            # The patches of a merged block stay together: permute whole blocks.
            return t.reshape(-1, unit, t.shape[-1])[order].reshape(t.shape[0], -1)

        x = windowed(self.patch_embed(pixel_values))
        cos, sin = axial_rotary(vision_positions(grids, merge).to(device), self.inv_freq)
        cos, sin = windowed(cos), windowed(sin)
        for i, block in enumerate(self.blocks):
            x = block(x, full_bounds if i in p.fullatt_block_indexes else window_bounds, cos, sin)
        return self.merger(x)[torch.argsort(order)]
