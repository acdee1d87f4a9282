"""DeepSeek-V4 (``DeepseekV4ForCausalLM``) over the engine's paged cache, matching
transformers 5.24's modeling_deepseek_v4.

A layer: mHC collapses the ``hc_mult`` residual streams (shared/model/hyper_connections),
then attention: q through a LoRA (``q_a_proj`` -> RMSNorm -> ``q_b_proj``) and a per-head
unweighted RMSNorm, one shared K = V head (``kv_proj`` -> RMSNorm), both rotated on
their trailing ``rope_head_dim`` channels (the "main" rope in sliding-only layers, the
"compress" one in CSA/HCA layers), a sliding window plus, in CSA/HCA layers, compressed
entries (shared/model/compressed_attention), sinks, the conjugate rotation of the
output, and the grouped low-rank output projection (``o_a_proj`` per head group, then
``o_b_proj``); then the MoE (shared/model/moe, hash-routed first layers) between mHC
again. The hyper head collapses the streams before the final norm and LM head.

Its KV (``kv_layout``): per layer a state cache in a sliding-window group of window
``DeepseekV4Params.state_window`` (never persisted) and, per CSA/HCA layer, a
compressed cache in a persistent group; see compressed_attention for what they hold.
Every cache is one plane of its own width (``v4_kv_rows``: a state row is plane 0 and
plane 1 side by side, a compressed row one entry), in the size class of its group's rows,
so no cache is padded to the widest row (shared/kv/spec.py).
Parameters keep transformers' in-memory names; ``checkpoint_tensors`` also maps the
names transformers saves (``model.layers.0.attn.wq_a``, ``ffn.experts.0.w1``...), and
``ENTRY.checkpoint_names`` DeepSeek's own release names onto those
(deepseek_v4_names.py: ``embed.weight``, ``layers.N.*``, ``hc_head_fn``; ``mtp.*`` set
aside for the MTP drafter). Released FP8 weights (128 x 128 block scales) and FP4
routed experts are dequantised by the loader on the CPU into the model's dtype.
"""

import dataclasses
import re
from collections.abc import Collection, Sequence
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from shared.kv.spec import (
    CacheRow, CompressedSpec, KVCacheLayout, KVCacheSpec, SlidingWindowSpec, entries_per_block, kv_cache_layout_of_specs,
)  # fmt: skip
from shared.model.compressed_attention import (
    SequenceView, StateRow, attend, compress_windows, entry_slots, index_top_k, last_token_slot_row, rope_interleaved,
    sequences, slots_of,
)  # fmt: skip
from shared.model.compressed_batch import (
    TokenRows, attend_rows, closing_rows, entry_rows, indexer_scores, row_chunks, token_rows, top_k_entries, window_keys,
)  # fmt: skip
from shared.model.config import ModelConfig
from shared.model.forward_batch import AttentionMetadata
from shared.model.hyper_connections import HyperConnection, HyperHead, merge_streams, unweighted_rms_norm
from shared.model.interface import CausalLM, ModelEntry, TensorMaker
from shared.model.layers import Linear, rope_inv_freq
from shared.model.models.deepseek_v4_config import CONFIG, CSA, SLIDING, DeepseekV4Params
from shared.model.models.deepseek_v4_names import v4_checkpoint_names
from shared.model.moe import Experts, SparseMoE, counted_tokens
from shared.model.ops import TORCH_OPS, Ops, resolve_ops
from shared.model.parallel import SINGLE, ParallelContext, Shard
from shared.model.parallel_layers import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelHead, column_shard, vocab_embedding,
)  # fmt: skip
from shared.model.profiling import profiled


class V4RMSNorm(nn.Module):
    """transformers' DeepseekV4RMSNorm: float32 weight, scaled in float32, cast once."""

    def __init__(self, size: int, eps: float, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class V4Rotary(nn.Module):
    """cos/sin [T, rope_dim / 2] of one of V4's rotaries (one angle per channel pair)."""

    def __init__(self, config: ModelConfig, compress: bool, device: torch.device) -> None:
        super().__init__()
        assert config.deepseek_v4 is not None and config.compress_rope is not None
        rope = config.compress_rope if compress else config.rope
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(rope, config.deepseek_v4.rope_head_dim, device), persistent=False)
        self.scale = rope.attention_factor if rope.attention_factor is not None else 1.0

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.float()
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)


