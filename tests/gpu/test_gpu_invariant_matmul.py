"""The invariant matmul's M buckets on a GPU (issue 14; run on the device machine:
`python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu/test_gpu_invariant_matmul.py`).
Skipped without CUDA.

kernels/invariant_matmul.py picks a weight's tile configuration by M (decode tiles up
to DECODE_ROWS rows, prefill tiles above) and keeps its block_k, claiming a row's bits
do not change with the bucket. For each Llama-3-8B weight in bf16: the rows of an
M = 8192 call (prefill tiles) are bitwise those of calls with M = 1 .. 8192 across
every bucket edge, from row 0 and from row 5 (another place in the tile); every bucket
of the family was launched (so the test fails if the buckets collapse to one
configuration), with one BLOCK_K; and every bucket's compiled kernel issues wgmma
m64nNk16 with an fp32 accumulator and no mma.sync (the instruction family the claim
rests on; the N of each bucket is in the failure message).
"""

import re

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Before the kernel import: it imports Triton, which the CPU suite's interpreter tests
    # must import first, after setting TRITON_INTERPRET (tests/gpu is collected before them).
    pytest.skip("needs a CUDA device", allow_module_level=True)

from shared.model.kernels import invariant_matmul as im  # noqa: E402

SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
"""Llama-3-8B's weights [N, K] as the model runs them (q, k, v and gate, up stacked)."""
_EDGES = {e for n, k in SHAPES.values() for e in im.matmul_family(n, k, torch.bfloat16).edges}
ROWS = tuple(sorted({1, 2, 7, 16, 63, 64, 65, 255, 256, 257, 511, 2048, 8192} | _EDGES | {e + 1 for e in _EDGES}))
"""M of each call: every bucket edge of every weight from both sides, and the tiles' edges."""
FROM_ROW_5 = (1, 65, 129, 257, 2048)
WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16")


class LaunchSpy:
    """Stands in for the matmul kernel: records each launch's tile settings and the
    compiled kernel it ran, then launches."""

    KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")

    def __init__(self, kernel) -> None:  # noqa: ANN001
        self.kernel = kernel
        self.launches: dict[tuple[int, ...], object] = {}

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            compiled = self.kernel[grid](*args, **kwargs)
            self.launches[tuple(kwargs[k] for k in self.KEYS)] = compiled
            return compiled

        return launch


@pytest.mark.parametrize("name", list(SHAPES))
def test_rows_bitwise_equal_across_the_m_buckets(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = SHAPES[name]
    family = im.matmul_family(n, k, torch.bfloat16)
    assert len(family.configs) >= 2 and all(e in ROWS and e + 1 in ROWS for e in family.edges)
    spy = LaunchSpy(im._matmul_kernel)
    monkeypatch.setattr(im, "_matmul_kernel", spy)

    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5
    x = torch.randn(max(ROWS), k, device="cuda", dtype=torch.bfloat16, generator=g)
    full = im.invariant_matmul(x, w)
    torch.testing.assert_close(full[:64].float(), F.linear(x[:64].float(), w.float()), rtol=2e-2, atol=2e-2)
    for m in ROWS:
        out = im.invariant_matmul(x[:m], w)
        assert torch.equal(out, full[:m]), (name, m, str(family.config(m)), _differences(out, full[:m]))
    for m in FROM_ROW_5:
        out = im.invariant_matmul(x[5 : 5 + m], w)
        assert torch.equal(out, full[5 : 5 + m]), (name, 5, m, _differences(out, full[5 : 5 + m]))

    assert set(spy.launches) == {_key(c) for c in family.configs}  # every bucket ran, none other
    assert {key[2] for key in spy.launches} == {family.block_k}
    shapes: dict[str, list[int]] = {}
    for c in family.configs:
        compiled = spy.launches[_key(c)]
        assert compiled is not None, "this Triton's launch returns no compiled kernel: read its PTX another way"
        ptx = compiled.asm["ptx"]
        shapes[str(c)] = sorted({int(wgmma_n) for wgmma_n in WGMMA.findall(ptx)})
        assert shapes[str(c)] and "mma.sync" not in ptx, (name, shapes)
    print(f"{name}: wgmma N per bucket {shapes}")


def _key(c: im.MatmulConfig) -> tuple[int, ...]:
    return (c.block_m, c.block_n, c.block_k, c.group_m, c.num_warps, c.num_stages)


def _differences(a: torch.Tensor, b: torch.Tensor) -> str:
    """How two results differ: rows and elements that do, the largest difference."""
    ne = a != b
    largest = float((a.float() - b.float()).abs().max())
    return f"{int(ne.any(1).sum())} rows, {int(ne.sum())} elements differ, the largest by {largest:.3g}"
