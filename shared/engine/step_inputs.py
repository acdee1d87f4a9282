"""A step's inputs: the scheduler's plain lists as the forward's inputs, and onto
the device without waiting for the device.

``eager_inputs`` builds the eager forward's tensors (input ids, positions, one
AttentionMetadata per KV cache group) and ``graph_rows`` the rows a decode graph
replays; each also says which rows of the hidden states sample, for which request.

``torch.tensor(values, device="cuda")`` copies from pageable memory, and such a
copy is ordered after every kernel already queued: the host blocks until the
device has finished them. In an overlapped step loop that is exactly the gap the
overlap exists to hide, so every list the engine sends to the device per step
goes through pinned memory (PyTorch's caching host allocator: no allocation
once warm, and a block is not reused before its copy has run) and an
asynchronous copy.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shared.engine.prompt_images import ImageRows, PromptImages
from shared.engine.step import PLACEHOLDER, ScheduledChunk, SchedulerOutput
from shared.model.forward_batch import AttentionMetadata


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a list, or a list of equal-length lists) as a ``dtype`` tensor on
    ``device``; returns at once on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def fill_placeholders(input_ids: torch.Tensor, sources: torch.Tensor, last_tokens: torch.Tensor) -> torch.Tensor:
    """input_ids with each row i whose ``sources[i] >= 0`` replaced by
    ``last_tokens[sources[i]]``: a token the step before sampled and that is still on
    the device (async scheduling schedules with a placeholder in its place)."""
    if last_tokens.numel() == 0:
        return input_ids
    picked = last_tokens[sources.clamp(min=0, max=last_tokens.numel() - 1)]
    return torch.where(sources >= 0, picked, input_ids)


def placeholder_sources(token_lists: list[tuple[str, list[int]]], last_rows: dict[str, int]) -> list[int] | None:
    """Per input token: the row of last step's samples that replaces it (a
    PLACEHOLDER; ``last_rows``: each request's row in the last step's samples),
    else -1; None when the step has no placeholder."""
    sources = [
        last_rows[request_id] if t == PLACEHOLDER else -1 for request_id, tokens in token_lists for t in tokens
    ]
    return sources if any(s >= 0 for s in sources) else None


def eager_inputs(
    sched: SchedulerOutput,
    block_size: int,
    null_blocks: Sequence[int],
    skips_replay: Sequence[bool],
    device: torch.device,
    images: Mapping[str, PromptImages] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata], list[int], list[str]]:
    """The eager forward's inputs for the step: input ids, positions, one
    AttentionMetadata per KV cache group, and the rows that sample with their
    requests. skips_replay: one entry per KV cache group, whether positions an SWA
    replay recomputes already hold its KV (all but sliding groups): those write to
    the group's null block (null_blocks, one id per group: its size class's).
    Placeholders are left in the input ids. images: the prompts with images, by
    request: positions are [3, T] when a chunk holds image tokens (every chunk's
    rows then, the others' three alike), else [T] (rope_positions)."""
    bs = block_size
    groups = range(len(skips_replay))
    input_ids: list[int] = []
    positions, axes = rope_positions(sched.chunks, images or {})
    slots: list[list[int]] = [[] for _ in groups]
    query_start_loc = [0]
    seq_lens: list[int] = []
    floors: list[int] = []
    widths = [max(len(c.block_ids[g]) for c in sched.chunks) for g in groups]
    tables: list[list[list[int]]] = [[] for _ in groups]
    for chunk in sched.chunks:
        n = len(chunk.token_ids)
        input_ids += chunk.token_ids
        pos = range(chunk.start_pos, chunk.start_pos + n)
        for g in groups:
            ids = chunk.block_ids[g]
            if skips_replay[g] and chunk.replay_until > chunk.start_pos:
                # Cached persistent KV is never overwritten: replayed positions write to the null block.
                null_slot = null_blocks[g] * bs
                slots[g] += [null_slot if p < chunk.replay_until else ids[p // bs] * bs + p % bs for p in pos]
            else:
                slots[g] += [ids[p // bs] * bs + p % bs for p in pos]
            tables[g].append(ids + [null_blocks[g]] * (widths[g] - len(ids)))
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(chunk.start_pos + n)
        floors.append(chunk.sliding_floor)
    # One pinned copy for the token-level lists, one for the sequence-level ones
    # (see to_device: a plain torch.tensor(..., device=cuda) would stall the host).
    num_tokens, num_seqs = len(input_ids), len(seq_lens)
    per_token = to_device(input_ids + positions + [s for group in slots for s in group], torch.int64, device)
    slots_at = (1 + axes) * num_tokens
    per_seq = to_device(query_start_loc + seq_lens + floors, torch.int32, device)
    has_floor = any(floors)
    metas = [
        AttentionMetadata(
            slot_mapping=per_token[slots_at + g * num_tokens : slots_at + (g + 1) * num_tokens],
            block_tables=to_device(tables[g], torch.int64, device),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_size=bs,
            query_start_loc_tensor=per_seq[: num_seqs + 1],
            seq_lens_tensor=per_seq[num_seqs + 1 : 2 * num_seqs + 1],
            key_floor=floors if has_floor else None,
            key_floor_tensor=per_seq[2 * num_seqs + 1 :] if has_floor else None,
        )
        for g in groups
    ]
    sample_rows, sample_ids = _sample_rows(sched)
    rope = per_token[num_tokens:slots_at]
    rope = rope.view(axes, num_tokens) if axes > 1 else rope
    return per_token[:num_tokens], rope, metas, sample_rows, sample_ids


def rope_positions(chunks: Sequence[ScheduledChunk], images: Mapping[str, PromptImages]) -> tuple[list[int], int]:
    """The step's rotary positions, flat, and their number of rows: 1 (a chunk's
    sequence positions, shifted past a prompt's images: PromptImages.rope_shift) unless
    some chunk holds image tokens, then 3 (M-RoPE), axis after axis."""
    spans = [(c.start_pos, c.start_pos + len(c.token_ids), images.get(c.request_id)) for c in chunks]
    if not any(im is not None and im.overlaps(a, b) for a, b, im in spans):
        return [p + (im.rope_shift(a) if im is not None else 0) for a, b, im in spans for p in range(a, b)], 1
    rows: list[list[int]] = [[], [], []]
    for a, b, im in spans:
        if im is not None and im.overlaps(a, b):
            chunk_rows = im.rope_rows(a, b)
        else:
            shift = im.rope_shift(a) if im is not None else 0
            chunk_rows = [list(range(a + shift, b + shift))] * 3
        for axis, values in zip(rows, chunk_rows):
            axis += values
    return rows[0] + rows[1] + rows[2], 3


def step_image_rows(
    chunks: Sequence[ScheduledChunk], images: Mapping[str, PromptImages]
) -> list[tuple[str, ImageRows]]:
    """The step's rows that take image embeddings (rows counted over the whole step),
    with their requests; empty for a step without image tokens."""
    out: list[tuple[str, ImageRows]] = []
    offset = 0
    for chunk in chunks:
        n = len(chunk.token_ids)
        im = images.get(chunk.request_id)
        if im is not None:
            for r in im.image_rows(chunk.start_pos, chunk.start_pos + n):
                out.append((chunk.request_id, ImageRows(offset + r.row, r.first, r.count)))
        offset += n
    return out


def _sample_rows(sched: SchedulerOutput) -> tuple[list[int], list[str]]:
    """The rows of the step's tokens (chunks concatenated) that sample, and their
    requests: a sampling chunk samples at its last token, and one with drafted tokens
    at each of them and at the token before."""
    rows: list[int] = []
    ids: list[str] = []
    end = 0
    for chunk in sched.chunks:
        end += len(chunk.token_ids)
        if chunk.sample:
            rows += range(end - 1 - len(chunk.spec_token_ids), end)
            ids += [chunk.request_id] * (1 + len(chunk.spec_token_ids))
    return rows, ids


@dataclass(frozen=True, slots=True)
class GraphRows:
    """A step as rows of a decode graph: the arguments of DecodeGraphs.run (but
    last_tokens, which the runner holds), then the rows of its hidden states that
    sample and their requests."""

    input_ids: list[int]
    positions: list[int]
    slots: list[list[int]]
    """One list per KV cache group."""
    seq_lens: list[int]
    tables: list[list[list[int]]]
    """Per KV cache group, each row's block table."""
    placeholder_sources: list[int] | None
    sample_rows: list[int]
    sample_ids: list[str]


def graph_rows(
    sched: SchedulerOutput,
    block_size: int,
    num_groups: int,
    last_rows: dict[str, int],
    rope_shifts: Mapping[str, int] | None = None,
) -> GraphRows:
    """The step as rows of a decode graph, one row per token: a chunk of n tokens (a
    verify step's last token and its drafts) becomes n rows that share its block
    table, row j with the sequence length start + j + 1. Every row's K/V is written
    before any row attends (paged_attention), so row j sees the chunk's earlier
    tokens as the causal prefill would; the hidden rows come out in the eager path's
    order (chunks concatenated), and the same rows sample. last_rows: each request's
    row in the last step's samples, for the placeholders. rope_shifts: per request
    past its images' tokens, what its rotary positions add (PromptImages.rope_shift)."""
    bs = block_size
    chunks = sched.chunks
    groups = range(num_groups)
    owners = [c for c in chunks for _ in c.token_ids]
    positions = [c.start_pos + j for c in chunks for j in range(len(c.token_ids))]
    shifts = rope_shifts or {}
    rope = [p + shifts.get(c.request_id, 0) for c, p in zip(owners, positions)] if shifts else positions
    rows, ids = _sample_rows(sched)
    return GraphRows(
        input_ids=[max(t, 0) for c in chunks for t in c.token_ids],
        positions=rope,
        slots=[[c.block_ids[g][p // bs] * bs + p % bs for c, p in zip(owners, positions)] for g in groups],
        seq_lens=[p + 1 for p in positions],
        tables=[[c.block_ids[g] for c in owners] for g in groups],
        placeholder_sources=placeholder_sources([(c.request_id, c.token_ids) for c in chunks], last_rows),
        sample_rows=rows,
        sample_ids=ids,
    )