class Compressor(nn.Module):
    """kv_proj, gate_proj (2 series for CSA), position_bias and kv_norm of one compressor
    (the layer's, or its indexer's at index_head_dim)."""

    def __init__(self, hidden: int, head_dim: int, rate: int, overlap: bool, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        self.kv_proj = Linear(hidden, width, False, dtype, device)
        self.gate_proj = Linear(hidden, width, False, dtype, device)
        self.position_bias = nn.Parameter(torch.empty(rate, width, dtype=torch.float32, device=device), requires_grad=False)
        self.kv_norm = V4RMSNorm(head_dim, eps, device)

    def entries(self, kv: torch.Tensor, gate: torch.Tensor, rotary: V4Rotary, first_positions: torch.Tensor) -> torch.Tensor:
        pooled = compress_windows(kv, gate, self.position_bias, self.head_dim, self.overlap)
        cos, sin = rotary(first_positions, pooled.dtype)
        return rope_interleaved(self.kv_norm(pooled), cos, sin)


class Indexer(Compressor):
    """The lightning indexer of a CSA layer: a compressor of its own (at index_head_dim,
    overlapping windows), q_b_proj from the query LoRA, and the scorer's weights_proj."""

    def __init__(self, config: ModelConfig, p: DeepseekV4Params, rate: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config.hidden_size, p.index_head_dim, rate, True, config.rms_norm_eps, dtype, device)
        self.num_heads, self.top_k = p.index_n_heads, p.index_topk
        self.q_b_proj = Linear(p.q_lora_rank, p.index_n_heads * p.index_head_dim, False, dtype, device)
        self.scorer = nn.Module()
        self.scorer.weights_proj = Linear(config.hidden_size, p.index_n_heads, False, dtype, device)

    def queries(
        self, x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The scorer's per-row inputs: rotated queries [n, heads, index_head_dim] and head
        weights [n, heads] (float32, scaled by 1 / sqrt(heads))."""
        q = rope_interleaved(self.q_b_proj(q_residual).view(x.shape[0], self.num_heads, self.head_dim), cos, sin)
        return q, self.scorer.weights_proj(x).float() * self.num_heads**-0.5

    def scores(self, x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """sum_h w_h * relu(q_h . k): x, q_residual one sequence's rows; keys [e, index_head_dim] -> [n, e]."""
        q, weights = self.queries(x, q_residual, cos, sin)
        dots = F.relu(torch.einsum("nhd,ed->nhe", q.float(), keys.float())) * self.head_dim**-0.5
        return (dots * weights[..., None]).sum(dim=1)


class V4Attention(nn.Module):
    """``parallel``: this rank's query heads only (MQA as vLLM and SGLang split MLA):
    q_b_proj's rows and the sinks of its heads, o_a_proj's blocks of its head groups
    (a group's heads are contiguous, so o_groups / tp_size whole groups a rank), and
    o_b_proj over those groups' columns, summed across the ranks by its all-reduce. The
    KV path (q_a_proj, kv_proj, the compressor and indexer) and so every cache stay
    whole on every rank: one KV head is read by every query head."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device, ops: Ops = TORCH_OPS,
        parallel: ParallelContext = SINGLE,
    ) -> None:  # fmt: skip
        super().__init__()
        p = config.deepseek_v4
        assert p is not None
        self.kind = p.layer_type(layer_idx)
        self.rate = p.compress_rates[layer_idx]
        self.head_dim, self.window, self.eps = config.head_dim, p.sliding_window, config.rms_norm_eps
        self.num_heads = parallel.split(config.num_attention_heads, "num_attention_heads")
        self.o_groups = parallel.split(p.o_groups, "o_groups")
        # The compressor's float dtype, whatever its projections' weights are stored in (FP8 kept).
        self.model_dtype = dtype
        hidden, heads_dim = config.hidden_size, config.num_attention_heads * config.head_dim
        self.q_a_proj = Linear(hidden, p.q_lora_rank, False, dtype, device)
        self.q_a_norm = V4RMSNorm(p.q_lora_rank, config.rms_norm_eps, device)
        self.kv_proj = Linear(hidden, config.head_dim, False, dtype, device)
        self.kv_norm = V4RMSNorm(config.head_dim, config.rms_norm_eps, device)
        # o_a_proj: g blocks [o_lora_rank, heads_dim / g] stacked, one per head group.
        o_a_rows, o_a_in = p.o_groups * p.o_lora_rank, heads_dim // p.o_groups
        self.head_shard: Shard | None = None
        """This rank's query heads of the checkpoint's (None: all of them, one rank)."""
        self.q_b_proj: Linear
        self.o_a_proj: Linear
        self.o_b_proj: Linear
        if parallel.is_parallel:
            self.head_shard = column_shard(config.num_attention_heads, parallel, "num_attention_heads")
            self.q_b_proj = ColumnParallelLinear(p.q_lora_rank, column_shard(heads_dim, parallel, "num_attention_heads"),
                                                 False, dtype, device)  # fmt: skip
            self.o_a_proj = ColumnParallelLinear(o_a_in, column_shard(o_a_rows, parallel, "o_groups"), False, dtype, device)
            self.o_b_proj = RowParallelLinear(o_a_rows, hidden, False, dtype, device, TORCH_OPS, parallel, "o_groups")
        else:
            self.q_b_proj = Linear(p.q_lora_rank, heads_dim, False, dtype, device)
            self.o_a_proj = Linear(o_a_in, o_a_rows, False, dtype, device)
            self.o_b_proj = Linear(o_a_rows, hidden, False, dtype, device)
        self.o_a_proj.fp8_keepable = False  # read as a weight (the grouped einsum below), never called
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32, device=device), requires_grad=False)
        self.compressor: Compressor | None = None
        if self.kind != SLIDING:
            self.compressor = Compressor(hidden, config.head_dim, self.rate, self.kind == CSA, config.rms_norm_eps, dtype, device)
            if self.kind == CSA:
                self.compressor.indexer = Indexer(config, p, self.rate, dtype, device)
        self.row = state_row(config, self.kind)
        self.attend_kernel = ops.compressed_attention
        """The batched path's attention over each row's window and entries, read in place
        (the Triton table's kernel); None: keys gathered per row, then attend_rows."""
        self.batched = True
        """Whole-batch gathers (compressed_batch: no loop over sequences, no host read, CUDA
        graph safe); False: the per-sequence reference (compressed_attention), for tests."""

    @property
    def indexer(self) -> "Indexer | None":
        return getattr(self.compressor, "indexer", None)

    def loaded_shards(self, module_name: str) -> dict[str, Shard]:
        """The sinks of this rank's heads (one per head, split with them)."""
        return {} if self.head_shard is None else {f"{module_name}.sinks": self.head_shard}

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        index_rope: tuple[torch.Tensor, torch.Tensor],
        rotary: V4Rotary,
        state: torch.Tensor,
        compressed: torch.Tensor | None,
        meta: AttentionMetadata,
        cmeta: AttentionMetadata | None,
        rows: TokenRows | None = None,
    ) -> torch.Tensor:
        """``rows``: the step's query rows (compressed_batch.token_rows of ``meta``), made
        once per forward; None: made here."""
        num_tokens = x.shape[0]
        if self.batched and rows is None:
            rows = token_rows(meta, positions)
        cos, sin = rope
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_residual).view(num_tokens, self.num_heads, self.head_dim), self.eps)
        q = rope_interleaved(q, cos, sin)
        kv = rope_interleaved(self.kv_norm(self.kv_proj(x)), cos, sin)
        row = self.row
        # One plane [blocks * block_size, plane0 + plane1] (v4_kv_rows): the two planes side by side.
        flat = state[0].view(-1, state.shape[-1])
        plane0, plane1 = flat[:, : row.plane0], flat[:, row.plane0 :]
        new0 = [kv]
        new1: list[torch.Tensor] = []
        with profiled("v4.compressor"):
            for part in [c for c in (self.compressor, self.indexer) if c is not None]:
                new0.append(part.kv_proj(x))
                new1.append(part.gate_proj(x))
        plane0[meta.slot_mapping, : row.plane0] = torch.cat(new0, dim=-1).to(state.dtype)
        if new1:
            plane1[meta.slot_mapping, : row.plane1] = torch.cat(new1, dim=-1).to(state.dtype)
        if compressed is not None and cmeta is not None:
            with profiled("v4.compressor"):
                self._emit_entries(positions, plane0, plane1, compressed, meta, cmeta, rotary, rows)
        cplane = None if compressed is None else compressed[0].view(-1, compressed.shape[-1])
        with profiled("v4.attention.core"):
            if rows is not None:
                out = self._attend_batch(q, x, q_residual, index_rope, plane0, cplane, rows, meta, cmeta)
            else:
                out = torch.empty_like(q)
                for seq in sequences(meta, cmeta):
                    out[seq.rows] = self._attend_sequence(q, x, q_residual, index_rope, plane0, cplane, seq, meta.block_size)
        # K = V carried rope into the output: rotate back by the query's angle.
        out = rope_interleaved(out, cos, -sin)
        grouped = out.reshape(num_tokens, self.o_groups, -1)
        weight = self.o_a_proj.weight.view(self.o_groups, -1, grouped.shape[-1])
        return self.o_b_proj(torch.einsum("tgi,goi->tgo", grouped, weight).flatten(1))

    def _emit_entries(
        self,
        positions: torch.Tensor,
        plane0: torch.Tensor,
        plane1: torch.Tensor,
        compressed: torch.Tensor,
        meta: AttentionMetadata,
        cmeta: AttentionMetadata,
        rotary: V4Rotary,
        rows: TokenRows | None,
    ) -> None:
        """Entries of the windows this step closes, from their rows in the state cache.
        With ``rows`` (the batched path) the closing rows are found without reading the
        device (compressed_batch.closing_rows); without, by nonzero (the reference)."""
        assert self.compressor is not None
        m, bs, hd, cw = self.rate, meta.block_size, self.head_dim, self.row.compress_width
        live: torch.Tensor | None = None
        if rows is not None:
            closing, live = closing_rows(positions, meta, m)
            if closing.numel() == 0:
                return
            seqs = rows.seq[closing]
        else:
            closing = ((positions + 1) % m == 0).nonzero().flatten()
            if closing.numel() == 0:
                return
            seq_of_row = torch.repeat_interleave(
                torch.arange(meta.num_seqs, device=positions.device), torch.tensor(meta.query_lens, device=positions.device)
            )
            seqs = seq_of_row[closing]
        ends = positions[closing]
        # A graph's rows that close nothing (live False) compute a window 0 or later too, so
        # that what they write to the scratch slot is finite (a masked key is still multiplied).
        windows = ((ends + 1) // m - 1).clamp(min=0)
        span = 2 * m if self.kind == CSA else m
        pos = (windows * m)[:, None] + torch.arange(span, device=positions.device)[None, :] - (span - m)
        tables = meta.block_tables.to(positions.device)[seqs]
        slots = (tables.gather(1, pos.clamp(min=0) // bs) * bs + pos.clamp(min=0) % bs)
        rows0, rows1 = plane0[slots], plane1[slots]  # [E, span, width]
        before_start = (pos < 0)[..., None]
        first = windows * m

        def pooled(part: Compressor, kv_at: int, gate_at: int) -> torch.Tensor:
            width = 2 * part.head_dim if part.overlap else part.head_dim
            kv = rows0[..., kv_at : kv_at + width].to(self.model_dtype)
            gate = rows1[..., gate_at : gate_at + width].to(self.model_dtype)
            gate = gate.masked_fill(before_start, float("-inf"))
            return part.entries(kv, gate, rotary, first)

        entry = pooled(self.compressor, hd, 0)
        if self.indexer is not None:
            entry = torch.cat([entry, pooled(self.indexer, hd + cw, cw)], dim=-1)
        # The compressed cache's slot of the closing token names the entry's block (the
        # null block in a replay of cached positions).
        target = last_token_slot_row(cmeta.slot_mapping[closing] // bs, ends, m, bs)
        if live is not None:
            # The scratch slot's block (a raw-token slot of the compressed group) at its row.
            assert cmeta.scratch_slot is not None
            target = torch.where(live, target, cmeta.scratch_slot // bs * entries_per_block(m, bs))
        cplane = compressed[0].view(-1, compressed.shape[-1])
        cplane[target, : entry.shape[-1]] = entry.to(compressed.dtype)

    def _attend_batch(
        self,
        q: torch.Tensor,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        index_rope: tuple[torch.Tensor, torch.Tensor],
        plane0: torch.Tensor,
        cplane: torch.Tensor | None,
        rows: TokenRows,
        meta: AttentionMetadata,
        cmeta: AttentionMetadata | None,
    ) -> torch.Tensor:
        """Every query row over its window and its compressed entries, gathered per row
        (compressed_batch), in row chunks that bound the gathers' memory."""
        hd, bs, num_tokens = self.head_dim, meta.block_size, q.shape[0]
        indexer = self.indexer
        num_entries = rows.max_len // self.rate if cplane is not None and cmeta is not None else 0
        picks = num_entries if indexer is None else min(indexer.top_k, num_entries)
        # What a row materialises: its keys and scores where they are gathered (no kernel),
        # its entries' indexer scores for CSA.
        per_row = (self.window + picks) * (hd + self.num_heads) if self.attend_kernel is None else 1
        if indexer is not None and num_entries:
            cos, sin = index_rope
            index_q, index_w = indexer.queries(x, q_residual, cos, sin)
            per_row = max(per_row, num_entries * (indexer.num_heads + indexer.head_dim))
        out = torch.empty_like(q)
        for lo, hi in row_chunks(num_tokens, per_row):
            chunk = rows.rows(lo, hi)
            flat = causal = None
            if num_entries:
                assert cplane is not None and cmeta is not None
                flat, causal = entry_rows(cmeta.block_tables, chunk, self.rate, bs)
                if indexer is not None:
                    with profiled("v4.indexer"):
                        scores = indexer_scores(index_q[lo:hi], index_w[lo:hi], cplane[flat, hd : hd + indexer.head_dim],
                                                indexer.head_dim)  # fmt: skip
                        picked, causal = top_k_entries(scores, causal, indexer.top_k)
                        flat = flat.gather(1, picked)
            if self.attend_kernel is not None:
                out[lo:hi] = self.attend_kernel(
                    q[lo:hi], plane0, meta.block_tables, chunk.seq, chunk.pos, chunk.floor, self.window, bs,
                    cplane if num_entries else None, flat, causal, self.sinks, hd**-0.5,
                )  # fmt: skip
                continue
            keys, visible = window_keys(plane0, meta.block_tables, chunk, self.window, bs, hd)
            if flat is not None and causal is not None:
                assert cplane is not None
                keys = torch.cat([keys, cplane[flat, :hd]], dim=1)
                visible = torch.cat([visible, causal], dim=1)
            out[lo:hi] = attend_rows(q[lo:hi], keys, visible, hd**-0.5, self.sinks)
        return out

    def _attend_sequence(
        self,
        q: torch.Tensor,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        index_rope: tuple[torch.Tensor, torch.Tensor],
        plane0: torch.Tensor,
        cplane: torch.Tensor | None,
        seq: SequenceView,
        block_size: int,
    ) -> torch.Tensor:
        device = q.device
        query_pos = torch.arange(seq.start, seq.end, device=device)
        lo = max(seq.start - self.window + 1, seq.floor, 0)
        key_pos = torch.arange(lo, seq.end, device=device)
        window_kv = plane0[slots_of(seq.state_table.to(device), key_pos, block_size), : self.head_dim]
        entries = visible = None
        num_entries = seq.end // self.rate if self.rate else 0
        if cplane is not None and num_entries > 0:
            ids = torch.arange(num_entries, device=device)
            rows = cplane[entry_slots(seq.compressed_table.to(device), ids, self.rate, block_size)]
            entries = rows[:, : self.head_dim]
            visible = ids[None, :] < ((query_pos + 1) // self.rate)[:, None]
            if self.indexer is not None:
                with profiled("v4.indexer"):
                    keys = rows[:, self.head_dim : self.head_dim + self.indexer.head_dim]
                    cos, sin = index_rope
                    scores = self.indexer.scores(x[seq.rows], q_residual[seq.rows], cos[seq.rows], sin[seq.rows], keys)
                    visible = index_top_k(scores, visible, self.indexer.top_k)
        return attend(
            q[seq.rows], window_kv, entries, visible, query_pos, key_pos, self.window, seq.floor,
            self.head_dim**-0.5, self.sinks,
        )  # fmt: skip


def v4_moe(
    config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device, ops: Ops = TORCH_OPS,
    parallel: ParallelContext = SINGLE,
) -> SparseMoE:  # fmt: skip
    """Layer ``layer_idx``'s MoE block: hash-routed (by token id) or top-k, shared experts.
    ``parallel``: tensor parallelism without expert parallelism splits the shared experts
    (column / row parallel) and keeps the routed experts whole on every rank, each rank
    running them on the whole step (check_tensor_parallel says why); with expert
    parallelism the block is built whole and then split by expert and by token
    (shared/model/expert_parallel_model.py), where a split shared expert would sum other
    ranks' tokens."""
    moe = config.moe
    assert moe is not None
    kind = config.mlp_layer_type(layer_idx)
    # A hash-routed layer chooses by token id: no selection bias (transformers' DeepseekV4HashRouter).
    layer_moe = dataclasses.replace(moe, selection_bias=False) if kind == "hash_moe" else moe
    shared = SINGLE if parallel.is_expert_parallel else parallel
    return SparseMoE(config.hidden_size, layer_moe, kind, config.vocab_size, dtype, device, router_name="gate", ops=ops,
                     parallel=shared)  # fmt: skip


class V4DecoderLayer(nn.Module):
    """``parallel``: the attention's heads and the shared experts split over the ranks
    (V4Attention, v4_moe); mHC and the norms whole on every rank, on the whole step."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device, ops: Ops = TORCH_OPS,
        parallel: ParallelContext = SINGLE,
    ) -> None:  # fmt: skip
        super().__init__()
        p, moe = config.deepseek_v4, config.moe
        assert p is not None and moe is not None
        self.self_attn = V4Attention(config, layer_idx, dtype, device, ops, parallel)
        self.mlp = v4_moe(config, layer_idx, dtype, device, ops, parallel)
        self.input_layernorm = V4RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.post_attention_layernorm = V4RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        hc = (config.hidden_size, p.hc_mult, p.hc_sinkhorn_iters, p.hc_eps, config.rms_norm_eps, device, ops)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        index_rope: tuple[torch.Tensor, torch.Tensor],
        rotary: V4Rotary,
        state: torch.Tensor,
        compressed: torch.Tensor | None,
        meta: AttentionMetadata,
        cmeta: AttentionMetadata | None,
        rows: TokenRows | None = None,
        counted: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """streams [T, hc, hidden] -> the streams after the attention and the MoE, each
        between mHC's collapse and merge (the model's layers, and V4's MTP block).
        ``rows``: the step's query rows (compressed_batch.token_rows), shared by the layers
        of one cache group; ``counted``: the rows the MoE counts per expert (a CUDA graph's
        padding rows are not)."""
        with profiled("v4.mhc"):
            post, comb, collapsed = self.attn_hc(streams)
        with profiled("v4.norm"):
            h = self.input_layernorm(collapsed)
        with profiled("v4.attention"):
            out = self.self_attn(h, positions, rope, index_rope, rotary, state, compressed, meta, cmeta, rows)
        with profiled("v4.mhc"):
            streams = merge_streams(streams, out, post, comb)
            post, comb, collapsed = self.ffn_hc(streams)
        with profiled("v4.norm"):
            h = self.post_attention_layernorm(collapsed)
        with profiled("v4.moe"):
            out = self.mlp(h, input_ids, counted)
        with profiled("v4.mhc"):
            return merge_streams(streams, out, post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device, ops: Ops = TORCH_OPS,
        parallel: ParallelContext = SINGLE,
    ) -> None:  # fmt: skip
        super().__init__()
        p = config.deepseek_v4
        assert p is not None
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, dtype, device, parallel)
        self.layers = nn.ModuleList(
            V4DecoderLayer(config, i, dtype, device, ops, parallel) for i in range(config.num_hidden_layers)
        )
        self.norm = V4RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.hc_head = HyperHead(config.hidden_size, p.hc_mult, p.hc_eps, config.rms_norm_eps, device)


def v4_kv_specs(config: ModelConfig) -> list[KVCacheSpec]:
    """The model's caches: one state cache per layer, then one compressed cache per
    CSA/HCA layer, in layer order."""
    p = config.deepseek_v4
    assert p is not None
    specs: list[KVCacheSpec] = [SlidingWindowSpec(p.state_window)] * config.num_hidden_layers
    return specs + [
        CompressedSpec(r, entry_width(config, t)) for t, r in zip(p.layer_types, p.compress_rates) if t != SLIDING
    ]


def state_row(config: ModelConfig, kind: str) -> StateRow:
    """Where a layer of this kind keeps its per-token state in its state cache."""
    p = config.deepseek_v4
    assert p is not None
    compress_width = 0 if kind == SLIDING else (2 if kind == CSA else 1) * config.head_dim
    return StateRow(config.head_dim, compress_width, 2 * p.index_head_dim if kind == CSA else 0)


def v4_kv_rows(config: ModelConfig) -> list[CacheRow]:
    """Each cache's row, in v4_kv_specs' order, one plane each: a state cache's plane 0
    and plane 1 side by side (a sliding-only layer has no plane 1), a compressed cache's
    entry. Their sum over caches is what a token costs; no row is padded to another's."""
    p = config.deepseek_v4
    assert p is not None
    rows = [CacheRow(1, 1, r.plane0 + r.plane1) for r in (state_row(config, t) for t in p.layer_types)]
    return rows + [CacheRow(1, 1, entry_width(config, t)) for t in p.layer_types if t != SLIDING]


def entry_width(config: ModelConfig, kind: str) -> int:
    """Channels of a compressed entry of a CSA/HCA layer: the entry, and a CSA layer's indexer key."""
    p = config.deepseek_v4
    assert p is not None
    return config.head_dim + (p.index_head_dim if kind == CSA else 0)


def v4_kv_layout(config: ModelConfig) -> KVCacheLayout:
    """The state caches' sliding-window group and the compressed caches' persistent ones,
    with each cache's row (v4_kv_rows)."""
    return kv_cache_layout_of_specs(v4_kv_specs(config), v4_kv_rows(config))


class DeepseekV4ForCausalLM(CausalLM):
    """The engine's CausalLM interface (shared/model/interface.py) for V4.
    On CUDA (the Triton table) the routed experts run the fused MoE, mHC its fused
    kernel and the attention core the compressed-attention kernel (each row's window and
    entries read in place); the compressors and indexer run batched PyTorch
    (compressed_batch), so that a decode step is captured in a CUDA graph.

    ``parallel``: this rank's slice of a tensor-parallel model (``check_tensor_parallel``):
    the attention's query heads and output projection (V4Attention), the shared experts,
    the embedding and the head split over ``tp_size`` ranks as the Llama family's are;
    the KV path, every cache, mHC and the norms whole on every rank. Beside expert
    parallelism the MoE layers are built whole, then split by expert
    (``make_expert_parallel``), as Qwen3-MoE's and GPT-OSS's are."""

    splits_attention_with_experts = True
    splits_kv_heads = False

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tie_word_embeddings: bool | None = None,
        kernels: str = "auto",
        *,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        p = config.deepseek_v4
        if p is None or config.moe is None:
            raise ValueError("DeepseekV4ForCausalLM needs a DeepSeek-V4 config")
        # The checkpoint's LM head is "head.weight" (transformers' saved name): the
        # loader's "no lm_head.weight" guess of a tied head does not apply; the config says.
        super().__init__(config, dtype, config.tie_word_embeddings)
        device = torch.device(device)
        self.parallel = parallel
        if parallel.is_parallel:
            type(self).check_tensor_parallel(config, parallel.tp_size, expert_parallel=parallel.is_expert_parallel)
        # The routed experts take the fused Triton MoE, mHC its fused kernel and the attention
        # core its kernel where kernels resolve to Triton (CUDA): no host sync. The
        # compressors and the indexer are batched PyTorch either way.
        self.ops = resolve_ops(kernels, device)
        self.model = DeepseekV4Model(config, dtype, device, ops=self.ops, parallel=parallel)
        self.lm_head: Linear | None = None
        if not self.tie_word_embeddings and parallel.is_parallel:
            self.lm_head = VocabParallelHead(config.hidden_size, config.vocab_size, dtype, device, parallel)
        elif not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device)
        self.main_rotary = V4Rotary(config, False, device)
        self.compress_rotary = V4Rotary(config, True, device)
        self.expert_counts = torch.zeros(config.num_hidden_layers, config.moe.num_experts, dtype=torch.int64, device=device)
        for row, layer in zip(self.expert_counts, self.model.layers):
            layer.mlp.counts = row
        self.kv_layout = v4_kv_layout(config)
        num_layers = config.num_hidden_layers
        compressed_layers = [i for i, t in enumerate(p.layer_types) if t != SLIDING]
        self._compressed_cache = {layer: num_layers + j for j, layer in enumerate(compressed_layers)}
        self._group_of_cache = [self.kv_layout.group_of_layer(i) for i in range(self.kv_layout.num_layers)]
        self.keep_streams = False
        """Keep the last forward's streams before the hyper head (``draft_hidden``): set by
        V4's MTP module, which reads them; off, nothing outlives the forward."""
        self.last_streams: torch.Tensor | None = None

    @classmethod
    def check_tensor_parallel(cls, config: ModelConfig, tp_size: int, expert_parallel: bool = False) -> None:
        """The query heads and the output projection's head groups split evenly
        (num_attention_heads and o_groups divisible by tp_size: a rank's heads are whole
        groups of o_a_proj), and without expert parallelism the shared experts'
        intermediate size too. The one KV head is never split (every rank keeps the whole
        KV). Without expert parallelism the routed experts stay whole on every rank
        (each computes them for the whole step): the memory of the experts is not split
        unless ``enable_expert_parallel`` splits them by expert."""
        if tp_size == 1:
            return
        p, moe = config.deepseek_v4, config.moe
        assert p is not None and moe is not None
        heads = config.num_attention_heads
        if heads % tp_size:
            raise ValueError(f"num_attention_heads ({heads}) is not divisible by tensor_parallel_size ({tp_size})")
        if p.o_groups % tp_size:
            raise ValueError(
                f"o_groups ({p.o_groups}) is not divisible by tensor_parallel_size ({tp_size}): each rank's query "
                "heads must be whole groups of the grouped output projection (o_a_proj)"
            )
        if not expert_parallel and moe.num_shared_experts and moe.shared_intermediate_size % tp_size:
            raise ValueError(
                f"the shared experts' intermediate size (moe_intermediate_size, {moe.shared_intermediate_size}) is not "
                f"divisible by tensor_parallel_size ({tp_size})"
            )

    def checkpoint_shards(self) -> dict[str, Shard]:
        """Each split tensor's shard under its in-memory name and under the name
        transformers saves it by (``checkpoint_tensors`` uses one or the other)."""
        shards = super().checkpoint_shards()
        return shards | {saved_name(name): shard for name, shard in shards.items()}

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether a decode step can be captured: on the Triton table (the fused MoE, which
        never reads run lengths on the host; the fused mHC) with the batched attention,
        which sizes its gathers from host bounds and finds closing windows without a read
        (compressed_batch). The per-sequence reference reads the device: never captured."""
        return (
            self.ops.triton
            and all(layer.mlp.host_sync_free for layer in self.model.layers)
            and all(layer.self_attn.batched for layer in self.model.layers)
        )

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], metas: list[AttentionMetadata]
    ) -> torch.Tensor:
        if len(kv_caches) != self.kv_layout.num_layers:
            raise ValueError(f"got {len(kv_caches)} KV caches, the model has {self.kv_layout.num_layers}")
        if len(metas) != len(self.kv_layout.groups):
            raise ValueError(f"got attention metadata for {len(metas)} KV groups, the model has {len(self.kv_layout.groups)}")
        x = self.model.embed_tokens(input_ids)
        ropes = {False: self.main_rotary(positions, x.dtype), True: self.compress_rotary(positions, x.dtype)}
        p = self.config.deepseek_v4
        assert p is not None
        streams = x.unsqueeze(1).expand(-1, p.hc_mult, -1).contiguous()
        # The profiler ranges (shared/model/moe.py's profiled) are where tools/bench/v4_bench.py
        # counts a step's time by kind: mHC, norms, attention (and within it the compressors,
        # the per-sequence core and the indexer), the MoE.
        # The query rows' sequences and floors, once per state-cache group (one in V4).
        rows: dict[int, TokenRows] = {}
        # A CUDA graph's padding rows are not counted per expert (moe.counted_tokens).
        counted = counted_tokens(metas[self._group_of_cache[0]], input_ids.shape[0])
        for i, layer in enumerate(self.model.layers):
            c = self._compressed_cache.get(i)
            g = self._group_of_cache[i]
            if layer.self_attn.batched and g not in rows:
                rows[g] = token_rows(metas[g], positions)
            streams = layer(
                streams, input_ids, positions, ropes[p.uses_compress_rope(i)], ropes[True], self.compress_rotary,
                kv_caches[i], None if c is None else kv_caches[c],
                metas[g], None if c is None else metas[self._group_of_cache[c]], rows.get(g), counted,
            )  # fmt: skip
        self.last_streams = streams if self.keep_streams else None
        with profiled("v4.mhc"):
            collapsed = self.model.hc_head(streams)
        with profiled("v4.norm"):
            return self.model.norm(collapsed)

    def allocate_kv_cache(
        self,
        num_blocks: int | Sequence[int],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        make: TensorMaker | None = None,
    ) -> list[torch.Tensor]:
        """One [1, num_blocks, rows, 1, width] tensor per cache (state caches, then
        compressed caches), each of its own row's width (v4_kv_rows) and rows per block
        (block_size for a state cache, its entries for a compressed one), laid out as every
        CausalLM's: per size class, cache k of every group of the class in its tensor k."""
        for rate in {r for r in self.config.deepseek_v4.compress_rates if r}:  # type: ignore[union-attr]
            if block_size % rate and rate % block_size:
                raise ValueError(f"block_size {block_size} and the compression rate {rate} must divide one another")
        return super().allocate_kv_cache(num_blocks, block_size, dtype, device, make)

    def checkpoint_tensors(self, available: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """Checkpoint name -> tensor. Names as transformers saves V4 (DeepSeek's:
        ``model.layers.0.attn.wq_a.weight``, ``ffn.experts.0.w1.weight``, ``head.weight``...)
        unless ``available`` holds transformers' in-memory names (a model's state_dict)."""
        in_memory = available is not None and ("lm_head.weight" in available or any(".self_attn." in n for n in available))
        targets = module_targets(self, available if in_memory else None)
        if in_memory:
            return targets
        return {saved_name(name): tensor for name, tensor in targets.items()}

    def draft_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The residual streams before the hyper head, flattened [T, hc * hidden], when
        ``keep_streams`` is set: what V4's MTP module reads (DeepSeek's MTPBlock takes
        the [.., hc, hidden] stack, not the collapsed and normed state)."""
        if self.last_streams is None:
            raise RuntimeError("draft_hidden needs keep_streams set before the forward")
        return self.last_streams.flatten(1)


def module_targets(module: nn.Module, available: Collection[str] | None) -> dict[str, torch.Tensor]:
    """In-memory name -> tensor of a V4 module's parameters (the model, or one decoder
    layer for the MTP module): per-expert views of the routed experts (fused tensors when
    ``available`` has them), the shared experts' gate and up as their own names."""
    targets: dict[str, torch.Tensor] = {}
    experts = {name: m for name, m in module.named_modules() if isinstance(m, Experts)}
    for prefix, sub in experts.items():
        targets.update(sub.checkpoint_targets(prefix, available))
    for name, param in module.named_parameters():
        module_name = name.rpartition(".")[0]
        if module_name in experts:
            continue
        if module_name.endswith("shared_experts.gate_up_proj"):
            parent = module_name.rpartition(".")[0]
            targets.update({f"{parent}.{part}": v for part, v in module.get_submodule(module_name).shard_views().items()})
            continue
        targets[name] = param.detach()
    return targets

ENTRY = ModelEntry(
    config=CONFIG, model_classes=MappingProxyType({"DeepseekV4ForCausalLM": DeepseekV4ForCausalLM}), kv_layout=v4_kv_layout,
    checkpoint_names=v4_checkpoint_names,
)


# transformers' in-memory names -> the names it saves (the reverse of its deepseek_v4
# conversion mapping), applied in order to a name.
_SAVED_NAMES: tuple[tuple[str, str], ...] = (
    (r"^lm_head\.weight$", "head.weight"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.kv_norm\.", ".norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.(weight)$", r".wgate.\1"),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
)
_EXPERT_PARTS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def saved_name(name: str) -> str:
    """The name transformers saves a V4 tensor under, from its in-memory name."""
    expert = re.search(r"\.(experts\.\d+|shared_experts)\.(gate_proj|up_proj|down_proj)\.weight$", name)
    if expert:
        name = f"{name[: expert.start()]}.{expert.group(1)}.{_EXPERT_PARTS[expert.group(2)]}.weight"
    for pattern, replacement in _SAVED_NAMES:
        name = re.sub(pattern, replacement, name)
    return name
