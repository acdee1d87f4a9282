"""The routed experts with MXFP4 weights (GPT-OSS's release), dequantised in registers.

The same two grouped GEMMs as shared/model/kernels/fused_moe.py (its ``align_by_expert``
layout, its activation epilogue, the per-pair rows summed after), but each weight tile
is read packed: ``blocks`` uint8 [E, rows, cols / 2], two e2m1 values a byte (the low
nibble first), and ``scales`` uint8 [E, rows, cols / 32], one E8M0 exponent per 32
values of a row (2^(b - 127)); rows are the ``F.linear`` weight's (output features),
cols its inputs, as the checkpoint's ``*_blocks`` / ``*_scales`` hold them.

A tile is decoded from bits with integer ops only: e2m1 ``s eem`` is m / 2 for e = 0,
else (2 + m) * 2^(e - 2); the scale is the float32 whose exponent field is b (b = 0:
2^-127, the subnormal with bit 22 set). Every value e2m1 * 2^(b - 127) is exact in
float32 and, for the exponents a checkpoint holds, in bfloat16 and float16 too, so the
tile cast to the activations' dtype equals the dequantised weight the PyTorch path
multiplies by: the two paths differ only by summation order.

Memory: a weight is read as half a byte a value plus a byte per 32, about a quarter of
bf16's traffic. Each byte is loaded for both of its nibbles (the second load hits the
cache): simple before fast.

Reference: ``fused_moe_mxfp4_ref`` (dequantise, then the PyTorch experts).
"""

import torch
import triton
import triton.language as tl

from shared.model.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_device, check_tensor
from shared.model.kernels.fused_moe import ACTIVATIONS, ExpertBlocks, _gated, _power_of_two, align_by_expert, default_block_m
from shared.model.kernels.paged_common import dot_precision
from shared.model.kernels.rounding import round_to
from shared.model.moe import experts_reference
from shared.model.quantized import FP4_GROUP, dequantize_fp4_groups

__all__ = ["fused_moe_mxfp4", "fused_moe_mxfp4_ref"]


