"""Attention over the paged KV cache in plain PyTorch: the reference that a Triton
kernel will be checked against, and the CPU path.

A varlen batch is padded to ``[num_seqs, max_query_len]`` queries against
``[num_seqs, max_kv_len]`` keys gathered through the block tables, with a boolean
mask that is causal (query at position p sees keys 0..p) and, for sliding-window
layers, also drops keys j with p - j >= W (transformers' ``kv_idx > q_idx - W``).
The index tensors and masks depend only on the batch, so they are built once per
forward (``AttentionPlan``) and shared by all layers.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.model.forward_batch import AttentionMetadata


@dataclass(slots=True)
class AttentionPlan:
    query_index: torch.Tensor  # [num_seqs, max_q] row of each padded query in the flat [T] batch (0 for padding)
    token_rows: torch.Tensor  # [T] row of each real token in the padded [num_seqs * max_q] output
    kv_blocks: torch.Tensor  # [num_seqs, ceil(max_kv / block_size)] the blocks holding each sequence's keys
    max_kv: int
    masks: dict[int | None, torch.Tensor]  # window (None = full) -> [num_seqs, 1, max_q, max_kv] bool


def plan_attention(meta: AttentionMetadata, windows: Iterable[int | None], device: torch.device) -> AttentionPlan:
    """Index tensors and one mask per distinct sliding window for this batch."""
    query_lens = meta.query_lens
    num_tokens = meta.query_start_loc[-1]
    max_q, max_kv = max(query_lens), max(meta.seq_lens)
    if any(q > s for q, s in zip(query_lens, meta.seq_lens)):
        raise ValueError(f"a query is longer than its sequence: query_lens={query_lens}, seq_lens={meta.seq_lens}")
    if meta.block_tables.shape[1] * meta.block_size < max_kv:
        raise ValueError(
            f"block_tables has {meta.block_tables.shape[1]} columns of {meta.block_size} tokens, "
            f"too few for a sequence of {max_kv} tokens"
        )
    q_lens = torch.tensor(query_lens, device=device)
    seq_lens = torch.tensor(meta.seq_lens, device=device)
    starts = torch.tensor(meta.query_start_loc[:-1], device=device)
    i = torch.arange(max_q, device=device)
    valid = i[None, :] < q_lens[:, None]  # [S, max_q]
    query_index = torch.where(valid, starts[:, None] + i[None, :], 0)
    # Token t of sequence s (t-th overall) sits at padded row s * max_q + (t - start_s);
    # repeat_interleave with output_size avoids a device sync that nonzero() would need.
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens), device=device), q_lens, output_size=num_tokens)
    token_rows = seq_of_token * max_q + torch.arange(num_tokens, device=device) - starts[seq_of_token]

    j = torch.arange(max_kv, device=device)
    # Keys are gathered a whole block at a time (block_size contiguous rows), not a slot at a time.
    kv_blocks = meta.block_tables.to(device)[:, : -(-max_kv // meta.block_size)]

    q_pos = (seq_lens - q_lens)[:, None] + i[None, :]  # [S, max_q]
    distance = q_pos[:, :, None] - j[None, None, :]  # p - j, [S, max_q, max_kv]
    causal = distance >= 0  # also keeps j < seq_len, since p < seq_len for real queries
    # Padded query rows see key 0 only, so softmax has no empty row (NaN); their output is dropped.
    padding_row = (~valid)[:, :, None] & (j == 0)[None, None, :]
    # Sliding windows only: no key before the sequence's floor (an SWA replay's start).
    above_floor = None
    if meta.key_floor is not None and any(meta.key_floor):
        floor = torch.tensor(meta.key_floor, device=device)
        above_floor = (j[None, :] >= floor[:, None])[:, None, :]  # [S, 1, max_kv]
    masks: dict[int | None, torch.Tensor] = {}
    for window in set(windows):
        allowed = causal if window is None else causal & (distance < window)
        if window is not None and above_floor is not None:
            allowed = allowed & above_floor
        masks[window] = (allowed | padding_row)[:, None]
    return AttentionPlan(query_index=query_index, token_rows=token_rows, kv_blocks=kv_blocks, max_kv=max_kv, masks=masks)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, kv_heads, head_dim] at their flat slots of one layer's cache."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    plan: AttentionPlan,
    sliding_window: int | None,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, heads, head_dim], new key/value [T, kv_heads, head_dim] -> output [T, heads, head_dim].

    Writes the new K/V into ``kv_cache`` first, then each sequence's queries attend to
    all its cached keys (the new ones included). GQA/MQA: heads share kv heads in
    contiguous groups, as transformers' ``repeat_kv``.
    """
    write_kv(kv_cache, key, value, meta.slot_mapping)
    return attend(query, kv_cache, plan, sliding_window, scale, sinks)


def attend(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: AttentionPlan,
    sliding_window: int | None,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention of ``paged_attention`` once the new K/V are in the cache: query
    [T, heads, head_dim] -> [T, heads, head_dim]. The Triton kernels' reference.

    sinks [heads] (GPT-OSS): one more logit per head in every softmax, with no value:
    it takes its share of the weight and gives nothing back."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    num_seqs, max_q = plan.query_index.shape
    num_blocks = plan.kv_blocks.shape[1]
    kv_len = num_blocks * kv_cache.shape[2]
    # [S, blocks, block_size, kvh, D] -> [S, kvh, max_kv, D]
    k = kv_cache[0][plan.kv_blocks].view(num_seqs, kv_len, num_kv_heads, head_dim)[:, : plan.max_kv].transpose(1, 2)
    v = kv_cache[1][plan.kv_blocks].view(num_seqs, kv_len, num_kv_heads, head_dim)[:, : plan.max_kv].transpose(1, 2)
    q = query[plan.query_index].transpose(1, 2)  # [S, heads, max_q, D]
    if sinks is not None:
        out = _attend_with_sinks(q, k.to(q.dtype), v.to(q.dtype), plan.masks[sliding_window], scale, sinks)
        return out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)[plan.token_rows]
    out = F.scaled_dot_product_attention(
        q,
        k.to(q.dtype),
        v.to(q.dtype),
        attn_mask=plan.masks[sliding_window],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    return out[plan.token_rows]


def _attend_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """q [S, heads, max_q, D], k/v [S, kv_heads, max_kv, D], mask [S, 1, max_q, max_kv] ->
    [S, heads, max_q, D]: scaled dot products and the head's sink logit in one softmax,
    in the order of transformers' GPT-OSS eager attention (SDPA has no sink)."""
    num_seqs, num_heads, max_q, _ = q.shape
    group = num_heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, num_heads, 1, 1).expand(num_seqs, num_heads, max_q, 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
