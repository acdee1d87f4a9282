"""DeepSeek-V4's compressed attention for a whole batch at once, in PyTorch: every query
row of the flat batch gathers its own keys (its sliding window, and its compressed
entries: all causal ones for HCA, the indexer's top k for CSA) from the paged caches
through its sequence's block table, and one batched softmax with the sinks does the rest.

No Python loop over sequences and nothing read back from the device: the sizes are the
window, the top k and a bound on the number of entries (``max_len // rate``, from the
host lists of the step, or in a CUDA graph from the capture's ``max_model_len``). The
per-sequence code in compressed_attention.py (``attend``, ``index_top_k``) is the
reference this one is tested against; the cache layout is described there.

A query row sees the same keys as in the reference: window keys at [pos - W + 1, pos],
not before the sequence's floor (a replay's start) nor 0; entries e with
(e + 1) * rate <= pos + 1; for CSA only the top_k of those by the indexer's scores (a
fixed k = min(top_k, entries): rows with fewer causal entries get invalid picks, masked).
"""

from dataclasses import dataclass

import torch

from shared.model.compressed_attention import last_token_slot_row
from shared.model.forward_batch import AttentionMetadata

GATHER_BUDGET = 1 << 27
"""Elements of the largest per-row gather (keys [rows, keys, width], indexer scores [rows,
heads, entries]) built at once: long prefills are cut into row chunks under it (a decode
batch is one chunk), so an 8k prompt never materialises [8192, 2048, 512] keys."""


@dataclass(frozen=True, slots=True)
class TokenRows:
    """Per query row of the flat batch, on the device: what its gathers need."""

    seq: torch.Tensor
    """[T] int64: the row's sequence (its block tables' row)."""
    pos: torch.Tensor
    """[T] int64: the row's position."""
    floor: torch.Tensor | None
    """[T] int64: the first position whose window KV exists (a replay's start); None: 0."""
    max_len: int
    """A host bound on every sequence's KV length after the step (sizes the entry gathers)."""

    def rows(self, lo: int, hi: int) -> "TokenRows":
        floor = None if self.floor is None else self.floor[lo:hi]
        return TokenRows(self.seq[lo:hi], self.pos[lo:hi], floor, self.max_len)


def token_rows(meta: AttentionMetadata, positions: torch.Tensor) -> TokenRows:
    """The rows of a step from its metadata: sequence of each row from the device's
    query_start_loc (searchsorted, no host read), else from the host lists."""
    device, num = positions.device, positions.shape[0]
    if meta.query_start_loc_tensor is not None:
        ends = meta.query_start_loc_tensor[1:].to(torch.int64)
        seq = torch.searchsorted(ends, torch.arange(num, device=device), right=True)
    else:
        seq = torch.repeat_interleave(torch.arange(meta.num_seqs), torch.tensor(meta.query_lens)).to(device)
    floor = None
    if meta.key_floor_tensor is not None:
        floor = meta.key_floor_tensor.to(torch.int64)[seq]
    elif meta.key_floor is not None and any(meta.key_floor):
        floor = torch.tensor(meta.key_floor, dtype=torch.int64, device=device)[seq]
    return TokenRows(seq, positions.to(torch.int64), floor, max(meta.seq_lens, default=0))


def row_chunks(num_rows: int, per_row: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges whose gathers of per_row elements each stay under GATHER_BUDGET."""
    step = max(1, GATHER_BUDGET // max(per_row, 1))
    return [(lo, min(lo + step, num_rows)) for lo in range(0, num_rows, step)]


def window_keys(
    plane0: torch.Tensor, tables: torch.Tensor, rows: TokenRows, window: int, block_size: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's sliding window of K = V from the state plane [slots, width]:
    -> keys [T, window, head_dim], visible [T, window]."""
    key_pos = rows.pos[:, None] + torch.arange(1 - window, 1, device=rows.pos.device)[None, :]
    visible = key_pos >= 0
    if rows.floor is not None:
        visible &= key_pos >= rows.floor[:, None]
    key_pos = key_pos.clamp(min=0)
    blocks = tables[rows.seq[:, None], key_pos // block_size]
    return plane0[blocks * block_size + key_pos % block_size, :head_dim], visible


def entry_rows(tables: torch.Tensor, rows: TokenRows, rate: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat compressed-cache rows of entries 0 .. max_len // rate - 1 of each row's
    sequence, and which of them the row may see (closed at or before its position):
    -> rows [T, E], causal [T, E]. Entry e sits in the block of its last raw token
    (compressed_attention.entry_slots)."""
    num_entries = rows.max_len // rate
    ids = torch.arange(num_entries, device=rows.pos.device)
    last = (ids + 1) * rate - 1
    col = (last // block_size).clamp(max=tables.shape[1] - 1)
    flat = last_token_slot_row(tables[rows.seq[:, None], col[None, :]], last[None, :], rate, block_size)
    causal = ids[None, :] < ((rows.pos + 1) // rate)[:, None]
    return flat, causal


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The lightning indexer's scores sum_h w_h * relu(q_h . k) / sqrt(d), per row over its
    own entries: q [T, heads, d], weights [T, heads] (already scaled), keys [T, E, d] -> [T, E]."""
    dots = torch.relu(torch.bmm(q.float(), keys.float().transpose(1, 2))) * head_dim**-0.5
    return (dots * weights.float()[..., None]).sum(dim=1)


def top_k_entries(scores: torch.Tensor, causal: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's pick at a fixed k = min(top_k, E): -> the chosen columns [T, k] and
    which are real choices [T, k] (a row with fewer than k causal entries picks them all,
    and the rest of its k are masked)."""
    k = min(top_k, scores.shape[1])
    picked = scores.masked_fill(~causal, float("-inf")).topk(k, dim=-1).indices
    return picked, causal.gather(1, picked)


def attend_rows(
    q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """Queries q [T, heads, D] over their own keys [T, K, D] (K = V), visible [T, K], with
    each head's sink in the softmax: the reference ``attend``'s arithmetic, row by row."""
    keys = keys.to(q.dtype)
    scores = torch.bmm(q, keys.transpose(1, 2)) * scale  # [T, heads, K]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    n, heads, _ = scores.shape
    combined = torch.cat([scores, sinks.to(scores.dtype).view(1, heads, 1).expand(n, heads, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.bmm(probs.to(keys.dtype), keys)


def closing_rows(
    positions: torch.Tensor, meta: AttentionMetadata, rate: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows whose token closes a compression window (its entry is emitted this step),
    without reading the device: -> (row ids [N], live [N] or None).

    Eager, the host lists give N exactly (each sequence closes end // rate - start // rate
    windows) and a stable sort puts the closing rows first: live is None. In a CUDA graph
    (``meta.scratch_slot`` set) the lists are capture-time bounds: every row is a candidate
    (N = T) and live says which close; the others write to the scratch slot."""
    closes = (positions + 1) % rate == 0
    if meta.scratch_slot is not None:
        return torch.arange(positions.shape[0], device=positions.device), closes
    q = meta.query_start_loc
    count = sum(end // rate - (end - (q[s + 1] - q[s])) // rate for s, end in enumerate(meta.seq_lens))
    order = torch.sort((~closes).to(torch.int8), stable=True).indices
    return order[:count], None
