"""The PyTorch references of the Triton kernels. Each is the model's own CPU path
(``layers``, ``attention``), so a kernel that matches its reference matches the
model that already matches transformers."""

import torch

from shared.model.attention import attend, plan_attention
from shared.model.forward_batch import AttentionMetadata
from shared.model.layers import apply_rope, rms_norm, silu_and_mul


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return rms_norm(x, weight, eps), x


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def silu_and_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(gate, up)


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    sliding_window: int | None,
    scale: float,
    key_floor: list[int] | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen attention of query [T, heads, D] over the paged cache (decode is the case
    of one query per sequence): ``plan_attention`` + ``attend``, the CPU path.

    key_floor (per sequence, or None) drops keys j < key_floor[s] from the mask, window
    or not, as the kernels do when given one; a query left with no key gets zeros.
    sinks [heads] or None: each head's sink logit in its softmax (GPT-OSS)."""
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=query.device),
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_size=kv_cache.shape[2],
    )
    plan = plan_attention(meta, [sliding_window], query.device)
    if key_floor is None:
        return attend(query, kv_cache, plan, sliding_window, scale, sinks)
    j = torch.arange(plan.max_kv, device=query.device)
    floor = torch.tensor(key_floor, device=query.device)
    mask = plan.masks[sliding_window] & (j[None, :] >= floor[:, None])[:, None, None, :]  # [S, 1, max_q, max_kv]
    # Rows left without a key (padding rows, queries below their floor) see key 0, so the
    # softmax has no empty row (NaN); their output is replaced by zeros below.
    empty = ~mask.any(-1, keepdim=True)
    plan.masks[sliding_window] = mask | (empty & (j == 0))
    out = attend(query, kv_cache, plan, sliding_window, scale, sinks)
    no_key = empty.reshape(-1)[plan.token_rows]  # [T]
    return torch.where(no_key[:, None, None], torch.zeros_like(out), out)
