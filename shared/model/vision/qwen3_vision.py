"""Qwen3-VL's vision transformer: patches of ``pixel_values`` (the Qwen2-VL image
processor's, on 16 px patches) -> one embedding per merged 2x2 patch, plus the
deepstack features, in the language model's width. Written to follow transformers'
``Qwen3VLVisionModel`` operation for operation (float32 results agree to rounding):

- the patch embedding (tower.py's, with a bias) plus a learned position table
  (``pos_embed``, a square grid) resampled bilinearly (corners aligned) to each image's
  patches, gathered as transformers' ``get_vision_interpolation_indices_and_weights``;
- blocks of pre-norm attention over a whole image (tower.py's attention and 2D
  rotary; no windows) and a GELU (tanh) MLP, LayerNorms with biases;
- the patch merger (LayerNorm, the 4 patches of a 2x2 block side by side, a GELU MLP),
  and one merger per ``deepstack_visual_indexes`` block, normalising after the 2x2
  shuffle, whose outputs the language model adds after its first layers.

Parameter names are transformers' under ``visual.`` (the checkpoint's ``model.visual.``).
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.layers import Linear
from shared.model.models.qwen3_vl_config import Qwen3VisionTowerParams
from shared.model.vision.tower import (
    GridTHW, PatchEmbed, VisionAttention, axial_inv_freq, axial_rotary, image_bounds, vision_positions,
)  # fmt: skip

_NORM_EPS = 1e-6  # hard-coded in transformers' vision blocks and mergers


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two rows (or columns) of a ``side``-long table a bilinear resample to ``size``
    with aligned corners reads for each ``index``, and their weights."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(grids: Sequence[GridTHW], side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, weights) [patches, 4] into the flattened ``side`` x ``side`` position
    table for every patch, in the processor's patch order (tower.vision_positions'): the
    bilinear resample of the table to each image's (h, w), every frame alike."""
    h_taps, h_weights, w_taps, w_weights = [], [], [], []
    for (t, h, w), rows in zip(grids, vision_positions(grids, merge).split([t * h * w for t, h, w in grids])):
        taps, weights = _axis_taps(rows[:, 0], h, side)
        h_taps.append(taps), h_weights.append(weights)
        taps, weights = _axis_taps(rows[:, 1], w, side)
        w_taps.append(taps), w_weights.append(weights)
    ht, hw, wt, ww = (torch.cat(x) for x in (h_taps, h_weights, w_taps, w_weights))
    indices = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
    weights = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
    return indices, weights


class VisionMLP(nn.Module):
    def __init__(self, p: Qwen3VisionTowerParams, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.linear_fc1 = Linear(p.hidden_size, p.intermediate_size, True, dtype, device)
        self.linear_fc2 = Linear(p.intermediate_size, p.hidden_size, True, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


def _layer_norm(width: int, dtype: torch.dtype, device: torch.device) -> nn.LayerNorm:
    norm = nn.LayerNorm(width, eps=_NORM_EPS, device=device, dtype=dtype)
    norm.requires_grad_(False)
    return norm


class VisionBlock(nn.Module):
    def __init__(self, p: Qwen3VisionTowerParams, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.norm1 = _layer_norm(p.hidden_size, dtype, device)
        self.norm2 = _layer_norm(p.hidden_size, dtype, device)
        self.attn = VisionAttention(p.hidden_size, p.num_heads, dtype, device)
        self.mlp = VisionMLP(p, dtype, device)

    def forward(self, x: torch.Tensor, bounds: Sequence[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), bounds, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """The 4 patches of a 2x2 block side by side -> out_hidden_size. ``postshuffle``
    (the deepstack mergers): the LayerNorm over the 4 side by side, not each patch."""

    def __init__(self, p: Qwen3VisionTowerParams, postshuffle: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.width = p.hidden_size * p.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = _layer_norm(self.width if postshuffle else p.hidden_size, dtype, device)
        self.linear_fc1 = Linear(self.width, self.width, True, dtype, device)
        self.linear_fc2 = Linear(self.width, p.out_hidden_size, True, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width) if self.postshuffle else x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    """``visual.``: ``forward(pixel_values, grids)`` -> [merged patches, out_hidden_size x
    (1 + deepstack features)]: the merger's output, then each deepstack merger's, side by
    side, the images one after another in raster order of their merged patches."""

    def __init__(self, p: Qwen3VisionTowerParams, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.params = p
        self.patch_embed = PatchEmbed(p.in_channels, p.temporal_patch_size, p.patch_size, p.hidden_size, True, dtype,
                                      device)  # fmt: skip
        self.pos_embed = nn.Embedding(p.num_position_embeddings, p.hidden_size, device=device, dtype=dtype)
        self.pos_embed.requires_grad_(False)
        self.blocks = nn.ModuleList(VisionBlock(p, dtype, device) for _ in range(p.depth))
        self.merger = PatchMerger(p, False, dtype, device)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(p, True, dtype, device) for _ in p.deepstack_visual_indexes)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", axial_inv_freq(p.head_dim, p.rope_theta, device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.merger.linear_fc1.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.merger.linear_fc1.weight.device

    def num_tokens(self, grid: GridTHW) -> int:
        """The image's embeddings (image-pad tokens of the prompt)."""
        t, h, w = grid
        return t * h * w // self.params.spatial_merge_size**2

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grids: Sequence[GridTHW]) -> torch.Tensor:
        p = self.params
        merge = p.spatial_merge_size
        num_patches = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape != (num_patches, p.patch_dim):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} for grids {list(grids)}: "
                             f"expected ({num_patches}, {p.patch_dim})")  # fmt: skip
        device = pixel_values.device
        indices, weights = position_taps(grids, p.grid_side, merge)
        x = self.patch_embed(pixel_values)
        # transformers' weighted sum of the 4 taps (its own order, so its rounding).
        pos = (self.pos_embed(indices.to(device)) * weights.to(device)[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        cos, sin = axial_rotary(vision_positions(grids, merge).to(device), self.inv_freq)
        bounds = image_bounds(grids)
        features = []
        for i, block in enumerate(self.blocks):
            x = block(x, bounds, cos, sin)
            if i in p.deepstack_visual_indexes:
                features.append(self.deepstack_merger_list[p.deepstack_visual_indexes.index(i)](x))
        return torch.cat([self.merger(x), *features], dim=-1)
