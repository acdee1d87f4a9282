"""A linear layer whose weight stays FP8 e4m3 with its 128 x 128 block scales, as
DeepSeek ships it, multiplied with activations quantised to FP8 on the fly.

The scheme (DeepSeek-V3/V4's inference code and vLLM's w8a8 block-FP8 matmul use it):

- weight ``W`` e4m3 [N, K] and a float32 scale per [b0, b1] tile, [ceil(N / b0), ceil(K / b1)];
- activations ``x`` [M, K] quantised per token per group of b1 columns: scale
  ``s = amax(|x_group|) / 448`` (448: the largest e4m3), codes ``round(x / s)`` in e4m3;
- ``y[m, n] = sum over column groups g of (sum_k xq[m, k] * Wq[n, k]) * s_x[m, g] * s_w[n / b0, g]``:
  every k of one group shares both scales, so the codes multiply in FP8 and the scales
  apply once per group to the float32 partial sum.

``fp8_linear_ref`` is that product in float32 PyTorch (the CPU path and the reference);
the Triton kernel is shared/model/kernels/fp8_gemm.py, reached through the ops table
(``Ops.fp8_linear``). The weights are exact (the codes and scales as stored); the only
error against the dequantised model is the activations' rounding to e4m3: per element
at most 2^-4 of |x| (3 mantissa bits, round to nearest) where x / s is a normal e4m3
(>= 2^-6), at most 2^-10 s below (the subnormal step is 2^-9 s): ``activation_error_bound``.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.quantized import FP8_DTYPE

FP8_MAX = 448.0
"""The largest finite e4m3 (fn) value."""
_MIN_SCALE = 1e-12
"""An all-zero group still gets a finite scale (its codes are zeros whatever it is)."""

Fp8Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]], torch.Tensor]


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [M, ceil(K / group) * group], float32 scales [M, ceil(K / group)]).

    The codes are padded with zeros to whole groups (a ragged last group's padding adds
    nothing to a product). Device ops only, no host read: a CUDA graph can hold it."""
    rows, cols = x.shape
    groups = math.ceil(cols / group)
    padded = F.pad(x.float(), (0, groups * group - cols)).view(rows, groups, group)
    scale = padded.abs().amax(dim=-1).clamp(min=_MIN_SCALE) / FP8_MAX
    # x / s is within 448 up to the division's rounding; the clamp keeps a value a hair
    # over from becoming NaN (e4m3fn has no infinity: past 464 the cast gives NaN).
    codes = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes.view(rows, groups * group), scale


def dequantize_activations(codes: torch.Tensor, scale: torch.Tensor, cols: int) -> torch.Tensor:
    """float32 [M, cols]: what ``quantize_activations`` codes stand for."""
    rows, groups = scale.shape
    values = codes.float().view(rows, groups, -1) * scale[..., None]
    return values.view(rows, -1)[:, :cols]


def activation_error_bound(x: torch.Tensor, group: int) -> torch.Tensor:
    """Per element, the most ``quantize_activations`` may move x [M, K]: 2^-4 |x| (half a
    step of e4m3's 3-bit mantissa) plus 2^-10 s (half the subnormal step, for codes
    below 2^-6), plus float32's rounding of x / s and back (2^-22 |x|)."""
    rows, cols = x.shape
    groups = math.ceil(cols / group)
    padded = F.pad(x.float(), (0, groups * group - cols)).view(rows, groups, group)
    scale = padded.abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_SCALE) / FP8_MAX
    bound = (2.0**-4 + 2.0**-22) * padded.abs() + 2.0**-10 * scale
    return bound.view(rows, -1)[:, :cols]


def expand_weight_scale(weight_scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """float32 [N, K]: each weight element's tile scale."""
    rows, cols = shape
    return weight_scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [M, K] (a float dtype), weight e4m3 [N, K], weight_scale float32 [ceil(N / b0),
    ceil(K / b1)] -> [M, N] in x's dtype: the activations quantised per token per b1
    columns, both sides' codes times their scales, multiplied in float32."""
    codes, scale = quantize_activations(x, block[1])
    xq = dequantize_activations(codes, scale, x.shape[1])
    w = weight.float() * expand_weight_scale(weight_scale, tuple(weight.shape), block)
    return (xq @ w.T).to(x.dtype)


class Fp8Linear(nn.Module):
    """``weight`` e4m3 [out, in] (a parameter, under the checkpoint's name) and
    ``weight_scale`` float32 [ceil(out / b0), ceil(in / b1)] (a buffer: the loader fills it
    from ``X.scale`` or ``X.weight_scale_inv``). No bias: the FP8 linears of the released
    checkpoints have none. ``kernel``: the ops table's ``fp8_linear`` (Triton on CUDA),
    None for ``fp8_linear_ref``."""

    def __init__(
        self, in_features: int, out_features: int, block: tuple[int, int], device: torch.device,
        kernel: Fp8Kernel | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.block = block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device), requires_grad=False)
        scale_shape = (math.ceil(out_features / block[0]), math.ceil(in_features / block[1]))
        self.weight_scale: torch.Tensor
        self.register_buffer("weight_scale", torch.empty(scale_shape, dtype=torch.float32, device=device))
        self.bias = None
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        y = (self._kernel or fp8_linear_ref)(flat, self.weight, self.weight_scale, self.block)
        return y.view(*lead, y.shape[-1])
