"""The routed experts with MXFP4 weights (GPT-OSS's release), dequantised in registers.

The kernels are fused_moe.py's (its ``align_by_expert`` layout, its activation epilogue,
the per-pair rows summed after) compiled for the MXFP4 weight format: each weight tile
is read packed: ``blocks`` uint8 [E, rows, cols / 2], two e2m1 values a byte (the low
nibble first), and ``scales`` uint8 [E, rows, cols / 32], one E8M0 exponent per 32
values of a row (2^(b - 127)); rows are the ``F.linear`` weight's (output features),
cols its inputs, as the checkpoint's ``*_blocks`` / ``*_scales`` hold them. This module
holds what is MXFP4's own: the packed shapes' checks, the K tile bound, the reference.

Every value e2m1 * 2^(b - 127) is exact in float32 and, for the exponents a checkpoint
holds, in bfloat16 and float16 too, so the tile cast to the activations' dtype equals
the dequantised weight the PyTorch path multiplies by: the two paths differ only by
summation order.

Memory: a weight is read as half a byte a value plus a byte per 32, about a quarter of
bf16's traffic.

Reference: ``fused_moe_mxfp4_ref`` (dequantise, then the PyTorch experts).
"""

import torch

from shared.model.kernels.checks import FLOAT_DTYPES, check_device, check_tensor
from shared.model.kernels.fused_moe import ExpertWeights, launch_fused_moe
from shared.model.moe import experts_reference
from shared.model.quantized import FP4_GROUP, dequantize_fp4_groups

__all__ = ["fused_moe_mxfp4", "fused_moe_mxfp4_ref"]


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
    # A K tile inside one scale group: its 32 values share an exponent byte.
    if block_k > FP4_GROUP:
        raise ValueError(f"block_k must be at most {FP4_GROUP} (one scale per K tile's rows), got {block_k}")
    return launch_fused_moe(
        x, ExpertWeights(gate_up_blocks, gate_up_scales), ExpertWeights(down_blocks, down_scales), ids, weights,
        gate_up_bias=gate_up_bias, down_bias=down_bias, activation=activation, swiglu_limit=swiglu_limit,
        swiglu_alpha=swiglu_alpha, blocks=None, block_m=block_m, block_n=block_n, block_k=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


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
