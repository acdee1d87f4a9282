"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small batch is dozens of short kernel launches per layer;
launched one by one from Python, the GPU idles between them. Captured once
per bucket when the engine starts and replayed, the whole forward is one launch. A batch of B
sequences runs in the smallest bucket >= B: the extra rows have length 0 (the
attention kernels return zeros for them) and write their K/V to a scratch
slot no sequence owns (per KV group: its size class's null block).

Everything the graph reads lives in static buffers filled before each replay:
token ids, positions, sequence lengths, and per KV cache group the KV slots and
block tables at a fixed width (max_model_len / block_size). Logits and sampling stay outside the
graph: they touch only the rows that sample.
"""

import itertools
import logging
import time
from collections.abc import Sequence

import torch

from shared.engine.step_inputs import fill_placeholders
from shared.model.forward_batch import AttentionMetadata
from shared.model.interface import CausalLM

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def fill_block_tables(table: torch.Tensor, tables: list[list[list[int]]]) -> None:
    """Write per group the rows' block tables into ``table`` [groups, rows, width], zero
    past each row's blocks: one tensor per group, not one per row (a verify step has a
    row per token, 320-450 of them at batch 64 with 2 drafts: per-row tensors cost ms)."""
    table.zero_()
    width = table.shape[-1]
    for g, group_tables in enumerate(tables):
        lengths = torch.tensor([len(row) for row in group_tables], dtype=torch.int64)
        blocks = torch.tensor(list(itertools.chain.from_iterable(group_tables)), dtype=torch.int64)
        rows = table[g, : len(group_tables)]
        rows[torch.arange(width) < lengths[:, None]] = blocks


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        max_batch: int,
        scratch_slots: Sequence[int],
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.width = -(-max_model_len // block_size)
        self.num_groups = G = len(model.kv_layout.groups)
        if len(scratch_slots) != G:
            raise ValueError(f"{len(scratch_slots)} scratch slots for {G} KV groups")
        self.scratch_slots = list(scratch_slots)
        """Per KV group, the slot padding rows write to."""
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self._scratch = torch.tensor(self.scratch_slots, dtype=torch.int64, device=device)[:, None]
        self.slot_mapping = self._scratch.expand(G, n).clone()
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(G, n, self.width, dtype=torch.int64, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Host staging (pinned, double-buffered) and its device twin: ids,
        # positions, lengths, placeholder sources, slots per group, then the block tables.
        self._rows = 4 + G
        size = self._rows * n + G * n * self.width
        self._stages = [torch.zeros(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._next_stage = 0
        self._device_stage = torch.zeros(size, dtype=torch.int64, device=device)
        self._pool = None

    def capture_all(self) -> float:
        """Capture every bucket now, at start (as vLLM does), so that no step of a serving
        engine pays a capture: one costs 10-150 ms on an H200, and a bucket first reached
        mid-run (a verify step's rows, a batch that grew) stalled every request in it. The
        largest first: the smaller graphs then fit in the memory pool it left. Returns the
        seconds it took."""
        start = time.perf_counter()
        for b in sorted(self.buckets, reverse=True):
            self._capture(b)
        return time.perf_counter() - start

    def can_run(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.buckets[-1] and max_blocks <= self.width

    def _bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def _metas(self, b: int) -> list[AttentionMetadata]:
        # The lists only steer static choices made at capture (kernel, split
        # count): capture for the longest sequences; replays read the tensors.
        return [
            AttentionMetadata(
                slot_mapping=self.slot_mapping[g, :b],
                block_tables=self.block_tables[g, :b],
                query_start_loc=list(range(b + 1)),
                seq_lens=[self.max_model_len] * b,
                block_size=self.block_size,
                query_start_loc_tensor=self.query_start_loc[: b + 1],
                seq_lens_tensor=self.seq_lens[:b],
                scratch_slot=self.scratch_slots[g],
            )
            for g in range(self.num_groups)
        ]

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, self._metas(b))

    def _capture(self, b: int) -> None:
        self.seq_lens.zero_()
        self.slot_mapping.copy_(self._scratch.expand_as(self.slot_mapping))
        # Warm up on a side stream first: Triton compiles, allocators settle.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(b)
        self._pool = graph.pool()
        self._graphs[b] = (graph, out)
        log.info("captured the decode graph of batch %d", b)

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[list[int]],
        seq_lens: list[int],
        tables: list[list[list[int]]],
        placeholder_sources: list[int] | None = None,
        last_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [len(input_ids), hidden] of one decode step, replayed from the
        smallest bucket that holds it (capture_all captured them all before the first run).

        placeholder_sources[i] >= 0 means row i's input token is
        last_tokens[placeholder_sources[i]] (sampled by the step before, still
        on the device); -1 means input_ids[i] is the token. slots and tables: one
        list per KV cache group."""
        num = len(input_ids)
        b = self._bucket(num)
        pad = b - num
        # Everything goes through a pinned staging buffer in one copy: a copy from pageable
        # memory would block the host until the device is idle, which is exactly the gap
        # overlapped scheduling exists to hide. The b rows replayed are laid out densely
        # ([r, b], then [G, b, w]) for the same reason: a strided view of the buffer (the
        # first b of its n columns) would be copied through a pageable temporary, and every
        # step below the largest bucket (a speculating engine's plain steps: always) waited
        # for the one before. Two buffers alternate: the one written now was last read two
        # steps ago, whose completion the engine has already waited for.
        stage = self._stages[self._next_stage]
        self._next_stage ^= 1
        w, r, G = self.width, self._rows, self.num_groups
        sources = placeholder_sources or [-1] * num
        stage[: r * b].view(r, b)[:] = torch.tensor(
            [
                input_ids + [0] * pad,
                positions + [0] * pad,
                seq_lens + [0] * pad,
                sources + [-1] * pad,
                *(group_slots + [scratch] * pad for group_slots, scratch in zip(slots, self.scratch_slots)),
            ],
            dtype=torch.int64,
        )
        used = r * b + G * b * w
        fill_block_tables(stage[r * b : used].view(G, b, w), tables)
        device_stage = self._device_stage[:used]
        device_stage.copy_(stage[:used], non_blocking=True)
        self.block_tables[:, :b].copy_(device_stage[r * b :].view(G, b, w))
        rows = device_stage[: r * b].view(r, b)
        ids = rows[0]
        if last_tokens is not None:
            ids = fill_placeholders(ids, rows[3], last_tokens)
        self.input_ids[:b].copy_(ids)
        self.positions[:b].copy_(rows[1])
        self.seq_lens[:b].copy_(rows[2])
        self.slot_mapping[:, :b].copy_(rows[4:])
        graph, out = self._graphs[b]
        graph.replay()
        return out[:num]
