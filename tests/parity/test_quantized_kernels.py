"""The kernels of quantised weights kept quantised, on the CPU under Triton's interpreter
(which loads, converts and multiplies float8_e4m3fn tiles: checked here by the FP8 GEMM
equalling its reference): the block-scaled FP8 GEMM (shared/model/kernels/fp8_gemm.py)
against ``fp8_linear_ref`` on small ragged shapes, the MXFP4 fused MoE against the fused
MoE on the dequantised weights (equal bit for bit: the tile decoded in registers is the
dequantised weight exactly, and the loops are the same), and a tiny GPT-OSS released with
MXFP4 experts, kept packed with kernels="triton", against the same release dequantised.

TRITON_INTERPRET must be set before any kernel module is imported (see test_kernels).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from shared.model.fp8_linear import Fp8Linear, fp8_linear_ref  # noqa: E402
from shared.model.kept_weights import KeptFormats  # noqa: E402
from shared.model.kernels import fp8_gemm  # noqa: E402
from shared.model.kernels.fused_moe import fused_moe  # noqa: E402
from shared.model.kernels.fused_moe_mxfp4 import fused_moe_mxfp4, fused_moe_mxfp4_ref  # noqa: E402
from shared.model.loader import load_model  # noqa: E402
from shared.model.moe import Experts  # noqa: E402
from tests.helpers.deepseek_v4_models import save_tiny_v4  # noqa: E402
from tests.helpers.hf_models import save_tiny_hf_model  # noqa: E402
from tests.helpers.numerics import rel_err  # noqa: E402
from tests.helpers.paged_driver import PagedDriver  # noqa: E402
from tools import release_formats as rf  # noqa: E402

if not isinstance(fp8_gemm._fp8_gemm_kernel, InterpretedFunction):
    raise RuntimeError("the kernel modules were imported before TRITON_INTERPRET=1 was set: they would not run on the CPU")

BLOCK = (128, 128)


@pytest.mark.parametrize("m,n,k", [(1, 96, 200), (5, 300, 256), (33, 130, 70)])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float"])
def test_fp8_gemm_equals_its_reference(m, n, k, scale_fmt):
    g = torch.Generator().manual_seed(m + n)
    codes, scale, values = rf.quantize_fp8_blocks(torch.randn(n, k, generator=g) / k**0.5, BLOCK, scale_fmt)
    x = torch.randn(m, k, generator=g)
    y = fp8_gemm.fp8_linear(x, codes, scale.float(), BLOCK)
    ref = fp8_linear_ref(x, codes, scale.float(), BLOCK)
    # The same quantised operands, summed group by group vs in one float32 matmul.
    assert ((y - ref).abs() <= 1e-5 * (x.abs() @ values.abs().T) + 1e-7).all(), (y - ref).abs().max()
    # A wrong weight-scale row per column tile (all tiles the first's) is seen where tiles differ.
    if scale.shape[0] > 1 and not torch.equal(scale[0], scale[1]):
        flat = scale.float()[:1].expand_as(scale).contiguous()
        assert not torch.allclose(fp8_gemm.fp8_linear(x, codes, flat, BLOCK), ref, atol=1e-4)


def test_fp8_gemm_refuses_what_it_cannot_run():
    codes, scale, _ = rf.quantize_fp8_blocks(torch.randn(64, 128), BLOCK, "float")
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_gemm.fp8_linear(torch.randn(2, 128), codes, scale.T.contiguous().repeat(2, 1), BLOCK)
    with pytest.raises(ValueError, match="power of two"):
        fp8_gemm.fp8_linear(torch.randn(2, 128), codes, scale.float(), (128, 96))


def mxfp4_inputs(dtype: torch.dtype, num_tokens: int, seed: int) -> tuple[list[torch.Tensor], dict, dict]:
    g = torch.Generator().manual_seed(seed)
    e, hidden, inter, k = 4, 64, 32, 2
    gu_blocks, gu_scales, gu = rf.quantize_fp4_groups(torch.randn(e, 2 * inter, hidden, generator=g) / 8)
    dn_blocks, dn_scales, dn = rf.quantize_fp4_groups(torch.randn(e, hidden, inter, generator=g) / 6)
    packed = [gu_blocks, gu_scales.view(torch.uint8), dn_blocks, dn_scales.view(torch.uint8)]
    common = dict(
        x=torch.randn(num_tokens, hidden, generator=g).to(dtype),
        ids=torch.rand(num_tokens, e, generator=g).topk(k, dim=-1).indices,
        weights=torch.rand(num_tokens, k, generator=g).to(dtype),
        gate_up_bias=torch.randn(e, 2 * inter, generator=g).to(dtype),
        down_bias=torch.randn(e, hidden, generator=g).to(dtype),
        activation="gpt_oss",
        swiglu_limit=7.0,
    )
    return packed, common, dict(gate_up=gu.to(dtype), down=dn.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_mxfp4_moe_equals_the_fused_moe_on_the_dequantised_weights(dtype, num_tokens):
    packed, common, dense = mxfp4_inputs(dtype, num_tokens, seed=num_tokens)
    x, ids, weights = common.pop("x"), common.pop("ids"), common.pop("weights")
    out = fused_moe_mxfp4(x, *packed, ids, weights, **common)
    assert torch.equal(out, fused_moe(x, dense["gate_up"], dense["down"], ids, weights, **common))
    ref = fused_moe_mxfp4_ref(x, *packed, ids, weights, **common)
    torch.testing.assert_close(out, ref, rtol=1e-3 if dtype == torch.float16 else 1e-5, atol=1e-3 if dtype == torch.float16 else 1e-5)
    # A nibble read from the wrong half of its byte is seen.
    swapped = ((packed[0] >> 4) | (packed[0] << 4)).to(torch.uint8)
    assert not torch.allclose(fused_moe_mxfp4(x, swapped, *packed[1:], ids, weights, **common), out)


def test_v4_kept_fp8_and_fp4_through_the_kernels(tmp_path: Path):
    """DeepSeek's release of a tiny V4 (FP8 linears, FP4 experts) with both kept, on the
    Triton kernels: the experts give exactly the dequantised experts' logits (same FP8
    linears beside them), and each FP8 linear, on the input it receives while the model
    runs, gives its PyTorch reference's output within float32 summation order. (Logits
    of the Triton and PyTorch runs are not compared: activation quantisation is a step
    function, so a last-bit difference upstream can move a code by a whole e4m3 step.)"""
    seeded = save_tiny_v4("mixed", tmp_path / "seeded", seed=11, hidden_size=256, head_dim=64, q_lora_rank=192,
                          o_lora_rank=64, moe_intermediate_size=64)  # fmt: skip
    release = rf.write_v4_deepseek(seeded, tmp_path / "released", tmp_path / "reference")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (40, 23)]

    checked: list[float] = []

    def same_as_reference(module: Fp8Linear, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        ref = fp8_linear_ref(x, module.weight, module.weight_scale, module.block)
        checked.append(rel_err(output.reshape(ref.shape), ref))

    def logits(keep: KeptFormats) -> torch.Tensor:
        model = load_model(release, kernels="triton", keep=keep)
        for m in model.modules():
            if isinstance(m, Fp8Linear):
                assert m._kernel is not None
                m.register_forward_hook(same_as_reference)
        out = PagedDriver(model, num_seqs=2, num_blocks=64, block_size=16).step(dict(enumerate(prompts)))
        return torch.cat([out[0], out[1]])

    assert torch.equal(logits(KeptFormats(fp8=True, mxfp4=True)), logits(KeptFormats(fp8=True)))
    assert len(checked) >= 2 * 22 and max(checked) < 1e-5, max(checked)


@pytest.fixture(scope="module")
def gpt_oss_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gpt_oss")
    seeded = save_tiny_hf_model("gpt_oss", root / "seeded", seed=1)
    return rf.write_gpt_oss_mxfp4(seeded, root / "released", root / "reference")


def test_gpt_oss_mxfp4_kept_through_the_kernel_gives_the_dequantised_logits(gpt_oss_release: Path):
    kept = load_model(gpt_oss_release, kernels="triton", keep=KeptFormats(mxfp4=True))
    dequantised = load_model(gpt_oss_release, kernels="triton")
    experts = [m for m in kept.modules() if isinstance(m, Experts)]
    assert experts and all(m.mxfp4 and m.host_sync_free for m in experts)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, kept.config.vocab_size, (n,), generator=g).tolist() for n in (5, 13)]
    outs = []
    for model in (kept, dequantised):
        driver = PagedDriver(model, num_seqs=2, num_blocks=32, block_size=4)
        first = driver.step(dict(enumerate(prompts)))
        then = driver.step({s: [p[0]] for s, p in enumerate(prompts)})
        outs.append(torch.cat([first[0], first[1], then[0], then[1]]))
    assert torch.equal(outs[0], outs[1])
