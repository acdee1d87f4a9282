"""A minimal paged-KV driver for ``CausalLM`` (no scheduler, no engine): the
parity tests run a model's varlen steps over a paged cache with it."""

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from shared.model.forward_batch import AttentionMetadata
from shared.model.interface import CausalLM
from shared.model.multimodal import InputEmbeddings


class PagedDriver:
    """Runs varlen steps of a model over a paged cache. Blocks are handed out in a
    shuffled order, so a sequence's blocks are scattered and block 0 (the padding
    value of block tables) holds real data of some sequence. Every KV cache group
    of the model gets its own blocks (groups share the cache tensors)."""

    def __init__(
        self,
        model: CausalLM,
        num_seqs: int,
        num_blocks: int = 128,
        block_size: int = 4,
        seed: int = 0,
        kv_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.num_groups = len(model.kv_layout.groups)
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size, kv_dtype, self.device)
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.blocks: list[list[list[int]]] = [[[] for _ in range(num_seqs)] for _ in range(self.num_groups)]
        self.lens = [0] * num_seqs

    def step(
        self,
        new_tokens: dict[int, list[int]],
        rope_positions: dict[int, list[list[int]]] | None = None,
        embeds: dict[int, tuple[list[int], torch.Tensor]] | None = None,
    ) -> dict[int, torch.Tensor]:
        """Feed ``new_tokens[s]`` to sequence s (all in one forward); logits [n, vocab] per sequence.

        A vision-language model's step: ``rope_positions[s]`` [3][n] the rotary positions
        of sequence s's new tokens (others: their sequence positions on every axis), and
        ``embeds[s]`` (rows among its new tokens, embeddings [rows, hidden]) what replaces
        their input embeddings; with either, positions go to the model as [3, T]."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(self.num_groups)]
        starts = [0]
        seq_lens: list[int] = []
        order = list(new_tokens)
        for s in order:
            for token in new_tokens[s]:
                pos = self.lens[s]
                ids.append(token)
                positions.append(pos)
                for g, blocks in enumerate(self.blocks):
                    if pos % self.block_size == 0:
                        blocks[s].append(self.free.pop())
                    slots[g].append(blocks[s][pos // self.block_size] * self.block_size + pos % self.block_size)
                self.lens[s] += 1
            starts.append(len(ids))
            seq_lens.append(self.lens[s])
        metas = []
        for g, blocks in enumerate(self.blocks):
            width = max(len(blocks[s]) for s in order)
            tables = torch.zeros(len(order), width, dtype=torch.int64)
            for row, s in enumerate(order):
                tables[row, : len(blocks[s])] = torch.tensor(blocks[s])
            metas.append(
                AttentionMetadata(
                    slot_mapping=torch.tensor(slots[g], dtype=torch.int64, device=self.device),
                    block_tables=tables.to(self.device),
                    query_start_loc=starts,
                    seq_lens=seq_lens,
                    block_size=self.block_size,
                )
            )
        if rope_positions is None and embeds is None:
            hidden = self.model(
                torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), self.kv_caches, metas
            )
        else:
            axes: list[list[int]] = [[], [], []]
            for row, s in enumerate(order):
                given = (rope_positions or {}).get(s)
                for a in range(3):
                    axes[a] += given[a] if given is not None else positions[starts[row] : starts[row + 1]]
            rows = [starts[order.index(s)] + r for s, (local, _) in (embeds or {}).items() for r in local]
            merged = None
            if rows:
                merged = InputEmbeddings(
                    torch.tensor(rows, device=self.device), torch.cat([e for _, e in (embeds or {}).values()])
                )
            hidden = self.model(  # type: ignore[call-arg]
                torch.tensor(ids, device=self.device), torch.tensor(axes, device=self.device), self.kv_caches, metas,
                embeddings=merged,
            )
        logits = self.model.compute_logits(hidden)
        return {s: logits[starts[row] : starts[row + 1]] for row, s in enumerate(order)}


def as_graph_metas(
    metas: list[AttentionMetadata], bound: int, scratch_slot: int, pad: int
) -> list[AttentionMetadata]:
    """A decode step's metadata (one token per sequence) as shared/engine/cuda_graphs.py's
    DecodeGraphs hands it to the model: ``pad`` more rows of length 0 writing to
    ``scratch_slot``, block tables at the width of ``bound`` tokens, the host lists at the
    capture's bound (seq_lens = bound), the step's lengths only in the tensors."""
    out = []
    for m in metas:
        n = m.num_seqs + pad
        tables = torch.zeros(n, -(-bound // m.block_size), dtype=torch.int64)
        tables[: m.num_seqs, : m.block_tables.shape[1]] = m.block_tables
        out.append(
            AttentionMetadata(
                slot_mapping=torch.cat([m.slot_mapping, torch.full((pad,), scratch_slot)]),
                block_tables=tables,
                query_start_loc=list(range(n + 1)),
                seq_lens=[bound] * n,
                block_size=m.block_size,
                query_start_loc_tensor=torch.arange(n + 1, dtype=torch.int32),
                seq_lens_tensor=torch.tensor(m.seq_lens + [0] * pad, dtype=torch.int32),
                scratch_slot=scratch_slot,
            )
        )
    return out


class GraphShapedPair:
    """Two drivers of one model fed the same prompts: ``eager`` runs decode steps as they
    come, ``graphed`` with the metadata a CUDA graph's replay hands the model
    (``as_graph_metas``: ``pad`` more rows writing to a block no sequence owns, host lists
    at ``bound``), so the path the graphs capture is checked without a GPU. ``metas``
    fills with the metadata of each graph-shaped forward."""

    def __init__(
        self, model: CausalLM, prompts: list[list[int]], *, num_blocks: int, block_size: int, seed: int, bound: int, pad: int
    ) -> None:
        self.model = model
        self.bound = bound
        self.pad = pad
        self.eager, self.graphed = (
            PagedDriver(model, len(prompts), num_blocks=num_blocks, block_size=block_size, seed=seed) for _ in range(2)
        )
        for driver in (self.eager, self.graphed):
            driver.step(dict(enumerate(prompts)))
        # Both drivers shuffled their blocks alike: the next free one is the same, and no sequence owns it.
        self.scratch = self.eager.free.pop()
        assert self.graphed.free.pop() == self.scratch
        self.metas: list[list[AttentionMetadata]] = []

    def step(
        self, new_tokens: dict[int, list[int]], within: Callable[[], AbstractContextManager[object]] = nullcontext
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """One decode step (a token per sequence) on both: (eager logits, graph-shaped
        logits) per sequence. ``within`` makes the context the graph-shaped forward runs in."""
        eager = self.eager.step(new_tokens)
        forward = self.model.forward
        block_size = self.graphed.block_size

        def graph_forward(
            ids: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor], metas: list[AttentionMetadata]
        ) -> torch.Tensor:
            gm = as_graph_metas(metas, self.bound, self.scratch * block_size, self.pad)
            self.metas.append(gm)
            ids = torch.cat([ids, torch.zeros(self.pad, dtype=ids.dtype)])
            positions = torch.cat([positions, torch.zeros(self.pad, dtype=positions.dtype)])
            with within():
                hidden = forward(ids, positions, caches, gm)
            return hidden[: ids.shape[0] - self.pad]

        self.model.forward = graph_forward  # type: ignore[method-assign]
        try:
            graphed = self.graphed.step(new_tokens)
        finally:
            del self.model.forward
        return eager, graphed
