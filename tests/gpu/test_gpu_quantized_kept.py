"""Quantised weights kept quantised on a GPU (issue 27, point 1's GPU half; run alone on the
device: `python -m pytest -q --noconftest tests/gpu/test_gpu_quantized_kept.py`).

FP8 (needs capability >= 8.9): the Triton block-scaled FP8 GEMM against its PyTorch
reference on ragged shapes; a tiny DeepSeek-V4 written in DeepSeek's release format
(tools/release_formats.py: e4m3 linears, ue8m0 128 x 128 scales) loaded with FP8 kept:

- every kept linear's output, on the activations it really receives while the model
  runs, lies within the activation-rounding bound of the exact product with the
  dequantised weight (``activation_error_bound``: 2^-4 |x| + 2^-10 s per element, through
  |W|), plus the bf16 rounding of the output (2^-8 |y|) and the FP8 dot's accumulation
  (``DOT_ACCUMULATION``);
- on the same inputs, each kept linear's output equals the PyTorch reference of the FP8
  product (same codes) within the accumulation and bf16 rounding: the kernel serves what
  the math says. The logits of whole runs are not compared by a tolerance (quantisation
  is a step function: a last-bit difference upstream moves a code by a whole e4m3 step,
  and the random tiny model amplifies it: its own bf16 run is 0.50 max-relative from
  float32; FP8's per-linear ~2^-5 becomes 0.57); ``test_v4_fp8_end_to_end_distance_is_reported``
  prints the distances to the dequantised bf16 and float32 runs, and the per-linear bound
  above is the claim;
- the weights stay FP8 in memory: each kept weight is float8_e4m3fn on the GPU, and the
  model's bytes are the dequantised model's less one byte per kept weight element plus
  4 per scale, exactly.

FP4 experts (any CUDA GPU): the MXFP4 fused MoE against the fused MoE on the dequantised
weights (bitwise in float32: the decoded tile is exactly the dequantised weight and the
loops are the same; within bf16's rounding in bf16); a tiny GPT-OSS in OpenAI's release
format with the experts kept packed gives the dequantised run's logits within 1e-5 in
float32 (5e-2 in bf16), with the experts held as uint8 only; the tiny V4's FP4 experts
kept packed give its dequantised run's logits within 1e-5 in float32.
"""

import math
from pathlib import Path

import pytest
import torch

from shared.model.fp8_linear import Fp8Linear, activation_error_bound, expand_weight_scale, fp8_linear_ref
from shared.model.kept_weights import KeptFormats
from shared.model.loader import load_model
from shared.model.moe import Experts
from tests.helpers.deepseek_v4_models import save_tiny_v4
from tests.helpers.hf_models import save_tiny_hf_model
from tests.helpers.numerics import rel_err
from tests.helpers.paged_driver import PagedDriver
from tools import release_formats as rf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="FP8 needs capability >= 8.9"
)

BLOCK = (128, 128)
DOT_ACCUMULATION = 2.0**-9
"""Of sum |x||w|: what Hopper's FP8 tensor-core accumulation may lose within one group of
128 (DeepSeek-V3's report: it keeps about 14 bits; Triton leaves the whole K step of
the dot in that accumulator, and the kernel promotes to float32 after each group, as
DeepSeek's own kernels do). Generous: 128 adds at 2^-14 each would be 2^-7 worst case
only if every partial sum were the whole sum's size and every rounding one way."""
_WIDE_V4 = dict(hidden_size=256, head_dim=64, q_lora_rank=192, o_lora_rank=64, moe_intermediate_size=64)


def fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes, scale, values = rf.quantize_fp8_blocks(torch.randn(n, k, generator=g) / k**0.5, BLOCK, "ue8m0")
    return codes.cuda(), scale.float().cuda(), values.cuda()


def product_bound(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, out_rounding: float) -> torch.Tensor:
    """|FP8 product - x @ w.T| may reach: the activations' rounding through |w|, the FP8
    dot's accumulation (DOT_ACCUMULATION of sum |x||w|, the activations' rounding
    included), and the output's rounding."""
    x, w = x.float(), w.float()
    magnitude = (x.abs() * (1 + 2.0**-4)) @ w.abs().T
    return activation_error_bound(x, BLOCK[1]) @ w.abs().T + DOT_ACCUMULATION * magnitude + out_rounding * y.abs()


