"""What the Qwen vision towers (Qwen2.5-VL's, Qwen3-VL's) share, operation for operation
as transformers has them: the patch embedding (a Conv3d over whole patches), the
patches' (row, column) positions and their 2D rotary, each image's attention bounds,
and the attention itself (fused qkv with biases, the rotary in float32, one SDPA per
window or image). The families differ in their norms, MLPs, windows and mergers, which
stay in their own files (qwen2_5_vision.py, qwen3_vision.py)."""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.layers import Linear, rotate_half

GridTHW = tuple[int, int, int]
"""An image's (temporal, height, width) patches: a row of the processor's ``image_grid_thw``."""


def vision_positions(grids: Sequence[GridTHW], merge: int) -> torch.Tensor:
    """(row, column) of every patch [patches, 2], in the processor's patch order: 2x2
    merge blocks in raster order, the patches of a block in raster order inside it."""
    rows = []
    for t, h, w in grids:
        hpos = torch.arange(h)[:, None].expand(h, w).reshape(h // merge, merge, w // merge, merge).transpose(1, 2)
        wpos = torch.arange(w)[None, :].expand(h, w).reshape(h // merge, merge, w // merge, merge).transpose(1, 2)
        rows.append(torch.stack([hpos.flatten(), wpos.flatten()], dim=-1).repeat(t, 1))
    return torch.cat(rows)


def image_bounds(grids: Sequence[GridTHW]) -> list[int]:
    """Cumulative patch counts of every frame: the full-attention blocks' sequences."""
    bounds = [0]
    for t, h, w in grids:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def axial_inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """The 2D rotary's frequencies: a quarter of the head's channels for each axis (the
    same table turns rows and columns)."""
    spatial = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))


def axial_rotary(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [patches, head_dim] of patches at (row, column) ``positions`` [patches, 2]:
    the row's angles, then the column's, the whole repeated (rotate_half's layout)."""
    freqs = positions[..., None].float() * inv_freq  # [n, 2, pairs]
    freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


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


class PatchEmbed(nn.Module):
    """``patch_embed.proj``: one patch (channels x temporal patch x patch x patch) -> hidden."""

    def __init__(self, in_channels: int, temporal_patch_size: int, patch_size: int, hidden_size: int, bias: bool,
                 dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        super().__init__()
        self.shape = (in_channels, temporal_patch_size, patch_size, patch_size)
        self.hidden_size = hidden_size
        kernel = (temporal_patch_size, patch_size, patch_size)
        # A convolution whose stride is its kernel (each patch alone), as transformers has
        # it: the same op, so the same float32 rounding.
        self.proj = nn.Conv3d(in_channels, hidden_size, kernel, stride=kernel, bias=bias, device=device, dtype=dtype)
        self.proj.requires_grad_(False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.view(-1, *self.shape)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, self.hidden_size)
