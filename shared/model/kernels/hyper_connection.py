"""DeepSeek-V4's mHC step (one HyperConnection call) fused: per token, the RMS of its
flattened streams, the (2 + hc) * hc mixes, pre/post by sigmoid, comb by softmax and the
Sinkhorn-Knopp iterations, and the pre-weighted collapse of the streams.

In PyTorch (shared/model/hyper_connections.py, the reference) this is ~10 + 4 * iters
small kernels per call, two calls a layer: at decode they were most of V4's mHC time.
Here one program owns one token and keeps the hc x hc matrix in registers.

The mixes are dot products of each token's hc * hidden streams with fn's (2 + hc) * hc
rows. Where fn is small (IN_KERNEL_FN_MAX elements) and the tokens few, each program
computes them itself: the whole step is one launch. Otherwise (V4-Flash's fn is 24 x
16,384: 1.5 MB that one program would read alone from L2, ~15 us; and a prefill's
thousands of programs would each re-read it) they come from one cuBLAS GEMM of the
float32 streams, unnormalised, and the kernel does the rest: a cast, a GEMM and the
kernel, three launches whatever the batch.

Same arithmetic as the reference, in float32: the RMS is applied to the mixes after the
dot products (fn . (x * r) = (fn . x) * r, the last bits differ), the rest in the
reference's order.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from shared.model.kernels.checks import FLOAT_DTYPES, check_device, check_tensor, next_power_of_2

__all__ = ["hyper_connection"]

_BLOCK_K = 256
MIXES_BY_GEMM_ABOVE = 256
"""Tokens above which the mixes are one cuBLAS GEMM instead of per-program dot products."""
IN_KERNEL_FN_MAX = 1 << 16
"""Elements of fn above which the mixes are a GEMM at any batch (each program would read
all of fn alone: 256 KB, a few microseconds, at this size)."""


@triton.jit
def _hyper_connection_kernel(
    streams_ptr,
    fn_ptr,
    base_ptr,
    scale_ptr,
    mixes_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    hc_eps,
    norm_eps,
    iters,
    HC: tl.constexpr,
    HIDDEN: tl.constexpr,
    HC_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MIXES_GIVEN: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    K = HC * HIDDEN
    i = tl.arange(0, HC_P)
    row_ok = i < HC
    valid = row_ok[:, None] & row_ok[None, :]
    ks = tl.arange(0, BLOCK_K)
    x_row = streams_ptr + t * K
    comb_rows = 2 * HC + i[:, None] * HC + i[None, :]  # fn's row of comb[i, j]
    if MIXES_GIVEN:
        # fn . x from the GEMM; the RMS of x here.
        M = (2 + HC) * HC
        sq_acc = tl.zeros((BLOCK_K,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            sq_acc += x * x
        rstd = 1.0 / tl.sqrt_rn(tl.sum(sq_acc, axis=0) / K + norm_eps)
        pre_mix = tl.load(mixes_ptr + t * M + i, mask=row_ok, other=0.0) * rstd
        post_mix = tl.load(mixes_ptr + t * M + HC + i, mask=row_ok, other=0.0) * rstd
        comb_mix = tl.load(mixes_ptr + t * M + comb_rows, mask=valid, other=0.0) * rstd
    else:
        pre_acc = tl.zeros((HC_P, BLOCK_K), tl.float32)
        post_acc = tl.zeros((HC_P, BLOCK_K), tl.float32)
        comb_acc = tl.zeros((HC_P, HC_P, BLOCK_K), tl.float32)
        sq_acc = tl.zeros((BLOCK_K,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
            sq_acc += x * x
            w_mask = row_ok[:, None] & k_ok[None, :]
            w_pre = tl.load(fn_ptr + i[:, None] * K + k[None, :], mask=w_mask, other=0.0)
            w_post = tl.load(fn_ptr + (HC + i)[:, None] * K + k[None, :], mask=w_mask, other=0.0)
            w_comb = tl.load(fn_ptr + comb_rows[:, :, None] * K + k[None, None, :],
                             mask=valid[:, :, None] & k_ok[None, None, :], other=0.0)  # fmt: skip
            pre_acc += w_pre * x[None, :]
            post_acc += w_post * x[None, :]
            comb_acc += w_comb * x[None, None, :]
        # unweighted RMS norm of the flattened streams: x / sqrt(mean(x^2) + eps)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(sq_acc, axis=0) / K + norm_eps)
        pre_mix = tl.sum(pre_acc, axis=1) * rstd
        post_mix = tl.sum(post_acc, axis=1) * rstd
        comb_mix = tl.sum(comb_acc, axis=2) * rstd
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    b_pre = tl.load(base_ptr + i, mask=row_ok, other=0.0)
    b_post = tl.load(base_ptr + HC + i, mask=row_ok, other=0.0)
    b_comb = tl.load(base_ptr + comb_rows, mask=valid, other=0.0)
    pre = tl.sigmoid(pre_mix * s_pre + b_pre) + hc_eps
    post = 2 * tl.sigmoid(post_mix * s_post + b_post)
    # comb: softmax over each row (j), + eps, then Sinkhorn: columns, then rows and columns.
    z = tl.where(valid, comb_mix * s_comb + b_comb, float("-inf"))
    z_max = tl.where(row_ok, tl.max(z, axis=1), 0.0)
    e = tl.exp(z - z_max[:, None])
    e_sum = tl.where(row_ok, tl.sum(e, axis=1), 1.0)
    comb = tl.where(valid, e / e_sum[:, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(1, iters):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(post_ptr + t * HC + i, post, mask=row_ok)
    tl.store(comb_ptr + t * HC * HC + i[:, None] * HC + i[None, :], comb, mask=valid)
    # The block's input: sum_i pre_i * stream_i, in float32, rounded once.
    for h0 in range(0, HIDDEN, BLOCK_K):
        h = h0 + ks
        h_ok = h < HIDDEN
        s = tl.load(x_row + i[:, None] * HIDDEN + h[None, :], mask=row_ok[:, None] & h_ok[None, :], other=0.0)
        collapsed = tl.sum(pre[:, None] * s.to(tl.float32), axis=0)
        tl.store(out_ptr + t * HIDDEN + h, collapsed.to(out_ptr.dtype.element_ty), mask=h_ok)


def hyper_connection(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, hidden]; fn [(2 + hc) * hc, hc * hidden], base [(2 + hc) * hc],
    scale [3] (float32) -> post [T, hc], comb [T, hc, hc] (float32) and the block's
    input [T, hidden] in streams' dtype, as HyperConnection.forward."""
    if streams.dim() != 3:
        raise ValueError(f"streams must be [tokens, hc, hidden], got shape {tuple(streams.shape)}")
    num_tokens, hc, hidden = streams.shape
    device = streams.device
    check_device(device)
    size = (2 + hc) * hc
    check_tensor("fn", fn, ndim=2, dtypes=(torch.float32,), device=device, shape=(size, hc * hidden))
    check_tensor("base", base, ndim=1, dtypes=(torch.float32,), device=device, shape=(size,))
    check_tensor("scale", scale, ndim=1, dtypes=(torch.float32,), device=device, shape=(3,))
    check_tensor("streams", streams, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    if sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters must be at least 1, got {sinkhorn_iters}")
    streams, fn = streams.contiguous(), fn.contiguous()
    post = torch.empty(num_tokens, hc, dtype=torch.float32, device=device)
    comb = torch.empty(num_tokens, hc, hc, dtype=torch.float32, device=device)
    out = torch.empty(num_tokens, hidden, dtype=streams.dtype, device=device)
    mixes = None
    if num_tokens > MIXES_BY_GEMM_ABOVE or fn.numel() > IN_KERNEL_FN_MAX:
        # fn . x in float32 (the reference's precision), before the RMS (the kernel's).
        mixes = F.linear(streams.reshape(num_tokens, -1).float(), fn)
    if num_tokens:
        _hyper_connection_kernel[(num_tokens,)](
            streams, fn, base, scale, post if mixes is None else mixes, post, comb, out, float(hc_eps),
            float(norm_eps), int(sinkhorn_iters), HC=hc, HIDDEN=hidden, HC_P=next_power_of_2(hc),
            BLOCK_K=min(_BLOCK_K, next_power_of_2(hc * hidden)), MIXES_GIVEN=mixes is not None,
        )  # fmt: skip
    return post, comb, out
