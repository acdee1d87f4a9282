"""y = x @ W.T for a single row x: the matmuls of batch-1 decode.

With one row, a matmul is a stream over the weight: every element is read once
and used once, so its speed is the memory bandwidth it reaches. Each program
owns BLOCK_N output features and walks the whole of K in BLOCK_K slices,
multiplying and summing in float32 (as cuBLAS accumulates), then rounds once to
the output dtype. Nothing is split along K, so no second pass and no atomics:
the result is the same for any launch order.

Reference: ``torch.nn.functional.linear``.
"""

import torch
import triton
import triton.language as tl

from shared.model.kernels.checks import FLOAT_DTYPES, check_device, check_tensor
from shared.model.kernels.rounding import round_to

__all__ = ["gemv"]


@triton.jit
def _load_x(x_ptr, k, K, mask, GATED: tl.constexpr):
    """x[k] in float32; GATED: x_ptr holds (gate, up) halves of K each and x is
    silu(gate) * up, rounded as ``activation.silu_and_mul`` rounds."""
    if GATED:
        dtype = x_ptr.dtype.element_ty
        g = tl.load(x_ptr + k, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + k, mask=mask, other=0.0).to(tl.float32)
        return round_to(round_to(g / (1.0 + tl.exp(-g)), dtype) * u, dtype)
    else:
        return tl.load(x_ptr + k, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, N, K, stride_wn,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = _load_x(x_ptr, k, K, k < K, GATED)  # x is small: its mask costs nothing
            w = tl.load(rows + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = k < K
            x = _load_x(x_ptr, k, K, k_ok, GATED)
            w = tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    gated: bool = False,
    block_n: int = 8,
    block_k: int = 512,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x [1, K], weight [N, K] (row-major), bias [N] or None -> [1, N] in x's dtype.

    ``gated``: x is [1, 2K], the (gate, up) output of a merged projection, and the
    product is with silu(gate) * up: the MLP's activation fused into its down
    projection, one launch and no intermediate instead of two."""
    device = x.device
    check_device(device)
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, device=device, shape=(1, None))
    if gated and x.shape[1] % 2:
        raise ValueError(f"gated: x holds gate and up halves, so its width must be even, got {x.shape[1]}")
    num_cols = x.shape[1] // 2 if gated else x.shape[1]
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), device=device, shape=(None, num_cols))
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), device=device, shape=(weight.shape[0],))
    for name, value in (("block_n", block_n), ("block_k", block_k)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    num_rows = weight.shape[0]
    y = torch.empty((1, num_rows), dtype=x.dtype, device=device)
    if num_rows == 0:
        return y
    _gemv_kernel[(triton.cdiv(num_rows, block_n),)](
        x, weight, weight if bias is None else bias, y, num_rows, num_cols, weight.stride(0),
        HAS_BIAS=bias is not None, GATED=gated, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=num_cols % block_k == 0,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y