@triton.jit
def _mxfp4_tile(blocks_ptr, scales_ptr, rows, ks, mask, stride_bn, stride_sn):
    """float32 [BLOCK_K, BLOCK_N]: w[rows[n], ks[k]] decoded from the packed bytes
    (``rows`` int64 [BLOCK_N] of one expert's weight, ``ks`` [BLOCK_K] input columns)."""
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


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_mxfp4_kernel(
    x_ptr, blocks_ptr, scales_ptr, bias_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, top_k, hidden, inter, gate_row_step, up_row_offset, alpha, limit,
    stride_x, stride_be, stride_bn, stride_se, stride_sn, stride_biase, stride_out,
    HAS_BIAS: tl.constexpr, GPT_OSS: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """fused_moe's ``_gate_up_kernel`` with the gate and up tiles decoded from MXFP4."""
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
    blocks_e = blocks_ptr + expert * stride_be
    scales_e = scales_ptr + expert * stride_se
    dtype = out_ptr.dtype.element_ty
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = _mxfp4_tile(blocks_e, scales_e, gate_rows, ks, w_mask, stride_bn, stride_sn).to(dtype)
        wu = _mxfp4_tile(blocks_e, scales_e, up_rows, ks, w_mask, stride_bn, stride_sn).to(dtype)
        acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        b_expert = bias_ptr + expert * stride_biase
        acc_g += tl.load(b_expert + gate_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_expert + up_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    h = _gated(round_to(acc_g, dtype), round_to(acc_u, dtype), alpha, limit, dtype, GPT_OSS, HAS_LIMIT)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, h.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_mxfp4_kernel(
    h_ptr, blocks_ptr, scales_ptr, bias_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, hidden, inter,
    stride_h, stride_be, stride_bn, stride_se, stride_sn, stride_biase, stride_out,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """fused_moe's ``_down_kernel`` with the down tile decoded from MXFP4."""
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
    blocks_e = blocks_ptr + expert * stride_be
    scales_e = scales_ptr + expert * stride_se
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = _mxfp4_tile(blocks_e, scales_e, w_rows, ks, k_ok[:, None] & col_ok[None, :], stride_bn, stride_sn)
        acc = tl.dot(a, w.to(dtype), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_biase + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    routing = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    y = round_to(round_to(acc, dtype) * routing[:, None], dtype)
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, y.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def _check_packed(name: str, blocks: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int, int], device: torch.device) -> None:
    """``blocks`` [E, rows, cols / 2] and ``scales`` [E, rows, cols / 32], uint8, for a weight of ``shape``."""
    e, rows, cols = shape
    if cols % FP4_GROUP:
        raise ValueError(f"{name}: MXFP4 needs the input width to be a multiple of {FP4_GROUP}, got {cols}")
    check_tensor(f"{name}_blocks", blocks, ndim=3, dtypes=(torch.uint8,), device=device, shape=(e, rows, cols // 2))
    check_tensor(f"{name}_scales", scales, ndim=3, dtypes=(torch.uint8,), device=device, shape=(e, rows, cols // FP4_GROUP))


def fused_moe_mxfp4(
    x: torch.Tensor,
    gate_up_blocks: torch.Tensor,
    gate_up_scales: torch.Tensor,
    down_blocks: torch.Tensor,
    down_scales: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: str = "gpt_oss",
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 32,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """``fused_moe`` with packed weights: gate_up [E, 2I, hidden] as blocks [E, 2I, hidden / 2]
    and scales [E, 2I, hidden / 32]; down [E, hidden, I] as [E, hidden, I / 2] and
    [E, hidden, I / 32]. x [T, hidden], ids and weights [T, k] -> [T, hidden] in x's dtype."""
    device = x.device
    check_device(device)
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    num_tokens, hidden = x.shape
    num_experts, two_inter = gate_up_blocks.shape[:2]
    if two_inter % 2:
        raise ValueError(f"gate_up holds gate and up rows, so dimension 1 must be even, got {two_inter}")
    inter = two_inter // 2
    _check_packed("gate_up", gate_up_blocks, gate_up_scales, (num_experts, two_inter, hidden), device)
    _check_packed("down", down_blocks, down_scales, (num_experts, hidden, inter), device)
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
    # A K tile inside one scale group: its 32 values share an exponent byte.
    if block_k > FP4_GROUP:
        raise ValueError(f"block_k must be at most {FP4_GROUP} (one scale per K tile's rows), got {block_k}")
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros((num_tokens, hidden), dtype=x.dtype, device=device)
    blocks: ExpertBlocks = align_by_expert(ids, num_experts, block_m or default_block_m(num_pairs, num_experts))
    for name, value in (("block_m", blocks.block_m), ("block_n", block_n), ("block_k", block_k)):
        _power_of_two(name, value)
    weights = weights.contiguous()
    num_blocks = blocks.block_expert.shape[0]
    h = torch.empty((blocks.sorted_pairs.shape[0], inter), dtype=x.dtype, device=device)
    gate_row_step, up_row_offset = (2, 1) if activation == "gpt_oss" else (1, inter)
    precision = dot_precision(x.dtype)
    _gate_up_mxfp4_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, gate_up_blocks, gate_up_scales, gate_up_scales if gate_up_bias is None else gate_up_bias, h,
        blocks.sorted_pairs, blocks.block_expert,
        num_pairs, top_k, hidden, inter, gate_row_step, up_row_offset, swiglu_alpha,
        0.0 if swiglu_limit is None else swiglu_limit,
        x.stride(0), gate_up_blocks.stride(0), gate_up_blocks.stride(1), gate_up_scales.stride(0),
        gate_up_scales.stride(1), 0 if gate_up_bias is None else gate_up_bias.stride(0), h.stride(0),
        HAS_BIAS=gate_up_bias is not None, GPT_OSS=activation == "gpt_oss", HAS_LIMIT=swiglu_limit is not None,
        DOT_PRECISION=precision, BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=device)
    _down_mxfp4_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, down_blocks, down_scales, down_scales if down_bias is None else down_bias, weights, per_pair,
        blocks.sorted_pairs, blocks.block_expert,
        num_pairs, hidden, inter,
        h.stride(0), down_blocks.stride(0), down_blocks.stride(1), down_scales.stride(0), down_scales.stride(1),
        0 if down_bias is None else down_bias.stride(0), per_pair.stride(0),
        HAS_BIAS=down_bias is not None, DOT_PRECISION=precision,
        BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)


def dequantize_packed(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, rows, cols] in ``dtype`` on blocks' device from blocks [E, rows, cols / 2] and
    scales [E, rows, cols / 32] (decoded on the CPU, as the loader decodes them)."""
    return dequantize_fp4_groups(blocks.cpu(), scales.cpu()).to(blocks.device, dtype)


def fused_moe_mxfp4_ref(
    x: torch.Tensor,
    gate_up_blocks: torch.Tensor,
    gate_up_scales: torch.Tensor,
    down_blocks: torch.Tensor,
    down_scales: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: str = "gpt_oss",
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
) -> torch.Tensor:
    """The reference: the weights dequantised (shared/model/quantized.py) into x's dtype,
    then the model's PyTorch experts."""
    gate_up = dequantize_packed(gate_up_blocks, gate_up_scales, x.dtype)
    down = dequantize_packed(down_blocks, down_scales, x.dtype)
    return experts_reference(x, ids, weights, gate_up, down, gate_up_bias, down_bias, activation, swiglu_limit, swiglu_alpha)
