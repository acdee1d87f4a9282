"""Dequantisation (shared/model/quantized.py) against transformers' own readers of the
same formats, and the release writers' quantisers (tools/release_formats.py) within
each format's rounding error.

The bounds, per element x with scale s (the power of two a tile or group shares):
- e4m3 keeps 3 mantissa bits: a normal value rounds within half a step, 2^-4 |x|; below
  the smallest normal (2^-6 s) the step is 2^-9 s, so |err| <= 2^-4 |x| + 2^-10 s;
- e2m1's steps are 0.5 in [0, 2), 1 in [2, 4), 2 in [4, 6]: |err| <= max(|x| / 4, s / 4).
"""

import pytest
import torch

from shared.model.quantized import (
    E8M0_DTYPE, FP8_DTYPE, dequantize_fp4_groups, dequantize_fp8_blocks, dequantize_mxfp4, unpack_fp4,
)  # fmt: skip
from tools.release_formats import quantize_fp4_groups, quantize_fp8_blocks

transformers = pytest.importorskip("transformers")


def _fp8_codes(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random e4m3 bytes, NaN (0x7F, 0xFF) steered off."""
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    return codes.view(FP8_DTYPE)


def _e8m0(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(118, 136, shape, generator=g, dtype=torch.uint8).view(E8M0_DTYPE)


@pytest.mark.parametrize("shape", [(300, 200), (2, 256, 384), (64, 24)])
@pytest.mark.parametrize("scale_kind", ["e8m0", "float32"])
def test_fp8_blocks_equal_transformers(shape: tuple[int, ...], scale_kind: str) -> None:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    g = torch.Generator().manual_seed(0)
    weight = _fp8_codes(shape, g)
    tiles = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))  # ragged edges round up
    scale = _e8m0(tiles, g) if scale_kind == "e8m0" else torch.rand(tiles, generator=g) + 0.01
    ours = dequantize_fp8_blocks(weight, scale, (128, 128))
    theirs = _dequantize_fp8_weight(weight, scale, [128, 128], torch.float32)
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs)
    # Each tile has its own scale: the last (ragged) tile is not the first one's.
    assert torch.equal(ours[..., -1, -1], weight[..., -1, -1].float() * scale[..., -1, -1].float())


def test_fp4_groups_equal_transformers() -> None:
    """DeepSeek-V4's FP4 experts as transformers' fp8 integration reads them (int8 bytes,
    low nibble first, an E8M0 scale per 32 values of a row)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(1)
    packed = torch.randint(-128, 128, (96, 64), generator=g, dtype=torch.int8)
    scale = _e8m0((96, 4), g)
    ours = dequantize_fp4_groups(packed, scale)
    theirs = Fp8Dequantize(None)._dequantize_one(packed, scale, torch.float32)
    assert ours.shape == (96, 128) and torch.equal(ours, theirs)
    # The low nibble is the first value: byte 0x71 is (0.5, 6.0) times the scale.
    one = torch.tensor([[0x71] + [0] * 15], dtype=torch.uint8)
    assert unpack_fp4(one)[0, :2].tolist() == [0.5, 6.0]


def test_mxfp4_equals_transformers_convert_moe_packed_tensors() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 136, (3, 40, 4), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    # transformers returns GPT-OSS's layout (x @ W): the stored grid transposed.
    assert ours.shape == (3, 40, 128) and torch.equal(ours.transpose(1, 2), theirs)


def test_scales_that_do_not_fit_are_refused_with_both_shapes() -> None:
    g = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError, match=r"scale shape \(2, 2\) does not fit weight \(300, 200\).*expected \(3, 2\)"):
        dequantize_fp8_blocks(_fp8_codes((300, 200), g), _e8m0((2, 2), g), (128, 128))
    with pytest.raises(ValueError, match=r"expected \(8, 2\)"):
        dequantize_fp4_groups(torch.zeros(8, 32, dtype=torch.int8), _e8m0((8, 1), g))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8_blocks(torch.zeros(8, 8), torch.ones(1, 1), (128, 128))


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float"])
def test_fp8_quantiser_within_e4m3_rounding(scale_fmt: str) -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(300, 200, generator=g) * torch.linspace(0.01, 3, 200)  # tiles of different ranges
    codes, scale, decoded = quantize_fp8_blocks(w, (128, 128), scale_fmt)
    assert codes.dtype == FP8_DTYPE and scale.shape == (3, 2)
    assert scale.dtype == (E8M0_DTYPE if scale_fmt == "ue8m0" else torch.float32)
    assert torch.equal(dequantize_fp8_blocks(codes, scale, (128, 128)), decoded)
    s = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    err = (decoded - w).abs()
    assert (err <= 2**-4 * w.abs() + 2**-10 * s).all()
    big = w.abs() > s  # well inside the normal range: the 3-bit mantissa alone
    assert 2**-7 < (err[big] / w.abs()[big]).max() <= 2**-4
    # ue8m0 scales are powers of two no more than twice amax / 448.
    if scale_fmt == "ue8m0":
        assert torch.equal(torch.log2(scale.float()), torch.log2(scale.float()).round())


def test_fp4_quantiser_within_e2m1_rounding() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 96, generator=g) * torch.linspace(0.01, 2, 96)
    packed, scale, decoded = quantize_fp4_groups(w)
    assert packed.shape == (48, 48) and scale.shape == (48, 3) and scale.dtype == E8M0_DTYPE
    assert torch.equal(dequantize_fp4_groups(packed, scale), decoded)
    s = scale.float().repeat_interleave(32, 1)
    err = (decoded - w).abs()
    assert (err <= torch.maximum(w.abs(), s) / 4).all()
    assert err.max() > 0.05 * w.abs().max()  # FP4 is coarse: the bound is not vacuous
