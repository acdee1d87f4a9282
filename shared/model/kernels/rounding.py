"""Rounding inside a kernel as PyTorch rounds between its separate elementwise ops."""

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 x rounded to ``dtype`` (nearest-even) and widened back to float32.

    bfloat16 by bit arithmetic: on the H200, Triton's ``x.to(tl.bfloat16).to(tl.float32)``
    feeding further arithmetic did not always round like a separate op (the rotary
    kernel had 16% of its outputs an ulp off PyTorch's); the bit form matches exactly.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)
