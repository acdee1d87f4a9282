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
import torch.nn.functional as F
from torch import nn

from shared.model.layers import MLP, Linear, RMSNorm, rotate_half
from shared.model.models.qwen2_5_vl_config import VisionTowerParams

GridTHW = tuple[int, int, int]
"""An image's (temporal, height, width) patches: a row of the processor's ``image_grid_thw``."""

_NORM_EPS = 1e-6  # hard-coded in transformers' vision blocks and merger


def vision_positions(grids: Sequence[GridTHW], merge: int) -> torch.Tensor:
    """(row, column) of every patch [patches, 2], in the processor's patch order: 2x2
    merge blocks in raster order, the patches of a block in raster order inside it."""
    rows = []
    for t, h, w in grids:
        hpos = torch.arange(h)[:, None].expand(h, w).reshape(h // merge, merge, w // merge, merge).transpose(1, 2)
        wpos = torch.arange(w)[None, :].expand(h, w).reshape(h // merge, merge, w // merge, merge).transpose(1, 2)
        rows.append(torch.stack([hpos.flatten(), wpos.flatten()], dim=-1).repeat(t, 1))
    return torch.cat(rows)


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


def image_bounds(grids: Sequence[GridTHW]) -> list[int]:
    """Cumulative patch counts of every frame: the full-attention blocks' sequences."""
    bounds = [0]
    for t, h, w in grids:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = Linear(dim, 3 * dim, True, dtype, device)
        self.proj = Linear(dim, dim, True, dtype, device)

    def forward(self, x: torch.Tensor, bounds: Sequence[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).permute(1, 0, 2, 3).unbind(0)
        # The rotary in float32, cast back (transformers' apply_rotary_pos_emb_vision).
        c, s = cos[:, None, :].float(), sin[:, None, :].float()
        q = (q.float() * c + rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(x.dtype)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, n, head_dim]
        # Each sequence (window or image) on its own, as transformers' SDPA path does.
        outs = [
            F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], scale=self.head_dim**-0.5)
            for a, b in zip(bounds[:-1], bounds[1:])
            if b > a
        ]
        return self.proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, -1))


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


class PatchEmbed(nn.Module):
    def __init__(self, p: VisionTowerParams, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.params = p
        kernel = (p.temporal_patch_size, p.patch_size, p.patch_size)
        # A convolution whose stride is its kernel (each patch alone), as transformers has
        # it: the same op, so the same float32 rounding.
        self.proj = nn.Conv3d(p.in_channels, p.hidden_size, kernel, stride=kernel, bias=False, device=device, dtype=dtype)
        self.proj.weight.requires_grad_(False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        p = self.params
        x = pixels.view(-1, p.in_channels, p.temporal_patch_size, p.patch_size, p.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, p.hidden_size)


class Qwen2_5_VisionTransformer(nn.Module):
    """``visual.``: ``forward(pixel_values, grids)`` -> [merged patches, out_hidden_size],
    the images one after another, each in raster order of its merged patches."""

    def __init__(self, p: VisionTowerParams, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.params = p
        self.patch_embed = PatchEmbed(p, dtype, device)
        self.blocks = nn.ModuleList(VisionBlock(p, dtype, device) for _ in range(p.depth))
        self.merger = PatchMerger(p, dtype, device)
        spatial = p.head_dim // 2
        inv_freq = 1.0 / (p.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))
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
        freqs = vision_positions(grids, merge).to(device)[..., None].float() * self.inv_freq  # [n, 2, pairs]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = windowed(emb.cos()), windowed(emb.sin())
        for i, block in enumerate(self.blocks):
            x = block(x, full_bounds if i in p.fullatt_block_indexes else window_bounds, cos, sin)
        return self.merger(x)[torch.argsort(order)]
