"""Batch-invariant ops (issue 14, point 3; EngineConfig.batch_invariant): a token's
logits are bitwise the same alone or in any batch, with any chunking of its prompt.

The normal path's results depend on the batch in the last bits: a matmul's BLAS
kernel (and its reduction order) depends on the number of rows M, so a row computes
differently at M = 1 (GEMV) than at M = 37; attention pads every sequence to the
batch's longest query and key lengths, and SDPA picks its split sizes from them.
The PyTorch table (the plain CPU's) replaces them with computations whose shape per
unit of work is fixed:

- linear: the rows padded to tiles of TILE_ROWS and multiplied as a batch of fixed
  [TILE_ROWS, K] x [K, N] products (bmm), never as one [M, K] GEMM;
- norms: per row, the sum of squares in fixed chunks of CHUNK, then a sequential
  scan over the chunks (no reduction a thread split could reorder);
- attention: per sequence (nothing padded to another sequence), queries in tiles of
  TILE_ROWS, keys in tiles of CHUNK; softmax sums and the value products reduced per
  key tile, then accumulated over the tiles in order (cumsum): a query sees the same
  tiles whatever its chunk, and masked keys add exact zeros.

What stays assumed, and is checked by tests/unit/test_batch_invariant.py on the CPU: a
fixed-shape product gives a row the same bits wherever it sits in its tile and
whatever the other rows hold (true of BLAS micro-kernels, whose reduction over K
runs in one order per output element). The same assumption, for a tensor-core tile
product, underlies the Triton table below (checked on an H200 by
tests/gpu/test_gpu_batch_invariant.py, and by tests/gpu/test_gpu_invariant_matmul.py
for the matmul's tiles of every M bucket).

apply(model) installs a table on a Llama-family model as build_model builds it (dense, Qwen3-MoE, GPT-OSS)
by swapping the kernel objects its modules already dispatch to: Linear's row kernel,
RMSNorm's kernel module, attention's rotary and attention modules, the model's
attention planner, and for MoE layers the router's row kernel and the experts' kernel
(``InvariantExperts``: every (token, choice) pair computed as a row of its own through
the table's matmul, then a token's k outputs added in choice order; a token's output
so never depends on which tokens share its batch, rank or expert). ``install`` does
the module part for any module (a DeepSeek-V4 MoE block, an expert-parallel rank's
experts: shared/model/expert_parallel.py). Two tables:

- on CUDA (and on the CPU for a model built with kernels="triton" under
  TRITON_INTERPRET=1, which is how the kernels are tested): Triton kernels whose
  reduction order per element cannot depend on the batch. ``kernels/invariant_matmul``
  (one block_k per weight, tiles chosen by M among the weight's family, K in one
  order, no split-K),
  ``kernels/invariant_attention`` (one kernel and one KV tiling for decode and prefill
  tokens alike, no split of the keys), and the Triton RMSNorm and rotary kernels as
  they are: the norm reduces each row inside one program whose shape follows the row
  size only, and rotary is elementwise. CUDA graphs stay on: they replay the same
  kernels, and a padded batch row is one more independent row.
- elsewhere (the plain CPU): the PyTorch table above.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.model.attention import write_kv
from shared.model.forward_batch import AttentionMetadata
from shared.model.kernels import triton_module
from shared.model.layers import Linear, RMSNorm, apply_rope
from shared.model.moe import Experts, Router, experts_reference, sum_over_choices
from shared.model.ops import Ops

TILE_ROWS = 16
"""Rows per product tile (queries per attention tile)."""
CHUNK = 64
"""Elements per reduction chunk (keys per attention tile, norm chunk)."""
PAIR_BLOCK_M = 16
"""Rows per block of the fused MoE on the Triton table: one block size whatever the
number of pairs (the normal path picks it from that number)."""


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x with zero rows appended along dim 0 up to a multiple of `multiple`."""
    pad = -x.shape[0] % multiple
    return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) as ceil(M / TILE_ROWS) products of one shape."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    tiles = _pad_rows(x2, TILE_ROWS).view(-1, TILE_ROWS, x2.shape[1])
    out = torch.bmm(tiles, weight.t().unsqueeze(0).expand(tiles.shape[0], -1, -1))
    out = out.view(-1, weight.shape[0])[:m]
    if bias is not None:
        out = out + bias
    return out.view(*lead, weight.shape[0])


