"""The fused mHC kernel (shared/model/kernels/hyper_connection.py) against the PyTorch
HyperConnection it replaces, under Triton's interpreter on the CPU, tiny shapes.

The mixing weights are drawn strong (as test_deepseek_v4_mhc.py's): comb is far from
uniform, so a kernel that cut Sinkhorn short, transposed comb or skipped the RMS would
be off by far more than the tolerance (checked beside: the one-step variant is).
TRITON_INTERPRET must be set before any kernel module is imported (see test_kernels).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from shared.model.hyper_connections import HyperConnection  # noqa: E402
from shared.model.kernels import hyper_connection as hk  # noqa: E402
from shared.model.ops import kernel_ops  # noqa: E402

if not isinstance(hk._hyper_connection_kernel, InterpretedFunction):
    raise RuntimeError("the kernel modules were imported before TRITON_INTERPRET=1 was set: they would not run on the CPU")

TOLERANCE = 1e-5


def strong(hc: int, hidden: int, iters: int, ops_triton: bool, seed: int) -> HyperConnection:
    module = HyperConnection(hidden, hc, iters, 1e-6, 1e-6, torch.device("cpu"), kernel_ops(ops_triton))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.fn.copy_(torch.randn(module.fn.shape, generator=g) / module.fn.shape[1] ** 0.5)
        module.base.copy_(torch.randn(module.base.shape, generator=g))
        module.scale.copy_(2.0 + 0.5 * torch.randn(3, generator=g))
    return module


@pytest.mark.parametrize("gemm_mixes", [False, True], ids=["one-launch", "gemm-mixes"])
@pytest.mark.parametrize("hc,hidden,dtype", [(4, 64, torch.float32), (3, 40, torch.float32), (2, 32, torch.float16),
                                             (4, 96, torch.bfloat16)])  # fmt: skip
def test_fused_mhc_equals_the_torch_reference(
    hc: int, hidden: int, dtype: torch.dtype, gemm_mixes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both of the kernel's ways: the mixes in the kernel (decode), and from a GEMM (prefill)."""
    monkeypatch.setattr(hk, "MIXES_BY_GEMM_ABOVE", 0 if gemm_mixes else 1 << 20)
    assert hc * (2 + hc) * hc * hidden <= hk.IN_KERNEL_FN_MAX  # these fn are in-kernel sized
    ref, fused = strong(hc, hidden, 20, False, seed=hc), strong(hc, hidden, 20, True, seed=hc)
    assert ref._kernel is None and fused._kernel is not None
    streams = torch.randn(7, hc, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    want, got = ref(streams), fused(streams)
    names = ("post", "comb", "block input")
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        tol = TOLERANCE if name != "block input" or dtype == torch.float32 else 1e-2
        assert (a.float() - b.float()).abs().max().item() <= tol * max(1.0, b.float().abs().max().item()), name
    if hc >= 3:
        # The weights matter: comb is far from uniform, and one Sinkhorn step is far off.
        assert (want[1] - 1 / hc).abs().max().item() > 0.1
        ref.sinkhorn_iters = 1
        assert (ref(streams)[1] - got[1]).abs().max().item() > 100 * TOLERANCE


def test_no_tokens() -> None:
    post, comb, out = strong(4, 32, 3, True, seed=0)(torch.zeros(0, 4, 32))
    assert post.shape == (0, 4) and comb.shape == (0, 4, 4) and out.shape == (0, 32)


def test_a_tiny_v4_on_the_triton_table_equals_the_torch_one(tmp_path: Path) -> None:
    """The whole model with kernels="triton" (fused mHC and fused MoE, interpreted) gives
    the PyTorch table's logits over a prefill and decode steps (strong mHC weights)."""
    from shared.model.loader import load_model
    from tests.helpers.deepseek_v4_models import save_tiny_v4
    from tests.helpers.hf_models import random_prompts
    from tests.helpers.numerics import rel_err
    from tests.helpers.paged_driver import PagedDriver

    path = save_tiny_v4("hca_first", tmp_path, seed=2, strong_mhc=True)
    models = {k: load_model(path, kernels=k) for k in ("torch", "triton")}
    assert all(layer.attn_hc._kernel is not None for layer in models["triton"].model.layers)
    drivers = {k: PagedDriver(m, 2, num_blocks=64, block_size=16, seed=1) for k, m in models.items()}
    prompts = random_prompts([20, 35], 512, seed=3)
    steps = [dict(enumerate(prompts))] + [{0: [7 + k], 1: [9 + k]} for k in range(2)]
    for step in steps:
        out = {k: d.step(step) for k, d in drivers.items()}
        for s in step:
            assert rel_err(out["triton"][s], out["torch"][s]) < 1e-4
