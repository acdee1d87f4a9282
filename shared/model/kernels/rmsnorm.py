"""RMSNorm, optionally fused with the residual add before it (vLLM's fused_add_rms_norm).

Same order of operations as transformers' LlamaRMSNorm (``layers.rms_norm``, the
reference): the residual add rounds to the input dtype, the input is widened to
float32, scaled by 1/sqrt(mean(x^2) + eps), rounded back to the input dtype, then
multiplied by the weight and rounded again. bf16/fp16 results therefore match
PyTorch's except where the float32 sum of squares, summed in another order,
differs in its last bit. A float32 weight on a narrower input is GptOssRMSNorm's
order: the weight applied in float32, one rounding at the end.
"""

import torch
import triton
import triton.language as tl

from shared.model.kernels.checks import FLOAT_DTYPES, check_device, check_tensor, next_power_of_2
from shared.model.kernels.reference import fused_add_rms_norm_ref, rms_norm_ref

__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_ref", "rms_norm", "rms_norm_ref"]

_ELEMENTS_PER_PROGRAM = 4096  # small rows (per-head q/k norms) are packed several to a program


@triton.jit(do_not_specialize=["num_rows"])  # the batch size: no recompile when it changes
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    num_rows,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    eps,
    NUM_COLS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_BEFORE_SCALE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < NUM_COLS
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # Rounded to the input dtype first, as PyTorch's `x + residual` is.
        x = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows[:, None] * stride_res_out + cols[None, :], x, mask=mask)
        x = x.to(tl.float32)
    # Correctly rounded division and square root, as PyTorch's CPU mean and rsqrt.
    variance = tl.div_rn(tl.sum(x * x, axis=1), tl.full((BLOCK_ROWS,), NUM_COLS, tl.float32))
    rstd = tl.div_rn(tl.full((BLOCK_ROWS,), 1.0, tl.float32), tl.sqrt_rn(variance + eps))
    normed = x * rstd[:, None]
    if ROUND_BEFORE_SCALE:
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = (normed * w[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out, mask=mask)


def _as_rows(t: torch.Tensor, num_cols: int) -> torch.Tensor:
    """[-1, num_cols] rows of one stride: a view where the strides allow it, else a copy
    (e.g. q's heads, a strided slice of the stacked qkv projection)."""
    return t.reshape(-1, num_cols)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    num_cols = x.shape[-1]
    check_device(x.device)
    check_tensor("x", x, ndim=x.dim(), dtypes=FLOAT_DTYPES, device=x.device)
    check_tensor("weight", weight, ndim=1, dtypes=(x.dtype, torch.float32), device=x.device, shape=(num_cols,))
    x2 = _as_rows(x, num_cols)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, num_cols)
    res2 = res_out2 = x2  # placeholders, never read without HAS_RESIDUAL
    res_out = None
    if residual is not None:
        check_tensor("residual", residual, ndim=x.dim(), dtypes=(x.dtype,), device=x.device, shape=tuple(x.shape))
        res2 = _as_rows(residual, num_cols)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_out2 = res_out.view(-1, num_cols)
    num_rows = x2.shape[0]
    if num_rows == 0:
        return out, res_out
    block_n = next_power_of_2(num_cols)
    block_rows = max(1, _ELEMENTS_PER_PROGRAM // block_n)  # fixed per row size: one compiled variant
    num_warps = max(1, min(8, block_rows * block_n // 512))
    _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
        x2, res2, weight, out2, res_out2, num_rows,
        x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0), eps,
        NUM_COLS=num_cols, HAS_RESIDUAL=residual is not None, ROUND_BEFORE_SCALE=weight.dtype != torch.float32,
        BLOCK_ROWS=block_rows, BLOCK_N=block_n,
        num_warps=num_warps,
    )  # fmt: skip
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] (rows viewable as [-1, N]), weight [N] in x's dtype or float32 -> normed x, a new tensor."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(x + residual), x + residual), both new tensors, in one pass."""
    out, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out