invariant_linear.any_rows = True  # type: ignore[attr-defined]
"""layers.linear hands every input to this row kernel, not only single rows."""


def _sum_last(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in a fixed order: chunks of CHUNK, then a sequential scan."""
    n = x.shape[-1]
    pad = -n % CHUNK
    if pad:
        x = F.pad(x, (0, pad))
    partial = x.reshape(*x.shape[:-1], -1, CHUNK).sum(-1)
    return partial.cumsum(-1)[..., -1]


class InvariantNorm:
    """Stands in for the Triton rmsnorm module (same two functions), per row."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(_sum_last(h * h).unsqueeze(-1) / h.shape[-1] + eps)
        if weight.dtype == torch.float32:
            return (weight * h).to(input_dtype)
        return weight * h.to(input_dtype)

    @staticmethod
    def fused_add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + residual
        return InvariantNorm.rms_norm(x, weight, eps), x


@dataclass(slots=True)
class InvariantPlan:
    """One KV group's batch as host lists: each sequence is attended on its own."""

    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    block_size: int
    key_floor: list[int] | None


class InvariantAttention:
    """Stands in for the Triton rotary and attention modules and the model's planner."""

    @staticmethod
    def plan_triton_attention(
        meta: AttentionMetadata, num_kv_heads: int, head_dim: int, device: torch.device
    ) -> InvariantPlan:
        floor = meta.key_floor if meta.key_floor is not None and any(meta.key_floor) else None
        return InvariantPlan(list(meta.query_start_loc), list(meta.seq_lens), meta.block_tables.to(device),
                             meta.block_size, floor)  # fmt: skip

    @staticmethod
    def rotary_embedding_and_store_kv(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # elementwise: invariant as it is
        write_kv(kv_cache, k, v, slot_mapping)
        return q

    @staticmethod
    def triton_attend(
        query: torch.Tensor, kv_cache: torch.Tensor, plan: InvariantPlan, sliding_window: int | None, scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        out = torch.empty_like(query)
        for s, seq_len in enumerate(plan.seq_lens):
            start, end = plan.query_start_loc[s], plan.query_start_loc[s + 1]
            floor = plan.key_floor[s] if plan.key_floor is not None and sliding_window is not None else 0
            out[start:end] = _attend_one(query[start:end], kv_cache, plan.block_tables[s], plan.block_size, seq_len,
                                         sliding_window, floor, scale, sinks)  # fmt: skip
        return out


def _attend_one(
    q: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor, block_size: int, seq_len: int,
    window: int | None, floor: int, scale: float, sinks: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """One sequence's queries q [L, H, D] (positions seq_len - L ..) over its cached keys."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    num_blocks = -(-seq_len // block_size)
    k = kv_cache[0][table[:num_blocks]].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    v = kv_cache[1][table[:num_blocks]].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    k, v = _pad_rows(k, CHUNK).to(q.dtype), _pad_rows(v, CHUNK).to(q.dtype)
    group = num_heads // num_kv_heads
    # [H, kv tiles, CHUNK, D]: the kv head of each query head, as repeat_kv does.
    k = k.transpose(0, 1).repeat_interleave(group, 0).reshape(num_heads, -1, CHUNK, head_dim)
    v = v.transpose(0, 1).repeat_interleave(group, 0).reshape(num_heads, -1, CHUNK, head_dim)
    num_tiles = k.shape[1]
    qt = _pad_rows(q, TILE_ROWS).transpose(0, 1).reshape(num_heads, -1, TILE_ROWS, head_dim)  # [H, q tiles, T, D]
    num_q_tiles = qt.shape[1]
    # Every (head, q tile, kv tile) product is one [T, D] x [D, CHUNK] matrix: a batch of one shape.
    a = qt.unsqueeze(2).expand(-1, -1, num_tiles, -1, -1).reshape(-1, TILE_ROWS, head_dim)
    b = k.unsqueeze(1).expand(-1, num_q_tiles, -1, -1, -1).reshape(-1, CHUNK, head_dim)
    scores = torch.bmm(a, b.transpose(1, 2)).view(num_heads, num_q_tiles, num_tiles, TILE_ROWS, CHUNK) * scale
    q_pos = seq_len - num_q + torch.arange(num_q_tiles * TILE_ROWS, device=q.device).view(num_q_tiles, 1, TILE_ROWS, 1)
    k_pos = torch.arange(num_tiles * CHUNK, device=q.device).view(1, num_tiles, 1, CHUNK)
    allowed = (k_pos <= q_pos) & (k_pos < seq_len)
    if window is not None:
        allowed &= (q_pos - k_pos < window) & (k_pos >= floor)
    scores = scores.float().masked_fill(~allowed, float("-inf"))
    # Max over every key (exact in any order); the sink's logit joins it.
    m = scores.amax(dim=(2, 4), keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.float().view(num_heads, 1, 1, 1, 1))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # padded query rows: nothing allowed
    e = torch.exp(scores - m)
    total = e.sum(-1).cumsum(2)[:, :, -1]  # [H, q tiles, T]: per kv tile, then over tiles in order
    if sinks is not None:
        total = total + torch.exp(sinks.float().view(num_heads, 1, 1) - m[:, :, 0, :, 0])
    pv_a = e.to(v.dtype).reshape(-1, TILE_ROWS, CHUNK)
    pv_b = v.unsqueeze(1).expand(-1, num_q_tiles, -1, -1, -1).reshape(-1, CHUNK, head_dim)
    pv = torch.bmm(pv_a, pv_b).view(num_heads, num_q_tiles, num_tiles, TILE_ROWS, head_dim)
    out = pv.float().cumsum(2)[:, :, -1] / total.unsqueeze(-1)  # [H, q tiles, T, D]
    return out.reshape(num_heads, -1, head_dim)[:, :num_q].transpose(0, 1).to(q.dtype)


@dataclass(frozen=True, slots=True)
class InvariantExperts:
    """The routed experts with ``fused_moe``'s signature (the Experts module's kernel slot),
    batch-invariant: the (token, choice) pairs become rows of one choice each, token-major,
    computed by the table's per-row-invariant products (the PyTorch path with
    ``invariant_linear``, or the fused MoE at one block size), each weighted as the
    normal path weighs it; then each token's k rows are added in choice order. An
    expert-parallel rank computes the pairs it receives by this same kernel (k = 1), so
    its rows are bitwise the single process's."""

    triton: bool

    @property
    def host_sync_free(self) -> bool:
        """The fused MoE never reads the device; the PyTorch path reads its run lengths."""
        return self.triton

    def __call__(
        self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
        *, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None, activation: str = "silu",
        swiglu_limit: float | None = None, swiglu_alpha: float = 1.702,
    ) -> torch.Tensor:  # fmt: skip
        num_tokens, k = ids.shape
        rows = x.repeat_interleave(k, dim=0) if k > 1 else x
        pair_ids, pair_weights = ids.reshape(-1, 1), weights.reshape(-1, 1)
        if self.triton:
            fused_moe = triton_module("fused_moe").fused_moe
            per_pair = fused_moe(
                rows, gate_up, down, pair_ids, pair_weights, gate_up_bias=gate_up_bias, down_bias=down_bias,
                activation=activation, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha, block_m=PAIR_BLOCK_M,
            )  # fmt: skip
        else:
            per_pair = experts_reference(
                rows, pair_ids, pair_weights, gate_up, down, gate_up_bias, down_bias, activation, swiglu_limit,
                swiglu_alpha, matmul=invariant_linear,
            )  # fmt: skip
        # The hidden size spelled out: an expert-parallel rank may receive no pairs at all,
        # and a view of 0 elements cannot infer a -1.
        return sum_over_choices(per_pair.view(num_tokens, k, per_pair.shape[-1]))


def uses_triton_table(model: torch.nn.Module) -> bool:
    """Whether apply() installs the Triton table: on CUDA always; on the CPU only for a
    model built with Triton kernels (kernels="triton", under TRITON_INTERPRET=1)."""
    device = next(model.parameters()).device
    return device.type == "cuda" or (bool(getattr(model, "use_triton", False)) and os.environ.get("TRITON_INTERPRET") == "1")


def invariant_ops(triton: bool) -> Ops:
    """A batch-invariant table (see the module docstring): the Triton one, or the PyTorch one.
    No batch-1 fused GEMV (a second code path for one row); the activation is left as the
    model was built (elementwise, hence invariant already); the experts: ``InvariantExperts``."""
    if triton:
        matmul = triton_module("invariant_matmul").invariant_matmul
        attention = triton_module("invariant_attention")
        return Ops(
            "batch_invariant_triton", triton=True, gemv=matmul, rmsnorm=triton_module("rmsnorm"),
            rotary=triton_module("rotary"), attention=attention, fused_moe=InvariantExperts(triton=True),
        )  # fmt: skip
    invariant = InvariantAttention()
    return Ops(
        "batch_invariant_torch", triton=False, gemv=invariant_linear, rmsnorm=InvariantNorm(),
        rotary=invariant, attention=invariant, fused_moe=InvariantExperts(triton=False),
    )  # fmt: skip


def apply(model: torch.nn.Module) -> None:
    """Install the table on a model just built (see the module docstring), for its life:
    its kernels, taken from ``invariant_ops``, in the slots its modules already dispatch to.
    ``build_model(..., batch_invariant=True)`` calls it, the one place that chooses a table."""
    from shared.model.models.llama import Attention, LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM) or not all(
        isinstance(layer.self_attn, Attention) for layer in model.model.layers
    ):
        raise ValueError("batch_invariant supports Llama-family models only (dense, Qwen3-MoE, GPT-OSS)")
    ops = invariant_ops(uses_triton_table(model))
    # The Triton table: every kernel of the forward is invariant, so a captured decode graph
    # is too. The PyTorch one: no CUDA graphs (they capture the Triton path).
    model.use_triton = ops.triton
    model._triton_attention = ops.attention
    model._gemv = ops.gemv  # the logits' product (lm_head or the tied embeddings)
    install(model, ops)
    model.batch_invariant = True


def install(module: torch.nn.Module, ops: Ops) -> None:
    """Put the table's kernels in the slots of ``module`` and its children: Linear's row
    kernel, RMSNorm's kernel, attention's rotary and attention, a MoE router's row kernel
    and the routed experts' kernel. Experts kept packed in MXFP4 are refused (their
    kernel is not made invariant)."""
    from shared.model.models.llama import Attention

    for child in module.modules():
        if isinstance(child, Linear):
            child._gemv = ops.gemv
        elif isinstance(child, RMSNorm):
            child._triton = ops.rmsnorm
        elif isinstance(child, Attention):
            child._rotary = ops.rotary
            child._attention = ops.attention
        elif isinstance(child, Router):
            child._gemv = ops.gemv
        elif isinstance(child, Experts):
            if child.mxfp4:
                raise ValueError("batch_invariant does not cover experts kept packed in MXFP4: load them dequantised")
            child._fused_moe = ops.fused_moe
        if hasattr(child, "_gated_gemv"):
            child._gated_gemv = ops.gated_gemv  # None: the MLP's batch-1 fused GEMV is a second code path
