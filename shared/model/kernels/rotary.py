"""Rotary embedding (neox layout: the two halves of each head rotate together) applied to
q and k in place, in one launch over the tokens.

cos/sin are ``RotaryEmbedding``'s tables for the batch's positions ([T, head_dim] in
the model dtype, both halves equal), so llama3/linear scaling comes from the same
``rope_inv_freq``. Like transformers' ``x * cos + rotate_half(x) * sin`` (the
reference, ``layers.apply_rope``), each product and the sum round to the input dtype:
bf16/fp16 results equal PyTorch's.
"""

import torch
import triton
import triton.language as tl

from shared.model.kernels.checks import FLOAT_DTYPES, check_device, check_tensor, next_power_of_2
from shared.model.kernels.reference import rotary_ref

__all__ = ["rotary_embedding_", "rotary_ref"]


@triton.jit
def _rotate_heads(
    x_ptr, stride_t, stride_h, t, cos, sin, num_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (i < HALF)[None, :]
    base = x_ptr + t * stride_t + heads[:, None] * stride_h + i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    # rotate_half(x) = (-x2, x1): out1 = x1*cos + (-x2)*sin, out2 = x2*cos + x1*sin, rounding like PyTorch.
    # Round each product and the sum to the storage dtype, nearest-even, as
    # PyTorch's elementwise ops do, so results match apply_rope bit for bit.
    out1 = (x1 * cos).to(dtype, fp_downcast_rounding="rtne").to(tl.float32) + (-x2 * sin).to(
        dtype, fp_downcast_rounding="rtne"
    ).to(tl.float32)
    out2 = (x2 * cos).to(dtype, fp_downcast_rounding="rtne").to(tl.float32) + (x1 * sin).to(
        dtype, fp_downcast_rounding="rtne"
    ).to(tl.float32)
    tl.store(base, out1.to(dtype, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(base + HALF, out2.to(dtype, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + t * stride_cos + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_sin + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, stride_qt, stride_qh, t, cos, sin, num_q_heads, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, stride_kt, stride_kh, t, cos, sin, num_k_heads, HALF, BLOCK_HK, BLOCK_HALF)


def rotary_embedding_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, heads, D] and k [T, kv_heads, D] in place with cos/sin [T, D]
    (RotaryEmbedding's output, in q's dtype); returns (q, k)."""
    device = q.device
    check_device(device)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    num_tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=device, shape=(num_tokens, None, head_dim))
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, ndim=2, dtypes=(q.dtype,), device=device, shape=(num_tokens, head_dim))
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    block_half = next_power_of_2(half)
    _rotary_kernel[(num_tokens,)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        q.shape[1], k.shape[1], HALF=half, BLOCK_HQ=next_power_of_2(q.shape[1]), BLOCK_HK=next_power_of_2(k.shape[1]),
        BLOCK_HALF=block_half, num_warps=4 if q.shape[1] * block_half >= 1024 else 1,
    )  # fmt: skip
    return q, k
