"""DeepSeek-V4's compressed-attention kernel on the GPU (issue 27, point 2; run on the
device machine: `python -m pytest -q --noconftest tests/gpu/test_gpu_compressed_attention.py`).

- the kernel equals the PyTorch path it replaces (tests/helpers/compressed_attention_cases.py,
  the interpreter test's cases) in bfloat16, which the interpreter cannot run, and float32;
  tolerance of the output's scale: 2e-2 bfloat16 (the reference rounds scores and
  probabilities to bfloat16, the kernel keeps them in float32), 1e-3 float32 (TF32 is off:
  dot_precision asks for IEEE products);
- at V4-Flash's shape (64 heads of 512, a window of 128, 512 picks), an 8k prefill's rows
  of one layer: the kernel against the gathered path, and both timed (printed; the lead
  reports them).
"""

import pytest
import torch

from shared.model.kernels.compressed_attention import compressed_attention
from tools.bench.gpu_bench import _time
from tests.helpers.compressed_attention_cases import kernel_case, reference, relative_error, run_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,head_dim,picks,floor", [(4, 32, 6, False), (20, 32, 6, True), (16, 64, 0, True),
                                                        (64, 512, 37, True)])  # fmt: skip
def test_kernel_equals_the_gathered_torch_path(heads: int, head_dim: int, picks: int, floor: bool, dtype: torch.dtype) -> None:
    case = kernel_case(heads, head_dim, picks, floor, dtype, seed=heads + picks, device="cuda")
    want, got = reference(case), run_kernel(compressed_attention, case)
    assert relative_error(got, want) <= TOLERANCE[dtype]


def test_an_8k_prefill_layer_at_v4_flash_shape() -> None:
    """One CSA layer's attention for an 8k prompt's rows, in chunks of 1024 rows as the
    model's row_chunks would cut the gathered path (its keys alone are 640 x 512 a row)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, heads, dim, window, picks, block = 8192, 64, 512, 128, 512, 16
    dtype = torch.bfloat16
    state = torch.randn(rows, dim + 1024, device="cuda", generator=g, dtype=dtype)  # a CSA state row is wider
    entries = torch.randn(rows // 4, dim + 128, device="cuda", generator=g, dtype=dtype)
    tables = torch.arange(rows // block, device="cuda")[None, :]
    pos = torch.arange(rows, device="cuda")
    seq = torch.zeros_like(pos)
    # Each row's picks among its causal entries (as the indexer's top k would give).
    causal = (pos + 1) // 4
    chosen = (torch.rand(rows, picks, device="cuda", generator=g) * causal[:, None].clamp(min=1)).long()
    visible = torch.arange(picks, device="cuda")[None, :] < causal[:, None]
    q = torch.randn(rows, heads, dim, device="cuda", generator=g, dtype=dtype)
    sinks = torch.randn(heads, device="cuda", generator=g)
    scale = dim**-0.5
    case = {"query": q, "state": state, "state_tables": tables, "seq": seq, "pos": pos, "floor": None,
            "entries": entries, "picks": chosen, "visible": visible, "sinks": sinks, "scale": scale, "max_len": rows,
            "window": window, "block_size": block}  # fmt: skip

    def kernel() -> torch.Tensor:
        return run_kernel(compressed_attention, case)

    def gathered() -> torch.Tensor:
        out = torch.empty_like(q)
        for lo in range(0, rows, 1024):
            part = {**case, **{k: case[k][lo : lo + 1024] for k in ("query", "seq", "pos", "picks", "visible")}}
            out[lo : lo + 1024] = reference(part)
        return out

    assert relative_error(kernel(), gathered()) <= TOLERANCE[dtype]
    print(f"\n8k prefill, one CSA layer's attention (64 x 512, window 128, 512 picks): "
          f"kernel {_time(kernel, 1, 5) * 1e3:.2f} ms, gathered PyTorch {_time(gathered, 1, 5) * 1e3:.2f} ms")  # fmt: skip
