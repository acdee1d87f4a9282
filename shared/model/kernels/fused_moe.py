"""The routed experts of a MoE layer in two grouped GEMMs, with no host sync.

1. ``align_by_expert`` (PyTorch ops on the device): the (token, choice) pairs are
   sorted by expert and each expert's run is padded to a multiple of BLOCK_M rows,
   so that every block of BLOCK_M sorted rows belongs to one expert. The number of
   sorted rows is an upper bound known from the shapes alone
   (``pairs + min(E, pairs) * (BLOCK_M - 1)``); blocks past the real ones are
   marked expert -1 and exit at once. Nothing is read back to the host, so the
   launch grid never depends on the routing: a CUDA graph can hold it.
2. ``_gate_up_kernel``: per block of rows, the gathered tokens times its expert's
   gate and up rows (gate then up halves for SiLU experts, interleaved for GPT-OSS),
   biases added, then the activation (SiLU-and-mul with the optional ``swiglu_limit``
   clamp, or GPT-OSS's clamped ``(up + 1) * gate * sigmoid(alpha * gate)``) fused
   into the epilogue: one [rows, I] intermediate and no [rows, 2I] one.
3. ``_down_kernel``: the intermediate times the expert's down projection, bias added,
   times the pair's routing weight, stored at the pair's own row (token-major order:
   row ``token * k + choice``); the k rows of a token are then summed. Scattering to
   fixed rows and summing, rather than adding with atomics, keeps the result the
   same for any launch order.

Every product accumulates in float32; results are rounded to the model dtype where
the reference (the model's PyTorch path, ``moe.experts_reference``) rounds between
its separate ops, so the two agree to float rounding.

Reference: ``fused_moe_ref``.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.model.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_device, check_tensor
from shared.model.kernels.paged_common import dot_precision
from shared.model.kernels.rounding import round_to
from shared.model.moe import experts_reference

__all__ = ["ExpertBlocks", "align_by_expert", "fused_moe", "fused_moe_ref"]

ACTIVATIONS: tuple[str, ...] = ("silu", "gpt_oss")


@dataclass(frozen=True, slots=True)
class ExpertBlocks:
    """The (token, choice) pairs laid out by expert in blocks of ``block_m`` rows."""

    sorted_pairs: torch.Tensor
    """[num_rows] int32: the pair (``token * k + choice``) each sorted row holds;
    ``num_pairs`` on padding rows."""
    block_expert: torch.Tensor
    """[num_rows // block_m] int32: the expert of each block; -1 for unused blocks."""
    counts: torch.Tensor
    """[num_experts] int64: pairs per expert (the layer's tokens per expert)."""
    block_m: int


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """ids [T, k] (expert of each choice) -> the sorted, padded layout. Device ops only:
    no result is read on the host and every shape follows from T, k, E and block_m."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    # scatter_add_, not bincount: bincount sizes its output from the data (a sync on CUDA).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = torch.sort(flat, stable=True).indices  # pairs by expert, token order within one
    expert_of_sorted = flat[order]
    rank = torch.arange(num_pairs, device=device) - start[expert_of_sorted]
    dest = padded_start[expert_of_sorted] + rank
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_rows = triton.cdiv(bound, block_m) * block_m
    sorted_pairs = torch.full((num_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, num_rows, block_m, device=device)
    # The block starting at row r belongs to the first expert whose padded run ends after r.
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertBlocks(sorted_pairs, block_expert, counts, block_m)


@triton.jit
def _gated(g, u, alpha, limit, dtype: tl.constexpr, GPT_OSS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """The activation of float32 gate and up (already rounded to ``dtype``), rounded
    after each op as PyTorch's separate elementwise ops are."""
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    if GPT_OSS:
        scaled = round_to(g * alpha, dtype)
        sig = round_to(1.0 / (1.0 + tl.exp(-scaled)), dtype)
        glu = round_to(g * sig, dtype)
        return round_to(round_to(u + 1.0, dtype) * glu, dtype)
    else:
        silu = round_to(g / (1.0 + tl.exp(-g)), dtype)
        return round_to(silu * u, dtype)


# Values that change from step to step are never specialised on (no recompiles while serving).
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, top_k, hidden, inter, gate_row_step, up_row_offset, alpha, limit,
    stride_x, stride_we, stride_wn, stride_be, stride_out,
    HAS_BIAS: tl.constexpr, GPT_OSS: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[row, n] = act(gate_n . x[token(row)], up_n . x[token(row)]) for the rows of one
    block and BLOCK_N of the I output columns. Gate row n of the expert's weight is
    ``n * gate_row_step``, up row n is that plus ``up_row_offset``."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    gate_rows = cols.to(tl.int64) * gate_row_step
    up_rows = gate_rows + up_row_offset
    w_expert = w_ptr + expert * stride_we
    dtype = out_ptr.dtype.element_ty
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_expert + gate_rows[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w_expert + up_rows[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        b_expert = bias_ptr + expert * stride_be
        acc_g += tl.load(b_expert + gate_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_expert + up_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    # F.linear rounds its output (bias included) to the model dtype before the activation.
    h = _gated(round_to(acc_g, dtype), round_to(acc_u, dtype), alpha, limit, dtype, GPT_OSS, HAS_LIMIT)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, h.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    h_ptr, w_ptr, bias_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, hidden, inter,
    stride_h, stride_we, stride_wn, stride_be, stride_out,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[pair(row), n] = weight(pair) * (down_n . h[row] + bias_n) for the rows of one
    block and BLOCK_N of the hidden columns."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_ok = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_expert = w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_expert + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    routing = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    y = round_to(round_to(acc, dtype) * routing[:, None], dtype)
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, y.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def _power_of_two(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {value}")


def default_block_m(num_pairs: int, num_experts: int) -> int:
    """Few pairs per expert (decode): small blocks, so little of each is padding."""
    return 16 if num_pairs <= 4 * num_experts else 64


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
    blocks: ExpertBlocks | None = None,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 32,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x [T, hidden]; gate_up [E, 2I, hidden] (each expert's slice an ``F.linear`` weight:
    gate then up halves for "silu", interleaved rows for "gpt_oss"); down [E, hidden, I];
    ids [T, k] int and weights [T, k] (the router's) -> [T, hidden] in x's dtype: the
    sum over the k choices of weight * expert(x). Biases [E, 2I] and [E, hidden] or None.
    ``blocks``: the pairs already aligned (``align_by_expert`` with ``block_m``)."""
    device = x.device
    check_device(device)
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    num_tokens, hidden = x.shape
    check_tensor("gate_up", gate_up, ndim=3, dtypes=(x.dtype,), device=device, shape=(None, None, hidden))
    num_experts, two_inter, _ = gate_up.shape
    if two_inter % 2:
        raise ValueError(f"gate_up holds gate and up rows, so dimension 1 must be even, got {two_inter}")
    inter = two_inter // 2
    check_tensor("down", down, ndim=3, dtypes=(x.dtype,), device=device, shape=(num_experts, hidden, inter))
    check_tensor("ids", ids, ndim=2, dtypes=INDEX_DTYPES, device=device, shape=(num_tokens, None))
    top_k = ids.shape[1]
    check_tensor("weights", weights, ndim=2, dtypes=(x.dtype,), device=device, shape=(num_tokens, top_k))
    if gate_up_bias is not None:
        check_tensor("gate_up_bias", gate_up_bias, ndim=2, dtypes=(x.dtype,), device=device, shape=(num_experts, two_inter))
    if down_bias is not None:
        check_tensor("down_bias", down_bias, ndim=2, dtypes=(x.dtype,), device=device, shape=(num_experts, hidden))
    if (gate_up_bias is None) != (down_bias is None):
        raise ValueError("gate_up_bias and down_bias come together (experts with biases have both)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if activation == "gpt_oss" and swiglu_limit is None:
        raise ValueError("GPT-OSS experts need swiglu_limit")
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros((num_tokens, hidden), dtype=x.dtype, device=device)
    if blocks is None:
        block_m = block_m or default_block_m(num_pairs, num_experts)
        blocks = align_by_expert(ids, num_experts, block_m)
    for name, value in (("block_m", blocks.block_m), ("block_n", block_n), ("block_k", block_k)):
        _power_of_two(name, value)
    weights = weights.contiguous()
    num_blocks = blocks.block_expert.shape[0]
    h = torch.empty((blocks.sorted_pairs.shape[0], inter), dtype=x.dtype, device=device)
    # Gate then up halves: gate row n, up row I + n; interleaved: gate row 2n, up row 2n + 1.
    gate_row_step, up_row_offset = (2, 1) if activation == "gpt_oss" else (1, inter)
    precision = dot_precision(x.dtype)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, gate_up, gate_up if gate_up_bias is None else gate_up_bias, h, blocks.sorted_pairs, blocks.block_expert,
        num_pairs, top_k, hidden, inter, gate_row_step, up_row_offset, swiglu_alpha,
        0.0 if swiglu_limit is None else swiglu_limit,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), 0 if gate_up_bias is None else gate_up_bias.stride(0),
        h.stride(0),
        HAS_BIAS=gate_up_bias is not None, GPT_OSS=activation == "gpt_oss", HAS_LIMIT=swiglu_limit is not None,
        DOT_PRECISION=precision, BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, down, down if down_bias is None else down_bias, weights, per_pair, blocks.sorted_pairs, blocks.block_expert,
        num_pairs, hidden, inter,
        h.stride(0), down.stride(0), down.stride(1), 0 if down_bias is None else down_bias.stride(0),
        per_pair.stride(0),
        HAS_BIAS=down_bias is not None, DOT_PRECISION=precision,
        BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)


def fused_moe_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
) -> torch.Tensor:
    """``fused_moe``'s reference: the model's PyTorch path (one matmul per projection per
    active expert on its run of sorted rows)."""
    return experts_reference(
        x, ids, weights, gate_up, down, gate_up_bias, down_bias, activation, swiglu_limit, swiglu_alpha
    )
