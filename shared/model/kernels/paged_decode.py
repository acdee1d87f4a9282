"""Paged-attention decode: one query token per sequence over its KV in the paged cache.

One program per (sequence, kv head, split): it loads the query heads of that kv
head's group together (GQA), so each key and value is read once for all of them,
and walks its share of the sequence's KV tiles. With several splits (flash-decoding,
for few sequences with long contexts) each program leaves an unnormalised partial
output with its running max and sum, and a reduce kernel combines them.

Launch inputs are device tensors (seq_lens, block_tables) and static shapes only;
the split of a sequence is computed in the kernel from its length. Nothing syncs
with the host, so the launch can be captured in a CUDA graph, and any num_splits
gives the same result (it only changes speed).

An optional per-sequence key floor (``key_floor[s]``, the first key position whose KV
exists, for a sliding-window layer replaying from there) raises the start of the key
range, kv_lo, before the range is split, so every split covers keys from the floor
on; the tile holding the floor masks the keys below it one by one.

Reference: ``reference.paged_attention_ref`` (the model's CPU path).
"""

import torch
import triton
import triton.language as tl

from shared.model.kernels.checks import next_power_of_2
from shared.model.kernels.paged_common import (
    LOG2E,
    attend_tiles,
    cdiv,
    check_key_floor,
    check_paged_inputs,
    check_sinks,
    dot_precision,
    num_sms,
    output_like,
)
from shared.model.kernels.reference import paged_attention_ref

__all__ = ["choose_num_splits", "paged_attention_ref", "paged_decode_attention"]

MAX_SPLITS = 64
_MIN_TILES_PER_SPLIT = 1  # a split of one 64-key tile still pays: b=1 at 1k, 16 splits 7.8 us vs 8 splits 8.7 (H200)
_WAVES = 4  # programs per multiprocessor that a split aims for


# Values that change from step to step are never specialised on (no recompiles while serving).
@triton.jit(do_not_specialize=["stride_bt", "window", "num_splits"])
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    seq_lens_ptr,
    tables_ptr,
    key_floor_ptr,
    sinks_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    stride_ot,
    stride_oh,
    scale_log2e,
    window,
    num_splits,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_FLOOR: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)

    # The window is a range here: the one query sits at seq_len - 1, so keys j >= seq_len - W.
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(seq_len - window, 0)
    if HAS_FLOOR:
        # Keys from the floor on; a floor past the query leaves an empty range (zeros).
        kv_lo = tl.minimum(tl.maximum(kv_lo, tl.load(key_floor_ptr + seq).to(tl.int32)), seq_len)
    tile_lo = kv_lo // BLOCK_N
    tile_hi = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
    t0 = tile_lo + split * per_split
    t1 = tl.minimum(t0 + per_split, tile_hi)

    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    if HAS_SINKS:
        if split == 0:
            # The sink is one more key with no value: the running max starts at its logit
            # (log2 domain) with weight 1. Split 0 only, so the reduce counts it once.
            sink = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0).to(tl.float32)
            m_i = sink * 1.4426950408889634
            l_i = tl.zeros([BLOCK_G], dtype=tl.float32) + 1.0
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + seq_len - 1
    acc, m_i, l_i = attend_tiles(
        acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, tables_ptr + seq * stride_bt, kv_head.to(tl.int64) * stride_kh,
        stride_kb, stride_ks, t0, t1, kv_lo, seq_len, window, scale_log2e, d, d_ok,
        BLOCK_N, BLOCK_SIZE, False, False, DOT_PRECISION,
    )  # fmt: skip
    if not SPLIT:
        # A sequence of length 0 (a padded batch entry) has no key: write zeros, not NaN.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_ptrs = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (seq * NUM_HEADS + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
        tl.store(part_m_ptr + part, m_i, mask=g_ok)
        tl.store(part_l_ptr + part, l_i, mask=g_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_SPLITS)
    sp_ok = sp < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    part = (seq * NUM_HEADS + head) * num_splits + sp
    m = tl.load(part_m_ptr + part, mask=sp_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=sp_ok, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # 0 for empty splits
    denom = tl.sum(weight * l, 0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def default_block_n(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, device: torch.device) -> int:
    """Splits per sequence so that about _WAVES programs run per multiprocessor, each
    over at least _MIN_TILES_PER_SPLIT tiles; 1 when the batch alone fills the GPU."""
    programs = num_seqs * num_kv_heads
    target = _WAVES * num_sms(device)
    if programs >= target // 2:
        return 1
    by_length = max(1, cdiv(max_seq_len, block_n) // _MIN_TILES_PER_SPLIT)
    return max(1, min(cdiv(target, programs), by_length, MAX_SPLITS))


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    key_floor: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [num_seqs, heads, D] (the newest token of each sequence, whose K/V are
    already in the cache); kv_cache [2, num_blocks, block_size, kv_heads, D];
    seq_lens [num_seqs] and block_tables [num_seqs, max_blocks] (int32/int64, device).
    -> [num_seqs, heads, D] in query's dtype (written into ``out`` if given).

    num_splits None picks one from the batch and the table width (a static bound on
    the length, so no host sync). key_floor [num_seqs] (int32/int64, device) or None:
    sequence s attends only keys j >= key_floor[s] (none left: zeros); applied whenever
    given, so a caller passes it for sliding-window layers only. sinks [heads] (float,
    device) or None: each head's sink logit joins its softmax with no value (GPT-OSS)."""
    num_seqs, num_heads, num_kv_heads, head_dim = check_paged_inputs(
        query, kv_cache, seq_lens, block_tables, sliding_window
    )
    if query.shape[0] != num_seqs:
        raise ValueError(f"decode takes one query per sequence: query has {query.shape[0]} rows, seq_lens {num_seqs}")
    check_key_floor(key_floor, num_seqs, query.device)
    check_sinks(sinks, num_heads, query.device)
    block_size = kv_cache.shape[2]
    block_n = default_block_n(head_dim) if block_n is None else block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is None:
        max_len = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_len, block_n, query.device)
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")
    out = output_like(query, out)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_d = next_power_of_2(head_dim)
    if num_splits > 1:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    k, v = kv_cache[0], kv_cache[1]
    floor_arg = seq_lens if key_floor is None else key_floor  # unread without a floor
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k, v, seq_lens, block_tables, floor_arg, query if sinks is None else sinks, out, part_acc, part_m, part_l,
        query.stride(0), query.stride(1), k.stride(0), k.stride(1), k.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), scale * LOG2E, sliding_window or 0, num_splits,
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=max(16, next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_SIZE=block_size, SPLIT=num_splits > 1,
        HAS_WINDOW=sliding_window is not None, HAS_FLOOR=key_floor is not None, HAS_SINKS=sinks is not None,
        DOT_PRECISION=dot_precision(query.dtype), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _reduce_kernel[(num_seqs, num_heads)](
            part_acc, part_m, part_l, out, out.stride(0), out.stride(1), num_splits,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_SPLITS=next_power_of_2(num_splits), num_warps=4 if block_d >= 128 else 1,
        )  # fmt: skip
    return out
