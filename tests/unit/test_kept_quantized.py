"""FP8 kept as FP8 (shared/model/fp8_linear.py, kept_weights.py) and FP4 experts (GPT-OSS's
MXFP4, DeepSeek-V4's FP4) kept packed, on the CPU through their PyTorch references (the Triton kernels under the interpreter:
tests/parity/test_quantized_kernels.py; on a GPU: tests/gpu/test_gpu_quantized_kept.py).

The bound (why): the weights are used exactly as stored (codes times power-of-two or
float32 tile scales), so the only error of the FP8 product against x @ W.T with W
dequantised is the activations' rounding to e4m3: with s = amax(group) / 448, x / s is
rounded to 3 mantissa bits, at most 2^-4 of |x| for a normal code (>= 2^-6), at most
half the subnormal step, 2^-10 s, below; float32's x / s and back add 2^-22 |x|. Through
the product: |err| <= (|W| @ bound(x)) + float32 summation (K 2^-23 |x||W|)."""

import math
from pathlib import Path

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.model.fp8_linear import (
    FP8_MAX, Fp8Linear, activation_error_bound, dequantize_activations, expand_weight_scale, fp8_linear_ref,
    quantize_activations,
)  # fmt: skip
from shared.model.kept_weights import KeptFormats, kept_formats
from shared.model.loader import load_model
from shared.model.moe import Experts
from shared.model.quantized import dequantize_fp4_groups
from tests.helpers.deepseek_v4_models import save_tiny_v4
from tests.helpers.hf_models import save_tiny_hf_model
from tests.helpers.paged_driver import PagedDriver
from tools import release_formats as rf

BLOCK = (128, 128)


def product_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    k = x.shape[1]
    return activation_error_bound(x, BLOCK[1]) @ w.abs().T + k * 2.0**-23 * (x.abs() @ w.abs().T)


def test_activation_quantisation_within_its_bound_and_exact_on_codes():
    g = torch.Generator().manual_seed(0)
    # Ragged K (200 = 128 + 72), a row spanning 2^-12..2^4 so subnormal codes occur, a zero row.
    x = torch.randn(5, 200, generator=g) * torch.logspace(-12, 4, 200, base=2)
    x[3] = 0
    codes, scale = quantize_activations(x, 128)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (5, 256) and scale.shape == (5, 2)
    assert (codes[:, 200:].float() == 0).all()
    back = dequantize_activations(codes, scale, 200)
    err = (back - x).abs()
    assert (err <= activation_error_bound(x, 128)).all()
    assert err.max() > 0 and (back[3] == 0).all()
    # Each group's largest value maps to the largest code: the whole e4m3 range is used.
    assert torch.allclose(codes.float().view(5, 2, 128).abs().amax(-1)[[0, 1, 2, 4]], torch.tensor(FP8_MAX))


@pytest.mark.parametrize("m,n,k", [(1, 96, 200), (9, 300, 256), (33, 130, 70)])
def test_fp8_product_within_the_activation_bound(m, n, k):
    g = torch.Generator().manual_seed(m)
    codes, scale, w = rf.quantize_fp8_blocks(torch.randn(n, k, generator=g) / k**0.5, BLOCK, "ue8m0")
    x = torch.randn(m, k, generator=g)
    y = fp8_linear_ref(x, codes, scale.float(), BLOCK)
    exact = x @ w.T
    err, bound = (y - exact).abs(), product_bound(x, w)
    assert (err <= bound).all(), (err - bound).max()
    assert err.max() > 0  # the activations were rounded
    # Not vacuous: one tile's scale doubled leaves the bound.
    wrong = scale.float().clone()
    wrong[0, 0] *= 2
    assert ((fp8_linear_ref(x, codes, wrong, BLOCK) - exact).abs() > bound).any()


def test_fp8_linear_module_keeps_leading_dims():
    codes, scale, w = rf.quantize_fp8_blocks(torch.randn(64, 160), BLOCK, "float")
    layer = Fp8Linear(160, 64, BLOCK, torch.device("cpu"))
    layer.weight.data.copy_(codes)
    layer.weight_scale.copy_(scale)
    x = torch.randn(2, 3, 160)
    assert torch.equal(layer(x), fp8_linear_ref(x.view(6, 160), codes, scale, BLOCK).view(2, 3, 64))
    assert torch.equal(expand_weight_scale(layer.weight_scale, (64, 160), BLOCK) * codes.float(), w)


def test_the_cpu_keeps_nothing_and_the_setting_is_validated():
    assert kept_formats("keep", "cpu") == KeptFormats() and kept_formats("dequantize", "cpu") == KeptFormats()
    with pytest.raises(ValueError, match="quantized_weights"):
        kept_formats("fp8", "cpu")
    with pytest.raises(ValueError, match="quantized_weights"):
        EngineConfig(quantized_weights="fp8")
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(quantized_weights="keep", batch_invariant=True)


