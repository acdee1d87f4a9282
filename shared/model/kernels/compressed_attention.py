"""DeepSeek-V4's attention of query rows over their own keys, read in place from the paged
caches: each row's sliding window of K = V from its sequence's state cache, then the
compressed entries chosen for it (all causal ones for HCA, the indexer's top k for CSA),
with each head's sink in the softmax. The PyTorch path (shared/model/compressed_batch.py:
``window_keys``, the entry gather, ``attend_rows``) gathers every row's keys into
[rows, window + k, head_dim] first; this kernel reads them once per tile, never
materialised.

One program per (query row, BLOCK_H heads): V4 has one shared K = V head, so the row's
heads are one [BLOCK_H, D] operand against each [BLOCK_N, D] key tile, D the whole head
(512 in V4) in one dot. The window's keys are found from the row's position through the
block table (key j at slot table[j // block_size] * block_size + j % block_size of the
state plane); the entries through the row's list of compressed-cache rows and which of
them it sees (``picks``, ``visible``: what compressed_batch's entry_rows / top_k_entries
give), so CSA and HCA are one kernel. Online softmax in the log2 domain, started from the
sink (a key with no value, as paged_prefill does), accumulated in float32.

Reference: compressed_batch.attend_rows over the gathered keys (the model's CPU path).
"""

import torch
import triton
import triton.language as tl

from shared.model.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_device, check_tensor, next_power_of_2
from shared.model.kernels.paged_common import LOG2E, dot_precision, output_like

__all__ = ["compressed_attention"]


