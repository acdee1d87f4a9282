"""Paged-attention prefill / chunked prefill: a varlen batch of queries (each sequence's
newest tokens, ``query_start_loc``) over the paged cache, whose keys are the
sequence's cached prefix plus the new tokens already written. All sequences in one
launch; decode tokens of a mixed batch are sequences of one query.

One program per (query tile, kv head). A tile holds BLOCK_Q consecutive query tokens
of one sequence times the GROUP query heads of the kv head (row r = token r // GROUP,
head r % GROUP), so each key and value tile is read once for the whole group. The
grid has ``num_tokens // BLOCK_Q + num_seqs`` tiles, an upper bound known without
looking at the lengths: sequence s owns tiles from ``query_start_loc[s] // BLOCK_Q + s``
on, and a program finds its sequence by binary search over query_start_loc; spare
tiles exit at once. Causal with each sequence's offset: query i of a sequence whose
KV holds seq_len tokens after the step sits at position seq_len - query_len + i.

An optional per-sequence key floor (``key_floor[s]``, the first key position whose
KV exists: a sliding-window layer replaying tokens from there after a prefix hit)
raises the lower end of the tile's key range, kv_lo, to at least the floor, so keys
j < floor are skipped or masked key by key; without one (HAS_FLOOR=False) nothing of
it is compiled in.

Reference: ``reference.paged_attention_ref`` (the model's CPU path).
"""

import torch
import triton
import triton.language as tl

from shared.model.kernels.checks import INDEX_DTYPES, check_tensor, next_power_of_2
from shared.model.kernels.paged_common import (
    LOG2E,
    attend_tiles,
    check_key_floor,
    check_paged_inputs,
    check_sinks,
    dot_precision,
    output_like,
)
from shared.model.kernels.reference import paged_attention_ref

