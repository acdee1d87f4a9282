"""Batch-invariant paged attention: every query token of a step (decode tokens, prompt
chunks, a whole prompt) through one kernel with one tile shape, so a token's output
is the same bits alone, in any batch, and with its prompt chunked any way.

Why the normal Triton path is not (``kernels/attention.py``): decode steps take the
decode kernel, which splits a sequence's keys over a number of programs chosen from
the batch and merges the parts in a second kernel, while the same token inside a
mixed step takes the prefill kernel, which reduces the keys in one pass; the prefill
kernel's query tile (BLOCK_M) and warps follow the step's longest query; and it runs
the tiles below a query tile's first query without masks but the others with masks,
so which code path a key goes through depends on where the chunk starts (the two
paths may contract the scale multiply into the exponent's subtraction differently).

Here: one program per (tile of BLOCK_Q query tokens x the GROUP heads of a kv head),
BLOCK_M and BLOCK_N fixed by the model (dtype, head size, group), no split of the
keys, and every tile through the masked path (``paged_common.attend_tiles`` with
MASKED=True). A query row folds the KV tiles 0, 1, 2, ... (each BLOCK_N keys at
absolute positions, the same tiles whatever its chunk) into its running max, sum
and accumulator; a tile it may not see at all (past its position, below its window,
fetched only because another row of its tile needs it) leaves them exactly as they
were (weight exp2(-inf) = 0, rescale exp2(0) = 1), and a masked key inside a tile
adds an exact zero. So a row's arithmetic is a function of its own keys only.

The key floor (``key_floor``, sliding-window layers after a prefix hit) is passed for
every sliding-window layer, zeros where there is none, so the compiled variant is
the layer's, not the batch's (the normal plan drops an all-zero floor).

Reference: ``reference.paged_attention_ref`` (the model's CPU path).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.model.forward_batch import AttentionMetadata
from shared.model.kernels.attention import sequence_tensors
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
from shared.model.kernels.paged_prefill import _find_seq

__all__ = ["InvariantAttentionPlan", "invariant_attention", "invariant_tile", "plan_triton_attention", "triton_attend"]


# Values that change from step to step are never specialised on (one compiled variant per layer kind).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "window"])
def _invariant_attention_kernel(
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
    # The tile layout and sequence search of the prefill kernel (paged_prefill.py); the
    # longest tiles first, so short ones fill the last wave.
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

    # The key range of the tile's rows together; each row's own keys are masked key by key.
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
    acc, m_i, l_i = attend_tiles(
        acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, tables_ptr + seq.to(tl.int64) * stride_bt,
        kv_head.to(tl.int64) * stride_kh, stride_kb, stride_ks, kv_lo // BLOCK_N, tl.cdiv(kv_hi, BLOCK_N),
        kv_lo, kv_hi, window, scale_log2e, d, d_ok, BLOCK_N, BLOCK_SIZE, True, HAS_WINDOW, DOT_PRECISION, True,
    )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def invariant_tile(group: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a model: from its group size, head
    size and dtype only, never from a step. 64 query rows is the middle ground between
    a long prefill (which would like 128) and decode rows (one token x GROUP heads of a
    tile used); float32 and wide heads keep smaller tiles so K/V stages fit in shared
    memory, as the prefill kernel's choice does."""
    wide = dtype == torch.float32 or head_dim > 128
    block_m = max(16, next_power_of_2(group), 32 if wide else 64)
    return block_m, 32 if wide else 64, 4, 2 if wide else 3


def invariant_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    key_floor: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """As ``paged_prefill.paged_prefill_attention`` (same arguments, less max_query_len
    and the tile overrides), for decode and prefill tokens alike: query [num_tokens,
    heads, D], query_start_loc [num_seqs + 1], seq_lens [num_seqs], block_tables
    [num_seqs, max_blocks] -> [num_tokens, heads, D]. key_floor [num_seqs] or None:
    pass it (zeros where none) for every sliding-window call, so the compiled variant
    does not depend on whether this step has a floor."""
    num_seqs, num_heads, num_kv_heads, head_dim = check_paged_inputs(
        query, kv_cache, seq_lens, block_tables, sliding_window
    )
    check_tensor(
        "query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES, device=query.device, shape=(num_seqs + 1,)
    )
    check_key_floor(key_floor, num_seqs, query.device)
    check_sinks(sinks, num_heads, query.device)
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = invariant_tile(group, head_dim, query.dtype)
    out = output_like(query, out)
    num_tokens = query.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_q = block_m // group
    k, v = kv_cache[0], kv_cache[1]
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    floor_arg = seq_lens if key_floor is None else key_floor  # unread without a floor
    _invariant_attention_kernel[grid](
        query, k, v, out, query_start_loc, seq_lens, block_tables, floor_arg, query if sinks is None else sinks,
        num_seqs,
        query.stride(0), query.stride(1), k.stride(0), k.stride(1), k.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), scale * LOG2E, sliding_window or 0,
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_N=block_n, BLOCK_SIZE=kv_cache.shape[2], HAS_WINDOW=sliding_window is not None,
        HAS_FLOOR=key_floor is not None, HAS_SINKS=sinks is not None, DOT_PRECISION=dot_precision(query.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


@dataclass(slots=True)
class InvariantAttentionPlan:
    """One KV group's batch as device index tensors, built once per forward."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    key_floor: torch.Tensor  # [num_seqs] int32, zeros where a sequence has none


def plan_triton_attention(
    meta: AttentionMetadata, num_kv_heads: int, head_dim: int, device: torch.device
) -> InvariantAttentionPlan:
    """As ``kernels.attention.plan_triton_attention`` (the runner's device tensors where it
    built them, else from the lists), but with no choice made from the batch, and a key
    floor always (zeros when the metadata has none), for the sliding-window layers."""
    del num_kv_heads, head_dim  # nothing is chosen from them per step
    query_start_loc, seq_lens, key_floor = sequence_tensors(meta, device)
    if key_floor is None:
        # A fill, not a copy from the host: this also runs while a CUDA graph is captured.
        key_floor = torch.zeros(len(meta.seq_lens), dtype=torch.int32, device=device)
    return InvariantAttentionPlan(query_start_loc, seq_lens, meta.block_tables.to(device), key_floor)


def triton_attend(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: InvariantAttentionPlan,
    sliding_window: int | None,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """As ``kernels.attention.triton_attend``: the floor applies to sliding-window layers only."""
    key_floor = plan.key_floor if sliding_window is not None else None
    return invariant_attention(
        query, kv_cache, plan.query_start_loc, plan.seq_lens, plan.block_tables, scale, sliding_window, key_floor, sinks
    )
