"""Rotary embedding (neox layout: the two halves of each head rotate together) applied to
q and k in one launch over the tokens: both in place, or q in place and the rotated
k with v written straight into the paged KV cache (the decode step's usual case,
three launches saved per layer).

cos/sin are ``RotaryEmbedding``'s tables for the batch's positions ([T, head_dim] in
the model dtype, both halves equal), so llama3/linear scaling comes from the same
``rope_inv_freq``. Like transformers' ``x * cos + rotate_half(x) * sin`` (the
reference, ``layers.apply_rope``), each product and the sum round to the input dtype:
bf16/fp16 results equal PyTorch's.
"""

import torch
import triton
import triton.language as tl

from shared.model.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_device, check_tensor, next_power_of_2
from shared.model.kernels.reference import rotary_ref
from shared.model.kernels.rounding import round_to

__all__ = ["rotary_embedding_", "rotary_embedding_and_store_kv", "rotary_ref"]


@triton.jit
def _rotate_heads(
    x_ptr, stride_t, stride_h, t, out_ptr, out_stride_t, out_stride_h, out_row, cos, sin, num_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Rotate token t's heads of x into row ``out_row`` of out (x itself when rotating in place)."""
    heads = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (i < HALF)[None, :]
    base = x_ptr + t * stride_t + heads[:, None] * stride_h + i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    # rotate_half(x) = (-x2, x1): out1 = x1*cos + (-x2)*sin, out2 = x2*cos + x1*sin.
    # Each product and the sum round to the input dtype as PyTorch's separate ops do,
    # so results match apply_rope bit for bit.
    out1 = round_to(round_to(x1 * cos, dtype) + round_to(-x2 * sin, dtype), dtype)
    out2 = round_to(round_to(x2 * cos, dtype) + round_to(x1 * sin, dtype), dtype)
    out = out_ptr + out_row * out_stride_t + heads[:, None] * out_stride_h + i[None, :]
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out, out1.to(out_dtype), mask=mask)
    tl.store(out + HALF, out2.to(out_dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_cache_slot, stride_cache_h, num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    STORE_KV: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + t * stride_cos + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_sin + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, stride_qt, stride_qh, t, q_ptr, stride_qt, stride_qh, t, cos, sin, num_q_heads,
                  HALF, BLOCK_HQ, BLOCK_HALF)  # fmt: skip
    if STORE_KV:
        # The rotated key and the value go straight to the token's cache slot.
        slot = tl.load(slots_ptr + t).to(tl.int64)
        _rotate_heads(k_ptr, stride_kt, stride_kh, t, k_cache_ptr, stride_cache_slot, stride_cache_h, slot, cos, sin,
                      num_k_heads, HALF, BLOCK_HK, BLOCK_HALF)  # fmt: skip
        heads = tl.arange(0, BLOCK_HK)
        d = tl.arange(0, 2 * BLOCK_HALF)
        mask = (heads < num_k_heads)[:, None] & (d < 2 * HALF)[None, :]
        v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask)
        dst = v_cache_ptr + slot * stride_cache_slot + heads[:, None] * stride_cache_h + d[None, :]
        tl.store(dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        _rotate_heads(k_ptr, stride_kt, stride_kh, t, k_ptr, stride_kt, stride_kh, t, cos, sin, num_k_heads,
                      HALF, BLOCK_HK, BLOCK_HALF)  # fmt: skip


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    check_device(q.device)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, device=q.device)
    num_tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device, shape=(num_tokens, None, head_dim))
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, ndim=2, dtypes=(q.dtype,), device=q.device, shape=(num_tokens, head_dim))


def _launch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    v: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
) -> None:  # fmt: skip
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_half = next_power_of_2(half)
    store = kv_cache is not None
    if store:
        assert v is not None and kv_cache is not None and slot_mapping is not None
        k_cache, v_cache, slots = kv_cache[0], kv_cache[1], slot_mapping
        cache_strides = (k_cache.stride(1), k_cache.stride(2))  # [blocks, block_size, heads, D]: a slot, a head
    else:  # unused pointers: the kernel reads them only when STORE_KV
        k_cache = v_cache = v = slots = k
        cache_strides = (0, 0)
    _rotary_kernel[(num_tokens,)](
        q, k, v, cos, sin, k_cache, v_cache, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        *cache_strides, num_q_heads, k.shape[1],
        HALF=half, BLOCK_HQ=next_power_of_2(num_q_heads), BLOCK_HK=next_power_of_2(k.shape[1]),
        BLOCK_HALF=block_half, STORE_KV=store, num_warps=4 if num_q_heads * block_half >= 1024 else 1,
    )  # fmt: skip


def rotary_embedding_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, heads, D] and k [T, kv_heads, D] in place with cos/sin [T, D]
    (RotaryEmbedding's output, in q's dtype); returns (q, k)."""
    _check(q, k, cos, sin)
    _launch(q, k, cos, sin)
    return q, k


def rotary_embedding_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q in place, and write the rotated k and v [T, kv_heads, D] to their slots of
    one layer's cache [2, blocks, block_size, kv_heads, D], in one launch: what
    ``rotary_embedding_`` then ``attention.write_kv`` do in three. k is left as it was.
    Returns q."""
    _check(q, k, cos, sin)
    check_tensor("v", v, ndim=3, dtypes=(q.dtype,), device=q.device, shape=tuple(k.shape))
    num_tokens, num_kv_heads, head_dim = k.shape
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=(q.dtype,), device=q.device,
                 shape=(2, None, None, num_kv_heads, head_dim))  # fmt: skip
    if not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous, got strides {kv_cache.stride()}")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=q.device, shape=(num_tokens,))
    _launch(q, k, cos, sin, v, kv_cache, slot_mapping)
    return q
