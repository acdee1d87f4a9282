"""Triton kernels for the model's hot paths, each beside a thin wrapper that checks
shapes, dtypes, strides and devices before launch and beside its PyTorch reference:

- ``paged_decode``: one query token per sequence over the paged KV cache, grouped
  query heads, sliding window, split along the sequence (flash-decoding) + a reduce.
- ``paged_prefill``: varlen (chunked) prefill over the paged cache, cached prefix
  included, causal with each sequence's offset, sliding window, one launch.
- ``rmsnorm``: RMSNorm with an optional fused residual add.
- ``rotary``: neox rotary embedding of q and k in place.
- ``activation``: SiLU(gate) * up.
- ``fused_moe``: a MoE layer's routed experts, pairs aligned by expert on the device
  and one grouped GEMM per projection (activation, biases and routing weights fused).
- ``hyper_connection``: DeepSeek-V4's mHC step (mixes, Sinkhorn, collapse) fused:
  one kernel per call, after one GEMM for the mixes where fn is large.
- ``fp8_gemm``: y = x @ W.T with W FP8 e4m3 in 128 x 128 scaled tiles, x quantised to
  FP8 per token per 128 columns (``Fp8Linear``'s product when FP8 is kept).
- ``fused_moe_mxfp4``: ``fused_moe`` with MXFP4 weights decoded in registers (GPT-OSS kept packed).
- ``compressed_attention``: DeepSeek-V4's attention of query rows over their sliding
  window and chosen compressed entries, read in place from the paged caches, with sinks.
- ``attention``: the per-forward plan and the choice between the two attention kernels.
- ``reference``: the PyTorch references, which are the model's own CPU path.

This module only resolves the one switch (``EngineConfig.kernels`` ->
``load_model(kernels=...)`` -> the model's ops table, shared/model/ops.py). It imports no kernel:
``@triton.jit`` decides at decoration time whether to interpret, so the kernel
modules are imported only when a model actually selects them (after a test has set
``TRITON_INTERPRET=1``).
"""

import importlib
import os
from types import ModuleType

import torch

KERNEL_CHOICES: tuple[str, ...] = ("auto", "triton", "torch")


def use_triton_kernels(kernels: str, device: torch.device | str) -> bool:
    """Resolve the switch: "auto" is Triton on CUDA and PyTorch elsewhere; "triton" and
    "torch" force one. "triton" off CUDA runs only under Triton's interpreter."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    device = torch.device(device)
    if kernels == "torch":
        return False
    if kernels == "auto":
        return device.type == "cuda"
    # TRITON_INTERPRET is Triton's own switch (read by triton.jit), not a setting of ours.
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"kernels='triton' needs a CUDA device (got {device}); on the CPU it runs only under "
            "Triton's interpreter (TRITON_INTERPRET=1 set before the kernels are imported). Use 'auto' or 'torch'."
        )
    return True


def triton_module(name: str) -> ModuleType:
    """The kernel module ``shared.model.kernels.<name>``, imported on first use (see above)."""
    return importlib.import_module(f"{__name__}.{name}")