@needs_fp8
@pytest.mark.parametrize("m,n,k", [(1, 256, 256), (7, 300, 200), (300, 130, 384)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm_equals_its_reference_and_the_bound(m, n, k, dtype):
    from shared.model.kernels.fp8_gemm import fp8_linear

    codes, scale, values = fp8_weight(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to("cuda", dtype)
    y = fp8_linear(x, codes, scale, BLOCK)
    ref = fp8_linear_ref(x, codes, scale, BLOCK)
    assert y.dtype == dtype and y.shape == (m, n)
    # The same quantised operands: FP8 products are exact, the accumulation differs.
    out_rounding = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    magnitude = (x.float().abs() * (1 + 2.0**-4)) @ values.abs().T
    slack = 2 * out_rounding * ref.float().abs() + DOT_ACCUMULATION * magnitude + 1e-6
    assert ((y.float() - ref.float()).abs() <= slack).all(), (y.float() - ref.float()).abs().max()
    err = (y.float() - x.float() @ values.T).abs()
    assert (err <= product_bound(x, values, y, out_rounding)).all(), err.max()
    assert err.max() > 0  # the activations were quantised (a float GEMM would be exact here)


@pytest.fixture(scope="module")
def v4_release(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("v4_fp8")
    seeded = save_tiny_v4("mixed", root / "seeded", seed=11, **_WIDE_V4)
    return rf.write_v4_deepseek(seeded, root / "released", root / "reference")


def v4_logits(model, dtype: torch.dtype = torch.bfloat16, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (70, 53, 91)]
    driver = PagedDriver(model, num_seqs=len(prompts), num_blocks=256, block_size=16, kv_dtype=dtype, device="cuda")
    out = driver.step(dict(enumerate(prompts)))
    decoded = driver.step({s: [p[-1]] for s, p in enumerate(prompts)})
    return torch.cat([out[s] for s in range(len(prompts))] + [decoded[s] for s in range(len(prompts))]).float()


def kept_linears(model) -> dict[str, Fp8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


@needs_fp8
def test_v4_fp8_kept_linears_within_the_bound_while_serving(v4_release):
    kept = load_model(v4_release, dtype=torch.bfloat16, device="cuda", keep=KeptFormats(fp8=True))
    linears = kept_linears(kept)
    assert len(linears) == 22, sorted(linears)
    assert all(m._kernel is not None for m in linears.values())  # the Triton kernel serves them
    checked: dict[str, float] = {}

    def check(name: str):
        def hook(module: Fp8Linear, inputs, output) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            w = module.weight.float() * expand_weight_scale(module.weight_scale, tuple(module.weight.shape), module.block)
            y = output.reshape(-1, output.shape[-1]).float()
            # Against the dequantised weight: the activation-rounding bound.
            err = (y - x.float() @ w.T).abs()
            assert (err <= product_bound(x, w, y, 2.0**-8)).all(), f"{name}: error {err.max():.3g} past the bound"
            # Against the PyTorch reference on the same input (same codes): only the FP8
            # dot's accumulation and each side's bf16 rounding of the output.
            ref = fp8_linear_ref(x, module.weight, module.weight_scale, module.block).float()
            magnitude = (x.float().abs() * (1 + 2.0**-4)) @ w.abs().T
            slack = 2.0**-8 * (y.abs() + ref.abs()) + DOT_ACCUMULATION * magnitude
            assert ((y - ref).abs() <= slack).all(), f"{name}: {(y - ref).abs().max():.3g} from the reference"
            checked[name] = err.max().item()

        return hook

    for name, module in linears.items():
        module.register_forward_hook(check(name))
    with torch.inference_mode():
        v4_logits(kept)
    assert set(checked) == set(linears)  # every kept linear ran (prefill and a decode step)


@needs_fp8
def test_v4_fp8_end_to_end_distance_is_reported(v4_release):
    """Not a bound (see the module docstring): the logits of the kept FP8 run beside the
    dequantised bf16 run and the dequantised float32 one, printed for the record; judged
    only finite and of the same shape. On the CPU (the same model and prompts): bf16
    vs float32 0.50 max relative (mean 0.086), FP8 vs float32 0.57 (mean 0.26)."""
    with torch.inference_mode():
        served = v4_logits(load_model(v4_release, dtype=torch.bfloat16, device="cuda", keep=KeptFormats(fp8=True)))
        bf16 = v4_logits(load_model(v4_release, dtype=torch.bfloat16, device="cuda"))
        f32 = v4_logits(load_model(v4_release, dtype=torch.float32, device="cuda"), torch.float32)
    assert served.shape == bf16.shape and torch.isfinite(served).all()
    mean_rel = lambda a, b: ((a - b).abs().mean() / b.abs().mean()).item()  # noqa: E731
    print(f"\nFP8 kept vs bf16: max rel {rel_err(served, bf16):.3g}, mean rel {mean_rel(served, bf16):.3g}; "
          f"FP8 vs float32 {rel_err(served, f32):.3g} / {mean_rel(served, f32):.3g}; "
          f"bf16 vs float32 {rel_err(bf16, f32):.3g} / {mean_rel(bf16, f32):.3g}")  # fmt: skip


@needs_fp8
def test_v4_fp8_weights_stay_fp8_in_memory(v4_release):
    def model_bytes(model) -> int:
        return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])

    kept = load_model(v4_release, dtype=torch.bfloat16, device="cuda", keep=KeptFormats(fp8=True))
    dequantised = load_model(v4_release, dtype=torch.bfloat16, device="cuda")
    linears = kept_linears(kept)
    for name, m in linears.items():
        assert m.weight.dtype == torch.float8_e4m3fn and m.weight.device.type == "cuda", name
        assert m.weight.element_size() == 1 and m.weight_scale.dtype == torch.float32, name
    saved = sum(m.weight.numel() * (2 - 1) - m.weight_scale.numel() * 4 for m in linears.values())
    assert model_bytes(dequantised) - model_bytes(kept) == saved
    assert saved > 0
    # The engine's setting reaches the loader: "keep" on this GPU keeps FP8.
    from shared.engine.llm import LLM

    llm = LLM(str(v4_release), dtype="bfloat16", device="cuda", quantized_weights="keep", cuda_graphs=False)
    assert len(kept_linears(llm.engine.model)) == len(linears)


# -- MXFP4 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_mxfp4_moe_equals_the_fused_moe_on_dequantised_weights(dtype, num_tokens):
    from shared.model.kernels.fused_moe import fused_moe
    from shared.model.kernels.fused_moe_mxfp4 import fused_moe_mxfp4, fused_moe_mxfp4_ref

    g = torch.Generator().manual_seed(num_tokens)
    e, hidden, inter, k = 8, 256, 128, 2
    gu_blocks, gu_scales, gu = rf.quantize_fp4_groups(torch.randn(e, 2 * inter, hidden, generator=g) / hidden**0.5)
    dn_blocks, dn_scales, dn = rf.quantize_fp4_groups(torch.randn(e, hidden, inter, generator=g) / inter**0.5)
    packed = [t.view(torch.uint8).cuda() for t in (gu_blocks, gu_scales, dn_blocks, dn_scales)]
    x = torch.randn(num_tokens, hidden, generator=g).to("cuda", dtype)
    ids = torch.rand(num_tokens, e, generator=g).topk(k, dim=-1).indices.cuda()
    weights = torch.rand(num_tokens, k, generator=g).to("cuda", dtype)
    kw = dict(gate_up_bias=torch.randn(e, 2 * inter, generator=g).to("cuda", dtype),
              down_bias=torch.randn(e, hidden, generator=g).to("cuda", dtype), activation="gpt_oss", swiglu_limit=7.0)  # fmt: skip
    out = fused_moe_mxfp4(x, *packed, ids, weights, **kw)
    same = fused_moe(x, gu.to("cuda", dtype), dn.to("cuda", dtype), ids, weights, **kw)
    if dtype == torch.float32:
        # "ieee" float32 dots on CUDA cores, the same K loop: the same sums.
        assert torch.equal(out, same), (out - same).abs().max()
    else:
        # The same bf16 operands; the tensor-core instruction may differ (a tile from
        # registers, not shared memory), and a last-bit change before a bf16 rounding
        # moves an output by an ulp (2^-8 relative) of a value up to ~50 (GPT-OSS's gate).
        assert rel_err(out.float(), same.float()) < 1e-2, rel_err(out.float(), same.float())
    ref = fused_moe_mxfp4_ref(x, *packed, ids, weights, **kw)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert rel_err(out.float(), ref.float()) < tol


def test_v4_fp4_experts_kept_packed_equal_dequantised(v4_release):
    """DeepSeek-V4's FP4 routed experts held packed (per-expert rows of the MXFP4 buffers)
    through the MXFP4 fused MoE, float32: the dequantised run's logits within 1e-5, the
    FP8 linears dequantised in both so that only the experts differ."""
    kept = load_model(v4_release, dtype=torch.float32, device="cuda", keep=KeptFormats(mxfp4=True))
    experts = [m for m in kept.modules() if isinstance(m, Experts)]
    assert experts and all(m.mxfp4 and m.host_sync_free and m.gate_up_blocks.is_cuda for m in experts)
    assert not any(hasattr(m, "gate_up_proj") for m in experts)
    with torch.inference_mode():
        ours = v4_logits(kept, torch.float32)
        theirs = v4_logits(load_model(v4_release, dtype=torch.float32, device="cuda"), torch.float32)
    assert rel_err(ours, theirs) < 1e-5, rel_err(ours, theirs)


@pytest.fixture(scope="module")
def gpt_oss_release(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    seeded = save_tiny_hf_model("gpt_oss", root / "seeded", seed=1)
    return rf.write_gpt_oss_mxfp4(seeded, root / "released", root / "reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_mxfp4_kept_equals_dequantised(gpt_oss_release, dtype):
    kept = load_model(gpt_oss_release, dtype=dtype, device="cuda", keep=KeptFormats(mxfp4=True))
    dequantised = load_model(gpt_oss_release, dtype=dtype, device="cuda")
    experts = [m for m in kept.modules() if isinstance(m, Experts)]
    assert experts and all(m.mxfp4 and m.host_sync_free for m in experts)
    for m in experts:
        assert not hasattr(m, "gate_up_proj") and m.gate_up_blocks.dtype == torch.uint8
        assert m.gate_up_blocks.device.type == "cuda"
        e, rows, half = m.gate_up_blocks.shape
        assert m.gate_up_scales.shape == (e, rows, 2 * half // 32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, kept.config.vocab_size, (n,), generator=g).tolist() for n in (5, 13, 22)]
    outs = []
    with torch.inference_mode():
        for model in (kept, dequantised):
            driver = PagedDriver(model, num_seqs=3, num_blocks=64, block_size=4, kv_dtype=dtype, device="cuda")
            first = driver.step(dict(enumerate(prompts)))
            then = driver.step({s: [p[0]] for s, p in enumerate(prompts)})
            outs.append(torch.cat([first[s] for s in range(3)] + [then[s] for s in range(3)]).float())
    # float32: the same sums (see above), 1e-5; bf16: an ulp here and there, as between any two
    # correct bf16 kernels, which the tiny model carries to the logits: 5e-2 (the bf16 margin
    # of tests/gpu/test_gpu_deepseek_v4.py); a wrong nibble or scale moves them by O(1).
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert rel_err(outs[0], outs[1]) < tol, rel_err(outs[0], outs[1])
    # Bytes: the kept experts hold 0.5 + 1/32 byte a weight where the dequantised hold dtype's size.
    per_value = 0.5 + 1 / 32
    kept_bytes = sum(m.gate_up_blocks.numel() + m.gate_up_scales.numel() + m.down_blocks.numel() + m.down_scales.numel()
                     for m in experts)  # fmt: skip
    values = sum(2 * m.gate_up_blocks.numel() + 2 * m.down_blocks.numel() for m in experts)
    assert kept_bytes == math.ceil(values * per_value)
