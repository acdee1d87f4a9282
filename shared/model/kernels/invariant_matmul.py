"""Batch-invariant matmul: x [M, K] @ weight [N, K]^T (+ bias) -> [M, N], one Triton
GEMM whose result for a row does not depend on M or on the other rows.

Why a row's bits can change with the batch in a library GEMM: the library picks a
kernel, tile shape and split-K from M (a GEMV for one row, split-K for few rows,
larger tiles for many), and each choice sums the K products in another order. Here
the tile configuration is a function of (N, K, dtype) only, which are the weight's,
never of M; every output element is one program's fp32 accumulator that walks K in
BLOCK_K steps from 0 upwards (no split-K, no atomics), and each step is one tensor-core
product of fixed shape in which an element's sum over its BLOCK_K terms does not
depend on its row's place in the tile. Rows past M load zeros and are never stored,
so they change nothing either.

M is not specialised on (``do_not_specialize``): Triton would otherwise compile a
separate variant for M == 1 and for M divisible by 16, and the same arithmetic in
another compiled variant is an assumption this module does not need to make.

Reference: ``torch.nn.functional.linear`` (equal up to the order of the sums).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.model.kernels.checks import FLOAT_DTYPES, check_device, check_tensor

__all__ = ["MatmulConfig", "invariant_matmul", "matmul_config"]


@dataclass(frozen=True, slots=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def matmul_config(n: int, k: int, dtype: torch.dtype) -> MatmulConfig:
    """The one tile configuration of a weight [n, k] in ``dtype``: a function of the
    weight alone, so every M (1 to 8192, decode or prefill) runs the same code.

    bf16/fp16, from a sweep on the H200 over Llama-3-8B's weights at M = 1 .. 8192
    (each weight's best geometric mean of the time ratio to cuBLAS; ``tools/bench/
    batch_invariant_bench.py --matmul`` prints the result):
    - a wide output (n >= 16384: gate_up, the logits) has column tiles for every
      multiprocessor even at M = 1: 128x128x64 tiles, 8 warps, the large-M shape;
    - a narrow one (n <= 4096: o_proj, down_proj) has 64 column tiles of 64 at best in
      decode, so each must keep much of the weight in flight: 64x64x128 tiles, 6 stages
      (192 KiB of shared memory: Hopper's size);
    - between (qkv, n = 6144): 64x128x64 tiles, 5 stages.
    float32 runs in IEEE precision (no TF32), like the PyTorch path, in small tiles."""
    del k  # K sets only the number of steps; kept in the signature: the config is the weight's
    if dtype == torch.float32:
        return MatmulConfig(block_m=32, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=2)
    if n >= 16384:
        return MatmulConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
    if n <= 4096:
        return MatmulConfig(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=6)
    return MatmulConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=5)


# M changes every step: never specialised on (no recompiles, one compiled variant for all M).
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Grouped order of the output tiles (consecutive programs share weight columns in L2).
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past M load zeros and are never stored; masked lanes issue no memory traffic,
    # which matters in decode (a 128-row tile of one real row). Columns past N (a weight
    # whose N is no multiple of BLOCK_N) load a real column instead: no mask per element.
    m_ok = rm < M
    rn_load = (rn % N).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn_load[None, :] * stride_wn + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # K in one fixed order, BLOCK_K at a time, into one fp32 accumulator per element.
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = k0 + rk < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def invariant_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, config: MatmulConfig | None = None
) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias [N]) -> [..., N] in x's dtype, as F.linear.
    ``config`` overrides the weight's tile configuration (tuning sweeps only: a caller
    that varies it per call gives up invariance)."""
    check_device(x.device)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    n, k = weight.shape
    check_tensor("x", x, ndim=x.dim(), dtypes=(weight.dtype,), device=x.device, unit_last_stride=False)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight {tuple(weight.shape)} takes {k}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(weight.dtype,), device=x.device, shape=(n,))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    if k == 0:
        return (out.zero_() if bias is None else out.copy_(bias.expand(m, n))).view(*lead, n)
    c = config or matmul_config(n, k, weight.dtype)
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
    _matmul_kernel[grid](
        x2, weight, weight if bias is None else bias, out, m, n, k, x2.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % c.block_k == 0, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        BLOCK_K=c.block_k, GROUP_M=c.group_m, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return out.view(*lead, n)


invariant_matmul.any_rows = True  # type: ignore[attr-defined]
"""layers.linear hands every input to this row kernel, not only single rows."""
