"""Quantised weights as checkpoints ship them, read back to float32 on the CPU.

Three stored forms, each a data tensor beside a scale tensor:

- **FP8 e4m3 with block scales** (DeepSeek-V3/V4, transformers' ``fp8`` quant method):
  ``X.weight`` float8_e4m3fn [..., rows, cols] and a scale per ``block`` (128 x 128)
  tile, [..., ceil(rows / 128), ceil(cols / 128)]: the last row and column of tiles may
  be ragged. The scale is E8M0 (a power of two, DeepSeek-V4's ``scale_fmt: ue8m0``) or
  float32 (DeepSeek-V3's ``weight_scale_inv``); either way weight = e4m3 value * scale.
- **FP4 e2m1 in groups of 32** (DeepSeek-V4's routed experts, ``expert_dtype: fp4``):
  ``X.weight`` int8 [..., rows, cols / 2], two values a byte, the low nibble first, and
  an E8M0 scale per 32 consecutive values of a row, [..., rows, cols / 32].
- **MXFP4** (GPT-OSS's experts): the same e2m1 nibbles and E8M0 group scales, stored as
  ``X_blocks`` uint8 [..., rows, cols / 32, 16] and ``X_scales`` uint8 [..., rows,
  cols / 32] (a scale byte b means 2^(b - 127)).

Nothing here knows tensor names: the pairing is shared/model/checkpoint_files.py's.
A scale whose shape does not fit its data is a ``ValueError`` that says both shapes.
"""

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
E8M0_DTYPE = torch.float8_e8m0fnu
FP4_GROUP = 32
"""Values per E8M0 scale in MXFP4 and in DeepSeek's FP4 experts (the OCP MX block)."""

# e2m1 by nibble: bit 3 the sign, then two exponent bits and one mantissa bit.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """float32 multipliers of a scale tensor: E8M0 (as float8_e8m0fnu or its raw uint8
    bytes, b -> 2^(b - 127)) or already a float."""
    if scale.dtype == E8M0_DTYPE:
        return scale.float()
    if scale.dtype == torch.uint8:
        # The same bytes viewed as E8M0: exact powers of two, 0xFF is NaN as the format says.
        return scale.view(E8M0_DTYPE).float()
    if scale.dtype.is_floating_point:
        return scale.float()
    raise ValueError(f"a scale of dtype {scale.dtype}: expected float8_e8m0fnu, uint8 (E8M0 bytes) or a float")


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale shape of an FP8 weight ``shape`` in ``block`` tiles, ragged edges rounded up."""
    rows, cols = shape[-2:]
    return (*shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 weight [..., rows, cols] = e4m3 ``weight`` times the scale of its tile."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"an FP8 block-scaled weight of dtype {weight.dtype}: expected {FP8_DTYPE}")
    expected = fp8_scale_shape(tuple(weight.shape), block)
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not fit weight {tuple(weight.shape)} in {block[0]}x{block[1]} "
            f"blocks: expected {expected}"
        )
    rows, cols = weight.shape[-2:]
    out = weight.to(torch.float32)
    # Expand the scales over rows only ([..., rows, col tiles]: small), then multiply the
    # whole column tiles through a view and the ragged last one apart: no second
    # weight-sized tensor.
    per_row = scale_values(scale).repeat_interleave(block[0], dim=-2)[..., :rows, :]
    whole = cols // block[1]
    if whole:
        out[..., : whole * block[1]].unflatten(-1, (whole, block[1])).mul_(per_row[..., :whole, None])
    if cols % block[1]:
        out[..., whole * block[1] :].mul_(per_row[..., whole:])
    return out


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """e2m1 values, float32 [..., 2n], from bytes [..., n] (int8 or uint8), low nibble first."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"packed FP4 of dtype {packed.dtype}: expected int8 or uint8 bytes")
    data = packed.view(torch.uint8)
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    out = torch.empty(*data.shape[:-1], 2 * data.shape[-1], dtype=torch.float32)
    out[..., 0::2] = table[(data & 0x0F).int()]
    out[..., 1::2] = table[(data >> 4).int()]
    return out


def dequantize_fp4_groups(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [..., rows, cols] from FP4 bytes [..., rows, cols / 2] and one scale per
    32 values of a row, [..., rows, cols / 32] (DeepSeek-V4's routed experts)."""
    cols = 2 * packed.shape[-1]
    expected = (*packed.shape[:-1], cols // FP4_GROUP)
    if cols % FP4_GROUP or tuple(scale.shape) != expected:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not fit FP4 weight {tuple(packed.shape)} ({cols} values a row) "
            f"in groups of {FP4_GROUP}: expected {expected}"
        )
    out = unpack_fp4(packed)
    out.unflatten(-1, (cols // FP4_GROUP, FP4_GROUP)).mul_(scale_values(scale)[..., None])
    return out


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., rows, cols] from MXFP4 ``blocks`` [..., rows, cols / 32, 16] and
    ``scales`` [..., rows, cols / 32] (GPT-OSS's ``*_blocks`` / ``*_scales``)."""
    if blocks.shape[-1] != FP4_GROUP // 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: expected blocks "
            f"[..., rows, groups, {FP4_GROUP // 2}] and scales [..., rows, groups]"
        )
    return dequantize_fp4_groups(blocks.flatten(-2), scales)
