"""What the two paged-attention kernels share: the online-softmax loop over KV tiles
gathered through a block table, and the checks of the cache and index tensors.

Keys are read as [BLOCK_N tokens, head_dim] rows of the cache ``[2, num_blocks,
block_size, num_kv_heads, head_dim]``: token j of a sequence sits in block
``block_table[j // block_size]`` at offset ``j % block_size``, so BLOCK_N is free of
the block size. Scores are kept in the log2 domain (scale * log2(e) folded into
the scale) so the exponentials are exp2.
"""

import torch
import triton
import triton.language as tl

from shared.model.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_device, check_tensor

LOG2E = 1.4426950408889634


@triton.jit
def attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_ptr,
    v_ptr,
    table_ptr,
    head_offset,
    stride_kb,
    stride_ks,
    tile_lo,
    tile_hi,
    kv_lo,
    kv_hi,
    window,
    scale_log2e,
    d,
    d_ok,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """Fold KV tiles [tile_lo, tile_hi) (keys kv_lo <= j < kv_hi) into the running
    (acc [M, D], max m_i [M], sum l_i [M]) of queries q [M, D] at positions q_pos [M].
    CAUSAL keeps j <= q_pos; HAS_WINDOW also drops q_pos - j >= window. kv_lo is
    exact at any position (a masked tile drops j < kv_lo key by key), so a caller
    folds a sequence's key floor into it.

    MASKED=False is for tiles the caller knows every query sees whole (below the
    causal diagonal, inside [kv_lo, kv_hi)): no bounds or mask arithmetic at all,
    which is most of a long prefill's tiles."""
    for t in range(tile_lo, tile_hi):
        j = t * BLOCK_N + tl.arange(0, BLOCK_N)
        if MASKED:
            j_ok = (j >= kv_lo) & (j < kv_hi)
            block = tl.load(table_ptr + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
        else:
            block = tl.load(table_ptr + j // BLOCK_SIZE).to(tl.int64)
        offset = block * stride_kb + (j % BLOCK_SIZE).to(tl.int64) * stride_ks + head_offset
        if MASKED:
            k = tl.load(k_ptr + offset[None, :] + d[:, None], mask=j_ok[None, :] & d_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + offset[None, :] + d[:, None], mask=d_ok[:, None], other=0.0)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2e
        if MASKED:
            allowed = j_ok[None, :]
            if CAUSAL:
                allowed = allowed & (j[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                allowed = allowed & (q_pos[:, None] - j[None, :] < window)
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no key yet keeps max -inf: subtract 0 instead, so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptr + offset[:, None] + d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_ptr + offset[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


def check_paged_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    sliding_window: int | None,
) -> tuple[int, int, int, int]:
    """-> (num_seqs, num_heads, num_kv_heads, head_dim), after checking the shared inputs."""
    device = query.device
    check_device(device)
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    _, num_heads, head_dim = query.shape
    kv_shape = (2, None, None, None, head_dim)
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=FLOAT_DTYPES, device=device, shape=kv_shape)
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"query has {num_heads} heads, not a multiple of the cache's {num_kv_heads} kv heads")
    if head_dim < 16:
        raise ValueError(f"head_dim must be at least 16 for the attention kernels' matrix products, got {head_dim}")
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    num_seqs = seq_lens.shape[0]
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device, shape=(num_seqs, None))
    if kv_cache[0].stride() != kv_cache[1].stride():
        raise ValueError("keys and values of kv_cache must have the same strides")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or at least 1, got {sliding_window}")
    return num_seqs, num_heads, num_kv_heads, head_dim


def check_key_floor(key_floor: torch.Tensor | None, num_seqs: int, device: torch.device) -> None:
    """key_floor: None, or [num_seqs] int32/int64 on the query's device (the first key
    position of each sequence that attention may read)."""
    if key_floor is not None:
        check_tensor("key_floor", key_floor, ndim=1, dtypes=INDEX_DTYPES, device=device, shape=(num_seqs,))


def check_sinks(sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    """sinks: None, or [num_heads] float on the query's device (one logit per head)."""
    if sinks is not None:
        check_tensor("sinks", sinks, ndim=1, dtypes=FLOAT_DTYPES, device=device, shape=(num_heads,))


def output_like(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` after checking that it can take the result, or a new tensor like query."""
    if out is None:
        return torch.empty_like(query, memory_format=torch.contiguous_format)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(-1) != 1:
        raise ValueError(
            f"out must be like query {tuple(query.shape)} {query.dtype} on {query.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    return out


def dot_precision(dtype: torch.dtype) -> str:
    # float32 products in full precision (the default would be TF32 on the tensor cores).
    return "ieee" if dtype == torch.float32 else "tf32"


def num_sms(device: torch.device) -> int:
    """Multiprocessors of the device; 1 for the CPU (the interpreter)."""
    if device.type != "cuda":
        return 1
    return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())


_SMS: dict[int, int] = {}


def _cuda_num_sms(index: int) -> int:
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def cdiv(a: int, b: int) -> int:
    return triton.cdiv(a, b)
