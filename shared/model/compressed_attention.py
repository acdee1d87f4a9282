"""DeepSeek-V4's attention over a paged cache, in plain PyTorch (the CPU path and the
reference a kernel will be checked against).

Every V4 layer attends with one shared K = V head (512 wide) to a sliding window of
its raw tokens; CSA and HCA layers also attend to compressed entries, one per m raw
tokens (m = 4 for CSA, with overlapping windows; 128 for HCA), and a CSA query sees
only the entries its lightning indexer ranks in the top k. What a layer keeps per
request lives in two caches of the engine's block pool (shared/kv/spec.py):

- the layer's *state* cache (a sliding-window group, never persisted), per raw token
  ``plane 0 = [window K=V | compressor kv | indexer kv]`` and
  ``plane 1 = [compressor gate | indexer gate]``: the window, and the projections of
  the tokens whose compression window is not closed yet (the "uncompressed tail");
- the layer's *compressed* cache (a CompressedSpec group, persisted), an entry sitting
  in the block of its window's last raw token, plane 0: ``[entry | indexer key]``
  (a block of block_size raw tokens holds block_size / m entries, or for m larger
  than the block one entry every m / block_size blocks).

Both are ``[1, blocks, rows, 1, width]`` tensors, the shape every engine cache has with
one plane, each of its own width (a state row holds plane 0 then plane 1) and rows per
block (a state block block_size, a compressed block its entries: ``entries_per_block``), so
the block pool, the state cache, the KV connectors and peers move V4 blocks like any
other; caches of different widths take their blocks from different size classes of
the pool (shared/kv/spec.py), so none is padded to the widest row.

A compressed entry is emitted by the step that computes the last token of its window,
from the window's rows in the state cache (so chunked prefill may split windows
anywhere), and written to the compressed cache unless that step is a replay of
positions whose entries are cached already (the runner then points their slots at
the null block).
"""

from dataclasses import dataclass

import torch

from shared.kv.spec import entries_per_block
from shared.model.forward_batch import AttentionMetadata


@dataclass(frozen=True, slots=True)
class StateRow:
    """Where a layer's per-token state sits in a state cache row (plane 0 / plane 1)."""

    head_dim: int
    compress_width: int
    """Channels of the compressor's kv (and of its gate): 2 * head_dim for CSA (two
    overlapping series), head_dim for HCA, 0 for a sliding-only layer."""
    index_width: int
    """Channels of the indexer's kv (and gate): 2 * index_head_dim for CSA, else 0."""

    @property
    def plane0(self) -> int:
        return self.head_dim + self.compress_width + self.index_width

    @property
    def plane1(self) -> int:
        return self.compress_width + self.index_width


