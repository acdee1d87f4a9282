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

Both kernels read the weights in one of two formats, chosen at compile time (the
``MXFP4`` constexpr): dense tiles in the activations' dtype, or MXFP4 packed (GPT-OSS's
release, ``fused_moe_mxfp4``) decoded in registers by ``_mxfp4_tile``. Everything else,
from the alignment to the epilogues, is one code for both (``launch_fused_moe``).

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

__all__ = ["ExpertBlocks", "ExpertWeights", "align_by_expert", "fused_moe", "fused_moe_ref", "launch_fused_moe"]

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


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """One projection of every expert as the kernels read it: ``values`` [E, rows, cols] in
    the activations' dtype (dense), or MXFP4 packed: ``values`` uint8 [E, rows, cols / 2]
    and ``scales`` uint8 [E, rows, cols / 32] (kernels/fused_moe_mxfp4.py). Rows are the
    ``F.linear`` weight's output features, cols its inputs."""

    values: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def mxfp4(self) -> bool:
        return self.scales is not None


@triton.jit
def _mxfp4_tile(blocks_ptr, scales_ptr, rows, ks, mask, stride_bn, stride_sn):
    """float32 [BLOCK_K, BLOCK_N]: w[rows[n], ks[k]] decoded from the packed bytes
    (``rows`` int64 [BLOCK_N] of one expert's weight, ``ks`` [BLOCK_K] input columns).
    Two e2m1 values a byte, the low nibble first; one E8M0 exponent per 32 values of a
    row (2^(b - 127)). Integer ops only: e2m1 ``s eem`` is m / 2 for e = 0, else
    (2 + m) * 2^(e - 2); the scale is the float32 whose exponent field is b (b = 0:
    2^-127, the subnormal with bit 22 set). Each byte is loaded for both of its nibbles
    (the second load hits the cache): simple before fast."""
    byte = tl.load(blocks_ptr + rows[None, :] * stride_bn + (ks // 2)[:, None], mask=mask, other=0).to(tl.int32)
    nibble = (byte >> ((ks % 2) * 4)[:, None]) & 0xF
    e = (nibble >> 1) & 3
    m = nibble & 1
    # e = 0: m / 2 (0 or 0.5); else (2 + m) * 2^(e - 2), as the integer (2 + m) << (e - 1) halved.
    twice = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
    magnitude = twice.to(tl.float32) * 0.5
    value = tl.where((nibble & 8) != 0, -magnitude, magnitude)
    b = tl.load(scales_ptr + rows[None, :] * stride_sn + (ks // 32)[:, None], mask=mask, other=127).to(tl.int32)
    scale = tl.where(b == 0, 0x400000, b << 23).to(tl.float32, bitcast=True)
    return value * scale


@triton.jit
def _weight_tile(w_ptr, scales_ptr, rows, ks, mask, stride_wn, stride_sn, dtype: tl.constexpr, MXFP4: tl.constexpr):
    """[BLOCK_K, BLOCK_N] in ``dtype``: w[rows[n], ks[k]] of one expert's weight (``w_ptr``
    and ``scales_ptr`` at that expert), loaded dense or decoded from MXFP4. The MXFP4 tile
    cast to ``dtype`` is the dequantised weight exactly, so the two formats give the same
    products."""
    if MXFP4:
        tile = _mxfp4_tile(w_ptr, scales_ptr, rows, ks, mask, stride_wn, stride_sn).to(dtype)
    else:
        tile = tl.load(w_ptr + rows[None, :] * stride_wn + ks[:, None], mask=mask, other=0.0)
    return tile


# Values that change from step to step are never specialised on (no recompiles while serving).
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr, w_ptr, scales_ptr, bias_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, top_k, hidden, inter, gate_row_step, up_row_offset, alpha, limit,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_out,
    HAS_BIAS: tl.constexpr, GPT_OSS: tl.constexpr, HAS_LIMIT: tl.constexpr, MXFP4: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
    scales_expert = scales_ptr + expert * stride_se
    dtype = out_ptr.dtype.element_ty
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = _weight_tile(w_expert, scales_expert, gate_rows, ks, w_mask, stride_wn, stride_sn, dtype, MXFP4)
        wu = _weight_tile(w_expert, scales_expert, up_rows, ks, w_mask, stride_wn, stride_sn, dtype, MXFP4)
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
    h_ptr, w_ptr, scales_ptr, bias_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, hidden, inter,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_out,
    HAS_BIAS: tl.constexpr, MXFP4: tl.constexpr, DOT_PRECISION: tl.constexpr,
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
    w_rows = cols.to(tl.int64)
    w_expert = w_ptr + expert * stride_we
    scales_expert = scales_ptr + expert * stride_se
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = _weight_tile(w_expert, scales_expert, w_rows, ks, w_mask, stride_wn, stride_sn, dtype, MXFP4)
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


def _scales_args(w: ExpertWeights) -> tuple[torch.Tensor, int, int]:
    """The kernels' scales pointer and strides; dense weights have no scales, and the
    kernel compiled for them never reads the stand-in."""
    if w.scales is None:
        return w.values, 0, 0
    return w.scales, w.scales.stride(0), w.scales.stride(1)


def launch_fused_moe(
    x: torch.Tensor,
    gate_up: ExpertWeights,
    down: ExpertWeights,
    ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    activation: str,
    swiglu_limit: float | None,
    swiglu_alpha: float,
    blocks: ExpertBlocks | None,
    block_m: int | None,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    """What ``fused_moe`` and ``fused_moe_mxfp4`` share once each has checked x and its own
    weights (gate_up [E, 2I, ...] and down [E, hidden, ...] in either format): the routing,
    bias, activation and tile checks, the alignment and the two launches."""
    device = x.device
    num_tokens, hidden = x.shape
    num_experts, two_inter = gate_up.values.shape[:2]
    inter = two_inter // 2
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
    gu_scales, gu_stride_se, gu_stride_sn = _scales_args(gate_up)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, gate_up.values, gu_scales, gate_up.values if gate_up_bias is None else gate_up_bias, h,
        blocks.sorted_pairs, blocks.block_expert,
        num_pairs, top_k, hidden, inter, gate_row_step, up_row_offset, swiglu_alpha,
        0.0 if swiglu_limit is None else swiglu_limit,
        x.stride(0), gate_up.values.stride(0), gate_up.values.stride(1), gu_stride_se, gu_stride_sn,
        0 if gate_up_bias is None else gate_up_bias.stride(0), h.stride(0),
        HAS_BIAS=gate_up_bias is not None, GPT_OSS=activation == "gpt_oss", HAS_LIMIT=swiglu_limit is not None,
        MXFP4=gate_up.mxfp4, DOT_PRECISION=precision, BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=device)
    dn_scales, dn_stride_se, dn_stride_sn = _scales_args(down)
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, down.values, dn_scales, down.values if down_bias is None else down_bias, weights, per_pair,
        blocks.sorted_pairs, blocks.block_expert,
        num_pairs, hidden, inter,
        h.stride(0), down.values.stride(0), down.values.stride(1), dn_stride_se, dn_stride_sn,
        0 if down_bias is None else down_bias.stride(0), per_pair.stride(0),
        HAS_BIAS=down_bias is not None, MXFP4=down.mxfp4, DOT_PRECISION=precision,
        BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)


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
    hidden = x.shape[1]
    check_tensor("gate_up", gate_up, ndim=3, dtypes=(x.dtype,), device=device, shape=(None, None, hidden))
    num_experts, two_inter, _ = gate_up.shape
    if two_inter % 2:
        raise ValueError(f"gate_up holds gate and up rows, so dimension 1 must be even, got {two_inter}")
    check_tensor("down", down, ndim=3, dtypes=(x.dtype,), device=device, shape=(num_experts, hidden, two_inter // 2))
    return launch_fused_moe(
        x, ExpertWeights(gate_up), ExpertWeights(down), ids, weights,
        gate_up_bias=gate_up_bias, down_bias=down_bias, activation=activation, swiglu_limit=swiglu_limit,
        swiglu_alpha=swiglu_alpha, blocks=blocks, block_m=block_m, block_n=block_n, block_k=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


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
