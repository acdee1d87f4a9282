"""The Triton path of ``attention.attend``: the per-forward plan (device index tensors,
built once and shared by all layers) and the choice of kernel: the decode kernel when
every sequence brings one token, the prefill kernel otherwise. The new K/V reach the
cache before, with the rotary kernel (``rotary.rotary_embedding_and_store_kv``).

A per-sequence key floor (``AttentionMetadata.key_floor``: after a prefix hit, the
sliding-window KV exists only from the replay's start on) goes to the kernels for
sliding-window layers only; full-attention layers have every cached key."""

from dataclasses import dataclass

import torch

from shared.model.forward_batch import AttentionMetadata
from shared.model.kernels.paged_decode import choose_num_splits, default_block_n, paged_decode_attention
from shared.model.kernels.paged_prefill import paged_prefill_attention


@dataclass(slots=True)
class TritonAttentionPlan:
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32/int64
    max_query_len: int
    is_decode: bool  # one query token per sequence: the decode kernel
    num_splits: int  # decode: splits per sequence
    key_floor: torch.Tensor | None = None  # [num_seqs] int32: sliding-window layers' first key; None: 0


def sequence_tensors(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """query_start_loc, seq_lens and the key floor on the device: the metadata's own
    tensors where the runner built them, else made from its lists (a floor of zeros
    only is None: the kernels' path without one)."""
    query_start_loc = meta.query_start_loc_tensor
    if query_start_loc is None:
        query_start_loc = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=device)
    seq_lens = meta.seq_lens_tensor
    if seq_lens is None:
        seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32, device=device)
    key_floor = meta.key_floor_tensor
    if key_floor is None and meta.key_floor is not None and any(f > 0 for f in meta.key_floor):
        key_floor = torch.tensor(meta.key_floor, dtype=torch.int32, device=device)
    return query_start_loc, seq_lens, key_floor


def plan_triton_attention(
    meta: AttentionMetadata, num_kv_heads: int, head_dim: int, device: torch.device
) -> TritonAttentionPlan:
    """Takes the metadata's device tensors where the runner built them, else makes them
    from its lists. Host facts used (max query length, longest sequence) come from the
    lists; for a captured graph they only set static choices (kernel, splits). A key
    floor given only as a list of zeros is left out (the kernels' path without one)."""
    query_start_loc, seq_lens, key_floor = sequence_tensors(meta, device)
    max_query_len = max(meta.query_lens)
    is_decode = max_query_len == 1 and meta.query_start_loc[-1] == meta.num_seqs
    num_splits = 1
    if is_decode:
        block_n = default_block_n(head_dim)
        num_splits = choose_num_splits(meta.num_seqs, num_kv_heads, max(meta.seq_lens), block_n, device)
    block_tables = meta.block_tables.to(device)
    return TritonAttentionPlan(
        query_start_loc, seq_lens, block_tables, max_query_len, is_decode, num_splits, key_floor
    )


def triton_attend(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: TritonAttentionPlan,
    sliding_window: int | None,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """As ``attention.attend``: query [T, heads, D] over the cache, the new K/V already in it.
    The plan's key floor applies to sliding-window layers only; sinks [heads] or None."""
    key_floor = plan.key_floor if sliding_window is not None else None
    if plan.is_decode:
        return paged_decode_attention(
            query, kv_cache, plan.seq_lens, plan.block_tables, scale, sliding_window, plan.num_splits, key_floor, sinks
        )
    return paged_prefill_attention(
        query, kv_cache, plan.query_start_loc, plan.seq_lens, plan.block_tables, plan.max_query_len, scale,
        sliding_window, key_floor, sinks,
    )  # fmt: skip