def slots_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slots of raw-token positions (any shape) of one sequence's block table."""
    return block_table[positions // block_size] * block_size + positions % block_size


def entry_slots(block_table: torch.Tensor, entries: torch.Tensor, rate: int, block_size: int) -> torch.Tensor:
    """Flat rows of compressed entries: entry e (raw tokens e*m .. (e+1)*m - 1) sits in the
    block of its last raw token p, at row (p mod block_size) / m of the block's
    entries_per_block rows (block_size a multiple of m: block_size / m entries per block;
    or m a multiple of block_size: one entry in every (m / block_size)-th block)."""
    return last_token_slot_row(block_table[((entries + 1) * rate - 1) // block_size], (entries + 1) * rate - 1, rate, block_size)


def last_token_slot_row(blocks: torch.Tensor, last: torch.Tensor, rate: int, block_size: int) -> torch.Tensor:
    """The flat row of the compressed cache [blocks * entries_per_block, width] of the
    entries whose last raw tokens are ``last``, in ``blocks``."""
    return blocks * entries_per_block(rate, block_size) + (last % block_size) // rate


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V4's rope on the trailing 2 * cos.shape[-1] channels of x [T, ..., D], channel
    pairs (2i, 2i+1) rotated together, in float32; cos/sin [T, rope_dim / 2]."""
    rope_dim = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim,)
    # Each angle twice, by expand (repeat_interleave may size its output on the host: a
    # CUDA graph could not capture it).
    cos = cos.unsqueeze(-1).expand(*cos.shape, 2).reshape(shape)
    sin = sin.unsqueeze(-1).expand(*sin.shape, 2).reshape(shape)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated_half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + rotated_half.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def compress_windows(
    kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, head_dim: int, overlap: bool
) -> torch.Tensor:
    """One entry per window from its raw rows: kv, gate [E, rows, width] (gate without
    the position bias). HCA (overlap False): rows = m, width = head_dim. CSA: rows = 2m,
    width = 2 * head_dim; rows [0, m) are the previous window (its first half of
    channels, "Ca", counts), rows [m, 2m) this window (its second half, "Cb"); a first
    window has no previous one: give its gate -inf there. -> [E, head_dim] before the
    norm: the softmax over rows of gate + bias weighs kv, channel by channel."""
    if not overlap:
        weights = (gate + position_bias).softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return (kv * weights).sum(dim=1)
    m = position_bias.shape[0]
    gate = gate.float() + torch.cat([position_bias, position_bias])  # [E, 2m, 2D] + [2m, 2D]
    kv = torch.cat([kv[:, :m, :head_dim], kv[:, m:, head_dim:]], dim=1)
    gate = torch.cat([gate[:, :m, :head_dim], gate[:, m:, head_dim:]], dim=1)
    weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    return (kv * weights).sum(dim=1)


@dataclass(slots=True)
class SequenceView:
    """One sequence of the batch, as the attention needs it."""

    rows: slice
    """Its query rows in the flat batch."""
    start: int
    """Position of its first query."""
    end: int
    """Its KV length after the step."""
    floor: int
    """The first position whose window KV exists (a replay's start), else 0."""
    state_table: torch.Tensor
    compressed_table: torch.Tensor | None


def sequences(meta: AttentionMetadata, compressed: AttentionMetadata | None) -> list[SequenceView]:
    q = meta.query_start_loc
    floors = meta.key_floor or [0] * meta.num_seqs
    return [
        SequenceView(
            slice(q[s], q[s + 1]),
            meta.seq_lens[s] - (q[s + 1] - q[s]),
            meta.seq_lens[s],
            floors[s],
            meta.block_tables[s],
            None if compressed is None else compressed.block_tables[s],
        )
        for s in range(meta.num_seqs)
    ]


def attend(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    compressed_kv: torch.Tensor | None,
    compressed_visible: torch.Tensor | None,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    window: int,
    floor: int,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """One sequence's queries q [n, heads, D] over its window keys window_kv [k, D] (at
    key_pos) and compressed entries [e, D] visible where compressed_visible [n, e]:
    scaled dot products and the head's sink in one softmax, K = V, as transformers'
    V4 eager attention. -> [n, heads, D]."""
    keys = window_kv if compressed_kv is None else torch.cat([window_kv, compressed_kv])
    scores = torch.einsum("nhd,kd->nhk", q, keys.to(q.dtype)) * scale
    distance = query_pos[:, None] - key_pos[None, :]
    visible = (distance >= 0) & (distance < window) & (key_pos >= floor)[None, :]
    if compressed_visible is not None:
        visible = torch.cat([visible, compressed_visible], dim=1)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    n, heads, _ = scores.shape
    combined = torch.cat([scores, sinks.to(scores.dtype).view(1, heads, 1).expand(n, heads, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.einsum("nhk,kd->nhd", probs.to(keys.dtype), keys.to(q.dtype))


def index_top_k(
    scores: torch.Tensor, valid: torch.Tensor, top_k: int
) -> torch.Tensor:
    """The lightning indexer's choice: scores [n, e] over the entries, valid [n, e] the
    causal ones -> [n, e] bool, the top_k valid entries of each query (all of them
    when it has fewer), as transformers picks them."""
    num_entries = scores.shape[1]
    k = min(top_k, num_entries)
    chosen = torch.zeros_like(valid)
    if k == 0:
        return chosen
    top = scores.masked_fill(~valid, float("-inf")).topk(k, dim=-1).indices
    chosen.scatter_(1, top, True)
    return chosen & valid
