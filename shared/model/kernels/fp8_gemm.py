"""y = x @ W.T with W FP8 e4m3 in block-scaled tiles and x quantised to FP8 per token
per group of K columns (the scheme: shared/model/fp8_linear.py).

Each program owns a BLOCK_M x BLOCK_N tile of y and walks K one scale group at a time
(BLOCK_K = the group, b1 = 128 for the released checkpoints): ``tl.dot`` of the two
e4m3 tiles into float32 (the tensor cores' FP8 path on capability >= 8.9), times the
rows' activation scales and the columns' weight scales of that group, added to the
accumulator. One rounding to the output dtype at the end. Nothing is split along K,
so the result is the same for any launch order. Ragged edges (N, K not multiples of
the tiles) are masked; the activation codes are padded to whole groups with zeros.

Why not ``torch._scaled_mm``: torch's shape rules (torch/_meta_registrations.py, read
in 2.13) accept a block-scaled form, scale_a [M, K / 128] (1 x 128) with scale_b
[ceil(K / 128), ceil(N / 128)] (128 x 128), beside per-tensor and row-wise; whether the
device's torch 2.11 runs that form on SM90, and for which shapes and scale layouts, is
probed by the GPU session, not assumed. The Triton kernel runs every shape the
checkpoints have (ragged tiles included) and is the one path here.

Reference: ``shared.model.fp8_linear.fp8_linear_ref``.
"""

import torch
import triton
import triton.language as tl

from shared.model.fp8_linear import quantize_activations
from shared.model.kernels.checks import FLOAT_DTYPES, check_device, check_tensor
from shared.model.quantized import FP8_DTYPE

__all__ = ["fp8_linear", "fp8_gemm"]


# M (tokens) changes every step: never specialised on, so serving does not recompile.
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr,
    M, N, K, scale_rows_n,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """c[m, n] = sum over groups g of dot(a[m, g], b[n, g]) * a_scale[m, g] * b_scale[n / scale_rows_n, g]."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_bn
    a_scale_rows = a_scale_ptr + rm.to(tl.int64) * stride_asm
    b_scale_rows = b_scale_ptr + (rn // scale_rows_n).to(tl.int64) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        ks = g * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + ks[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(a_scale_rows + g, mask=m_ok, other=0.0)
        b_s = tl.load(b_scale_rows + g, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _power_of_two(name: str, value: int, least: int) -> None:
    if value < least or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {least}, got {value}")


def fp8_gemm(
    codes: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
    *,
    block_m: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """codes e4m3 [M, >= K] with scale float32 [M, ceil(K / b1)] (``quantize_activations``),
    weight e4m3 [N, K], weight_scale float32 [ceil(N / b0), ceil(K / b1)] -> [M, N] in ``out_dtype``."""
    device = weight.device
    check_device(device)
    check_tensor("weight", weight, ndim=2, dtypes=(FP8_DTYPE,), device=device)
    num_rows_n, k = weight.shape
    # One group a K step: b1 is the K tile, and tl.dot on FP8 wants K tiles of 32 or more.
    _power_of_two("block[1] (the scale group along K)", block[1], 32)
    if block[0] < 1:
        raise ValueError(f"block[0] must be positive, got {block[0]}")
    groups = triton.cdiv(k, block[1])
    check_tensor("codes", codes, ndim=2, dtypes=(FP8_DTYPE,), device=device)
    num_rows_m = codes.shape[0]
    if codes.shape[1] < k:
        raise ValueError(f"codes has {codes.shape[1]} columns, fewer than the weight's K = {k}")
    check_tensor("scale", scale, ndim=2, dtypes=(torch.float32,), device=device, shape=(num_rows_m, groups))
    check_tensor("weight_scale", weight_scale, ndim=2, dtypes=(torch.float32,), device=device,
                 shape=(triton.cdiv(num_rows_n, block[0]), groups))  # fmt: skip
    # Decode (a few rows): a 16-row tile, the smallest tl.dot takes; prefill: 64.
    block_m = block_m or (16 if num_rows_m <= 16 else 64)
    _power_of_two("block_m", block_m, 16)
    _power_of_two("block_n", block_n, 16)
    out = torch.empty((num_rows_m, num_rows_n), dtype=out_dtype, device=device)
    if num_rows_m == 0 or num_rows_n == 0:
        return out
    grid = (triton.cdiv(num_rows_m, block_m), triton.cdiv(num_rows_n, block_n))
    _fp8_gemm_kernel[grid](
        codes, scale, weight, weight_scale, out,
        num_rows_m, num_rows_n, k, block[0],
        codes.stride(0), scale.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block[1], num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [M, K] in a float dtype -> [M, N] in x's dtype: ``Fp8Linear``'s kernel (the ops
    table's ``fp8_linear``). The activations are quantised by PyTorch ops on the device
    (no host read: a CUDA graph holds the whole of it)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, device=weight.device, shape=(None, weight.shape[1]))
    codes, scale = quantize_activations(x, block[1])
    return fp8_gemm(codes, scale, weight, weight_scale, block, x.dtype)