@triton.jit
def _fold(acc, m_i, l_i, q, base_ptr, rows, stride, d, d_ok, ok, scale_log2e, DOT_PRECISION: tl.constexpr):
    """One tile of keys (K = V), rows [BLOCK_N] of base_ptr (row stride ``stride``; keys where ok)
    into the running (acc, m_i, l_i) of q. The tile is read twice, [D, BLOCK_N] for the
    scores and [BLOCK_N, D] for the values, as paged_common's does (the second read hits
    the cache), not transposed in registers. m_i starts at the sink's logit, so it is
    never -inf: no guard against exp2(nan)."""
    k = tl.load(base_ptr + rows[None, :] * stride + d[:, None], mask=ok[None, :] & d_ok[:, None], other=0.0)
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2e
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(base_ptr + rows[:, None] * stride + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# Values that change from step to step are never specialised on (no recompiles while serving).
@triton.jit(do_not_specialize=["num_picks", "window", "stride_bt", "stride_pt", "stride_vt"])
def _compressed_attention_kernel(
    q_ptr,
    out_ptr,
    state_ptr,
    entries_ptr,
    tables_ptr,
    seq_ptr,
    pos_ptr,
    floor_ptr,
    picks_ptr,
    visible_ptr,
    sinks_ptr,
    num_picks,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_state,
    stride_entry,
    stride_bt,
    stride_pt,
    stride_vt,
    scale_log2e,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_FLOOR: tl.constexpr,
    HAS_ENTRIES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < NUM_HEADS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_mask = h_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    # The sink: one more key per head, no value; its logit in the log2 domain, weight 1.
    m_i = tl.load(sinks_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32) + 1.0

    # The window: keys lo .. pos (not before the sequence's floor, a replay's start, nor 0).
    seq = tl.load(seq_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int32)
    lo = tl.maximum(pos - window + 1, 0)
    if HAS_FLOOR:
        lo = tl.maximum(lo, tl.load(floor_ptr + row).to(tl.int32))
    table = tables_ptr + seq * stride_bt
    for start in range(lo, pos + 1, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        ok = j <= pos
        block = tl.load(table + j // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + (j % BLOCK_SIZE)
        acc, m_i, l_i = _fold(acc, m_i, l_i, q, state_ptr, slot, stride_state, d, d_ok, ok, scale_log2e, DOT_PRECISION)

    # The compressed entries chosen for the row: rows of the compressed cache, and which count.
    if HAS_ENTRIES:
        for start in range(0, num_picks, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            in_list = n < num_picks
            entry = tl.load(picks_ptr + row * stride_pt + n, mask=in_list, other=0).to(tl.int64)
            ok = tl.load(visible_ptr + row * stride_vt + n, mask=in_list, other=0) != 0
            acc, m_i, l_i = _fold(acc, m_i, l_i, q, entries_ptr, entry, stride_entry, d, d_ok, ok, scale_log2e,
                                  DOT_PRECISION)  # fmt: skip

    out = acc / l_i[:, None]
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=q_mask)  # fmt: skip


def _tile_shape(num_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages): 16 heads a program (a dot needs 16 rows;
    V4's 64 heads are 4 programs a row, reading the row's keys from L2 after the first);
    narrower key tiles for V4's 512-wide head, and for float32, so a tile fits in shared
    memory; 8 warps for a 512-wide head (its [16, 512] float32 accumulator is 64 registers
    a thread at 4). Not tuned on a GPU yet: the wrapper's arguments override each."""
    wide = dtype == torch.float32 or head_dim > 128
    return 16, 32 if wide else 64, 8 if head_dim > 128 else 4, 2


def compressed_attention(
    query: torch.Tensor,
    state: torch.Tensor,
    state_tables: torch.Tensor,
    seq: torch.Tensor,
    pos: torch.Tensor,
    floor: torch.Tensor | None,
    window: int,
    block_size: int,
    entries: torch.Tensor | None,
    picks: torch.Tensor | None,
    visible: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    *,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """query [T, heads, D] (one row per query token); state [slots, width >= D] the state
    caches' plane 0 (window K = V in its first D channels; rows of any stride); state_tables
    [seqs, max_blocks] the state group's block tables; seq, pos [T] (int) each row's
    sequence and position; floor [T] or None each row's first key position with KV (a
    replay's start); entries [rows, width >= D] the compressed cache (an entry in its first
    D channels) or None; picks, visible [T, K] each row's compressed-cache rows and which it
    sees (int, bool; None with entries None); sinks [heads] float; scale the softmax's.
    -> [T, heads, D] in query's dtype."""
    device = query.device
    check_device(device)
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    num_tokens, num_heads, head_dim = query.shape
    if head_dim < 16:
        raise ValueError(f"head_dim must be at least 16 for the kernel's matrix products, got {head_dim}")
    check_tensor("state", state, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    if state.shape[1] < head_dim:
        raise ValueError(f"state rows are {state.shape[1]} wide, fewer than the head's {head_dim}")
    check_tensor("state_tables", state_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    for name, t in (("seq", seq), ("pos", pos)) + ((("floor", floor),) if floor is not None else ()):
        check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES, device=device, shape=(num_tokens,))
    check_tensor("sinks", sinks, ndim=1, dtypes=FLOAT_DTYPES, device=device, shape=(num_heads,))
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    if (entries is None) != (picks is None) or (picks is None) != (visible is None):
        raise ValueError("entries, picks and visible go together: all three or none")
    num_picks = 0
    if entries is not None and picks is not None and visible is not None:
        check_tensor("entries", entries, ndim=2, dtypes=FLOAT_DTYPES, device=device)
        if entries.shape[1] < head_dim:
            raise ValueError(f"entries are {entries.shape[1]} wide, fewer than the head's {head_dim}")
        check_tensor("picks", picks, ndim=2, dtypes=INDEX_DTYPES, device=device, shape=(num_tokens, None))
        check_tensor("visible", visible, ndim=2, dtypes=(torch.bool,), device=device, shape=picks.shape)
        num_picks = picks.shape[1]
    auto_h, auto_n, auto_warps, auto_stages = _tile_shape(num_heads, head_dim, query.dtype)
    block_h = auto_h if block_h is None else block_h
    block_n = auto_n if block_n is None else block_n
    for name, value in (("block_h", block_h), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    out = output_like(query, None)
    if num_tokens == 0:
        return out
    has_entries = num_picks > 0
    picks_arg = picks if has_entries else seq[:, None]  # unread without entries
    visible_arg = visible.view(torch.uint8) if has_entries else seq[:, None]  # type: ignore[union-attr]
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _compressed_attention_kernel[grid](
        query, out, state, entries if has_entries else state, state_tables, seq, pos, pos if floor is None else floor,
        picks_arg, visible_arg, sinks,
        num_picks, window,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), state.stride(0),
        entries.stride(0) if has_entries else 0, state_tables.stride(0),  # type: ignore[union-attr]
        picks_arg.stride(0), visible_arg.stride(0), scale * LOG2E,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, HAS_FLOOR=floor is not None, HAS_ENTRIES=has_entries,
        DOT_PRECISION=dot_precision(query.dtype),
        num_warps=auto_warps if num_warps is None else num_warps,
        num_stages=auto_stages if num_stages is None else num_stages,
    )  # fmt: skip
    return out
