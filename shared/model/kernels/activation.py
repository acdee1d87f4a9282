"""SiLU(gate) * up, the gated MLP's activation, in one pass over the two projections.

As PyTorch (``layers.silu_and_mul``, the reference): silu computed in float32 and
rounded to the input dtype, then the product rounded again.
"""

import torch
import triton
import triton.language as tl

from shared.model.kernels.checks import FLOAT_DTYPES, check_device, check_tensor, next_power_of_2
from shared.model.kernels.reference import silu_and_mul_ref
from shared.model.kernels.rounding import round_to

__all__ = ["silu_and_mul", "silu_and_mul_ref"]

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, num_cols, stride_gate, stride_up, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    g = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = round_to(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(out_ptr + row * stride_out + cols, (silu * u).to(dtype), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [T, I] (any row stride, e.g. the two halves of a merged projection) -> [T, I]."""
    device = gate.device
    check_device(device)
    check_tensor("gate", gate, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("up", up, ndim=2, dtypes=(gate.dtype,), device=device, shape=tuple(gate.shape))
    num_rows, num_cols = gate.shape
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    block = min(_BLOCK, next_power_of_2(num_cols))
    grid = (num_rows, triton.cdiv(num_cols, block))
    _silu_and_mul_kernel[grid](
        gate, up, out, num_cols, gate.stride(0), up.stride(0), out.stride(0),
        BLOCK=block, num_warps=4 if block >= 512 else 1,
    )
    return out