__all__ = ["paged_attention_ref", "paged_prefill_attention"]


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence s whose first tile, query_start_loc[s] // BLOCK_Q + s, is <= tile."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Values that change from step to step are never specialised on (no recompiles while serving).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "window"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    tables_ptr,
    key_floor_ptr,
    sinks_ptr,
    num_seqs,
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
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_FLOOR: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Causal tiles late in a sequence see the most keys: run those first, so the
    # short ones fill the last wave instead of leaving one long tile alone at the end.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    i = q_tile * BLOCK_Q + r // GROUP  # query index within the sequence
    row_ok = (r // GROUP < BLOCK_Q) & (i < q_len)
    heads = kv_head * GROUP + r % GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rows = (q_start + i).to(tl.int64)
    mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=mask, other=0.0)
    q_pos = context_len + i

    # Keys the tile's queries may see: up to its last query, from its first query's window
    # and from the sequence's key floor (the same for all its queries, so exact as a range).
    kv_hi = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(context_len + q_tile * BLOCK_Q - window + 1, 0)
    if HAS_FLOOR:
        kv_lo = tl.minimum(tl.maximum(kv_lo, tl.load(key_floor_ptr + seq).to(tl.int32)), kv_hi)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        # The head's sink is one more key with no value: start from its logit (log2 domain), weight 1.
        m_i = tl.load(sinks_ptr + heads).to(tl.float32) * 1.4426950408889634
        l_i = l_i + 1.0
    table = tables_ptr + seq.to(tl.int64) * stride_bt
    head_offset = kv_head.to(tl.int64) * stride_kh
    tile_lo = kv_lo // BLOCK_N
    if not HAS_WINDOW:
        # Tiles wholly at or before the tile's first query are seen whole by every query.
        full_lo = 0
        full_hi = (context_len + q_tile * BLOCK_Q + 1) // BLOCK_N
        if HAS_FLOOR:
            # The tile holding the floor, keys below it masked; then the whole tiles above it.
            full_lo = tl.cdiv(kv_lo, BLOCK_N)
            full_hi = tl.maximum(full_hi, full_lo)
            acc, m_i, l_i = attend_tiles(
                acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, table, head_offset, stride_kb, stride_ks, tile_lo, full_lo,
                kv_lo, kv_hi, window, scale_log2e, d, d_ok, BLOCK_N, BLOCK_SIZE, True, False, DOT_PRECISION, True,
            )  # fmt: skip
        acc, m_i, l_i = attend_tiles(
            acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, table, head_offset, stride_kb, stride_ks, full_lo, full_hi,
            kv_lo, kv_hi, window, scale_log2e, d, d_ok, BLOCK_N, BLOCK_SIZE, True, False, DOT_PRECISION, False,
        )  # fmt: skip
        tile_lo = full_hi
    acc, m_i, l_i = attend_tiles(
        acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, table, head_offset, stride_kb, stride_ks, tile_lo,
        tl.cdiv(kv_hi, BLOCK_N), kv_lo, kv_hi, window, scale_log2e, d, d_ok, BLOCK_N, BLOCK_SIZE, True, HAS_WINDOW,
        DOT_PRECISION, True,
    )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _tile_shape(max_query_len: int, group: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): 128-row tiles when there are enough
    query rows to fill them, smaller for short chunks and decode rows; float32 tiles
    are kept smaller so that the pipelined K/V stages fit in shared memory."""
    wide = dtype == torch.float32 or head_dim > 128
    block_m = max(16, next_power_of_2(group), min(64 if wide else 128, next_power_of_2(max_query_len * group)))
    block_n = 32 if wide else 64
    num_warps = 8 if block_m >= 128 else 4
    # On an H200 the kernel alone, its K/V warm in L2, ran an 8k prompt faster with 4
    # warps and 4 stages (392 vs 315 TFLOP/s); inside the model, K/V cold after the
    # matmuls, 8 warps and 3 stages won (8k prompt 231.9 vs 238.6 ms, 1k 24.7 vs 26.0;
    # `bench-gpu --profile`, docs/perf/README.md).
    return block_m, block_n, num_warps, 2 if wide else 3


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    key_floor: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [num_tokens, heads, D] of all sequences back to back; query_start_loc
    [num_seqs + 1], seq_lens [num_seqs], block_tables [num_seqs, max_blocks] (int32/int64,
    device); max_query_len a host-side bound on the query lengths (only picks the tile
    shape). -> [num_tokens, heads, D] in query's dtype (into ``out`` if given).
    key_floor [num_seqs] (int32/int64, device) or None: sequence s attends only keys
    j >= key_floor[s] (a query with none left gets zeros); applied whenever given, so a
    caller passes it for sliding-window layers only (``attention.triton_attend``).
    sinks [heads] (float, device) or None: each head's sink logit joins its softmax with
    no value (GPT-OSS).
    block_m/block_n/num_warps/num_stages override the tile choice (for tuning sweeps)."""
    num_seqs, num_heads, num_kv_heads, head_dim = check_paged_inputs(
        query, kv_cache, seq_lens, block_tables, sliding_window
    )
    check_tensor(
        "query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES, device=query.device, shape=(num_seqs + 1,)
    )
    check_key_floor(key_floor, num_seqs, query.device)
    check_sinks(sinks, num_heads, query.device)
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be at least 1, got {max_query_len}")
    group = num_heads // num_kv_heads
    auto_m, auto_n, auto_warps, auto_stages = _tile_shape(max_query_len, group, head_dim, query.dtype)
    block_m = auto_m if block_m is None else block_m
    block_n = auto_n if block_n is None else block_n
    num_warps = auto_warps if num_warps is None else num_warps
    num_stages = auto_stages if num_stages is None else num_stages
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if block_m < group:
        raise ValueError(f"block_m={block_m} must hold the {group} query heads of a kv head")
    out = output_like(query, out)
    num_tokens = query.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_q = block_m // group
    k, v = kv_cache[0], kv_cache[1]
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    floor_arg = seq_lens if key_floor is None else key_floor  # unread without a floor
    _prefill_kernel[grid](
        query, k, v, out, query_start_loc, seq_lens, block_tables, floor_arg, query if sinks is None else sinks,
        num_seqs,
        query.stride(0), query.stride(1), k.stride(0), k.stride(1), k.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), scale * LOG2E, sliding_window or 0,
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_N=block_n, BLOCK_SIZE=kv_cache.shape[2], HAS_WINDOW=sliding_window is not None,
        HAS_FLOOR=key_floor is not None, HAS_SINKS=sinks is not None, DOT_PRECISION=dot_precision(query.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out