@pytest.fixture(scope="module")
def v4_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("v4")
    seeded = save_tiny_v4("mixed", root / "seeded", seed=11, hidden_size=256, head_dim=64, q_lora_rank=192,
                          o_lora_rank=64, moe_intermediate_size=64)  # fmt: skip
    return rf.write_v4_deepseek(seeded, root / "released", root / "reference")


def test_v4_loads_with_fp8_kept_and_every_kept_linear_stays_within_the_bound(v4_release: Path):
    kept = load_model(v4_release, keep=KeptFormats(fp8=True))
    dequantised = load_model(v4_release)
    plain = dict(dequantised.named_modules())
    linears = {n: m for n, m in kept.named_modules() if isinstance(m, Fp8Linear)}
    # Every released e4m3 linear the model calls (attention's, the indexer's wq_b, shared
    # experts' down) is kept; wo_a (read as a weight) and merged rows are dequantised.
    assert len(linears) == 22 and not any(n.endswith("o_a_proj") for n in linears)
    for name, m in linears.items():
        assert m.weight.dtype == torch.float8_e4m3fn
        decoded = m.weight.float() * expand_weight_scale(m.weight_scale, tuple(m.weight.shape), m.block)
        assert torch.equal(decoded, plain[name].weight), name  # the stored values, exactly
    nbytes = lambda model: sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])  # noqa: E731
    assert nbytes(dequantised) - nbytes(kept) == sum(3 * m.weight.numel() - 4 * m.weight_scale.numel()
                                                     for m in linears.values())  # fmt: skip
    seen: set[str] = set()

    def check(name: str):
        def hook(module: Fp8Linear, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            w = plain[name].weight
            err = (output.reshape(x.shape[0], -1) - x @ w.T).abs()
            assert (err <= product_bound(x, w)).all(), name
            seen.add(name)

        return hook

    for name, m in linears.items():
        m.register_forward_hook(check(name))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (40, 23)]
    PagedDriver(kept, num_seqs=2, num_blocks=64, block_size=16).step(dict(enumerate(prompts)))
    assert seen == set(linears)


@pytest.fixture(scope="module")
def gpt_oss_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gpt_oss")
    seeded = save_tiny_hf_model("gpt_oss", root / "seeded", seed=1)
    return rf.write_gpt_oss_mxfp4(seeded, root / "released", root / "reference")


def test_v4_fp4_experts_kept_packed_give_the_dequantised_logits(v4_release: Path):
    kept = load_model(v4_release, keep=KeptFormats(mxfp4=True))
    dequantised = load_model(v4_release)
    experts = [m for m in kept.modules() if isinstance(m, Experts)]
    plain = [m for m in dequantised.modules() if isinstance(m, Experts)]
    assert experts and all(m.mxfp4 and m.gate_up_blocks.dtype == torch.uint8 for m in experts)
    for m, p in zip(experts, plain):
        # Each expert's w1/w3/w2 bytes landed in its rows: decoded, the dequantised weights.
        decoded = dequantize_fp4_groups(m.gate_up_blocks, m.gate_up_scales)
        assert torch.equal(decoded, p.gate_up_proj) and torch.equal(dequantize_fp4_groups(m.down_blocks, m.down_scales), p.down_proj)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (40, 23)]
    outs = []
    for model in (kept, dequantised):
        out = PagedDriver(model, num_seqs=2, num_blocks=64, block_size=16).step(dict(enumerate(prompts)))
        outs.append(torch.cat([out[0], out[1]]))
    assert torch.equal(outs[0], outs[1])


def test_gpt_oss_with_mxfp4_kept_gives_the_dequantised_logits(gpt_oss_release: Path):
    kept = load_model(gpt_oss_release, keep=KeptFormats(mxfp4=True))
    dequantised = load_model(gpt_oss_release)
    experts = [m for m in kept.modules() if isinstance(m, Experts)]
    assert experts and all(m.mxfp4 and not hasattr(m, "gate_up_proj") for m in experts)
    plain = [m for m in dequantised.modules() if isinstance(m, Experts)]
    for m, p in zip(experts, plain):
        e, rows, cols = p.gate_up_proj.shape
        assert m.gate_up_blocks.shape == (e, rows, cols // 2) and m.gate_up_scales.shape == (e, rows, cols // 32)
        assert m.down_blocks.dtype == torch.uint8 and m.down_blocks.numel() == p.down_proj.numel() // 2
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, kept.config.vocab_size, (n,), generator=g).tolist() for n in (5, 13, 22)]
    outs = []
    for model in (kept, dequantised):
        out = PagedDriver(model, num_seqs=3, num_blocks=64, block_size=4).step(dict(enumerate(prompts)))
        outs.append(torch.cat([out[s] for s in range(3)]))
    # The same decoded weights through the same PyTorch experts: the same logits, bit for bit.
    assert torch.equal(outs[0], outs[1])
    assert math.isfinite(outs[0].abs().max().item())
