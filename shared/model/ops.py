"""The ops table: which kernel each layer calls, chosen once when a model is built.

A layer receives an ``Ops`` and keeps the kernels it needs from it; it never asks which
table it got. A slot left None means the layer's own PyTorch code (the reference the
kernels are tested against: shared/model/kernels/reference.py). Three tables:

- PyTorch (``TORCH_OPS``): every slot None, the CPU's default;
- Triton (``triton_ops()``): shared/model/kernels, the CUDA default;
- batch-invariant (shared/model/batch_invariant.py's ``invariant_ops``, a PyTorch and
  a Triton variant), which ``build_model(..., batch_invariant=True)`` installs over the first two
  (``batch_invariant.apply``) on a Llama-family model.

``resolve_ops`` turns ``EngineConfig.kernels`` ("auto", "triton", "torch"; see
shared/model/kernels) and the device into the first two. The Triton kernel modules are
imported only when a table holding them is made (``@triton.jit`` decides at import
whether to interpret: see shared/model/kernels).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shared.model.kernels import triton_module, use_triton_kernels

Kernel = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class Ops:
    """The kernels of one table; None: the layer's PyTorch code."""

    name: str
    triton: bool
    """Whether the table's kernels are Triton's: a decode step on them can be captured in
    a CUDA graph (the PyTorch path reads run lengths on the host)."""
    gemv: Kernel | None = None
    """A ``Linear``'s row kernel ``(x, weight, bias)``: for one row (batch-1 decode), or
    every input where the kernel is marked ``any_rows``; F.linear otherwise."""
    gated_gemv: Kernel | None = None
    """The MLP's batch-1 down projection with the SiLU gate computed inside (``gated=True``)."""
    activation: Kernel | None = None
    """SiLU(gate) * up."""
    rmsnorm: Any | None = None
    """An object with ``rms_norm(x, w, eps)`` and ``fused_add_rms_norm(x, residual, w, eps)``."""
    rotary: Any | None = None
    """An object with ``rotary_embedding_and_store_kv`` (rope of q and k, k and v into the cache)."""
    attention: Any | None = None
    """An object with ``plan_triton_attention`` and ``triton_attend`` over the paged cache."""
    fused_moe: Kernel | None = None
    """The routed experts in one grouped GEMM per projection (no host sync)."""
    hyper_connection: Kernel | None = None
    """DeepSeek-V4's mHC step ``(streams, fn, base, scale, hc_eps, norm_eps, iters) ->
    (post, comb, block input)`` fused (Sinkhorn and collapse in one kernel; the mixes in
    it, or from one GEMM before it where fn is large)."""
    fp8_linear: Kernel | None = None
    """``Fp8Linear``'s product ``(x, weight e4m3, weight_scale, block)``: activations quantised
    per token per group, block-scaled FP8 GEMM (kernels/fp8_gemm.py); None: the PyTorch reference."""
    fused_moe_mxfp4: Kernel | None = None
    """The routed experts with MXFP4 weights decoded in registers (kernels/fused_moe_mxfp4.py);
    None: dequantised, then the PyTorch experts."""
    compressed_attention: Kernel | None = None
    """DeepSeek-V4's attention of query rows over their sliding window and chosen compressed
    entries, read in place from the paged caches (kernels/compressed_attention.py); None:
    the keys gathered per row, then ``compressed_batch.attend_rows``."""


TORCH_OPS = Ops("torch", triton=False)


def triton_ops() -> Ops:
    """The Triton table (imports the kernel modules)."""
    gemv = triton_module("gemv").gemv
    return Ops(
        "triton",
        triton=True,
        gemv=gemv,
        gated_gemv=gemv,
        activation=triton_module("activation").silu_and_mul,
        rmsnorm=triton_module("rmsnorm"),
        rotary=triton_module("rotary"),
        attention=triton_module("attention"),
        fused_moe=triton_module("fused_moe").fused_moe,
        hyper_connection=triton_module("hyper_connection").hyper_connection,
        fp8_linear=triton_module("fp8_gemm").fp8_linear,
        fused_moe_mxfp4=triton_module("fused_moe_mxfp4").fused_moe_mxfp4,
        compressed_attention=triton_module("compressed_attention").compressed_attention,
    )


def kernel_ops(triton: bool) -> Ops:
    return triton_ops() if triton else TORCH_OPS


def resolve_ops(kernels: str, device: torch.device | str) -> Ops:
    """The table of ``kernels`` on ``device``: "auto" is Triton on CUDA and PyTorch elsewhere."""
    return kernel_ops(use_triton_kernels(kernels, device))
