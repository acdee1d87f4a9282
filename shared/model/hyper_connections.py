"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual stream is
``hc_mult`` parallel streams [T, hc, hidden]. Before a block, a one-layer perceptron
over the flattened streams gives three mixes: ``pre`` collapses the streams into the
block's input, ``post`` spreads the block's output back over them, and ``comb`` (made
doubly stochastic by Sinkhorn-Knopp iterations) mixes the old streams into the new.
After the last layer, the hyper head collapses the streams once more before the norm
and the LM head. Operation order follows transformers' DeepseekV4HyperConnection and
DeepseekV4HyperHead (float32 mixes, as their weights are kept in float32)."""

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.ops import TORCH_OPS, Ops


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _parameter(shape: tuple[int, ...], device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device), requires_grad=False)


class HyperConnection(nn.Module):
    """``fn`` [(2 + hc) * hc, hc * hidden], ``base`` [(2 + hc) * hc], ``scale`` [3]."""

    def __init__(
        self, hidden: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float, device: torch.device,
        ops: Ops = TORCH_OPS,
    ) -> None:  # fmt: skip
        super().__init__()
        # ops.hyper_connection: the whole step in one launch (kernels/hyper_connection.py); None: the code below.
        self._kernel = ops.hyper_connection
        self.hc = hc_mult
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        size = (2 + hc_mult) * hc_mult
        self.fn = _parameter((size, hc_mult * hidden), device)
        self.base = _parameter((size,), device)
        self.scale = _parameter((3,), device)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, hidden] -> (post [T, hc], comb [T, hc, hc], the block's input [T, hidden])."""
        if self._kernel is not None:
            return self._kernel(streams, self.fn, self.base, self.scale, self.hc_eps, self.norm_eps, self.sinkhorn_iters)
        hc = self.hc
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_scale + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        # Sinkhorn-Knopp: columns, then rows and columns in turn, towards doubly stochastic.
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def merge_streams(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: post spreads the block's output [T, hidden], comb (used transposed:
    out_k = sum_j comb[j, k] * in_j) mixes the old streams [T, hc, hidden]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The last collapse of the streams: ``hc_fn`` [hc, hc * hidden], ``hc_base`` [hc], ``hc_scale`` [1]."""

    def __init__(self, hidden: int, hc_mult: int, hc_eps: float, norm_eps: float, device: torch.device) -> None:
        super().__init__()
        self.eps = hc_eps
        self.norm_eps = norm_eps
        self.hc_fn = _parameter((hc_mult, hc_mult * hidden), device)
        self.hc_base = _parameter((hc_mult,), device)
        self.hc_scale = _parameter((1,), device)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
