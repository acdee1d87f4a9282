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

Each weight runs twice: with its prefill buckets on the tile kernel, and with
``PERSISTENT_PREFILL`` on, where the buckets of its ``PERSISTENT_TILES`` run the
persistent TMA kernel (kernels/invariant_matmul_tma.py). There, besides the above, the
persistent buckets' PTX copies by TMA (cp.async.bulk.tensor), the M = 8192 rows are
bitwise those of the tile kernel's largest bucket, and an x whose rows TMA cannot
address (a row stride of K + 1 elements) falls back to the tile kernel with the same bits.
"""

import re

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Before the kernel import: it imports Triton, which the CPU suite's interpreter tests
    # must import first, after setting TRITON_INTERPRET (tests/gpu is collected before them).
    pytest.skip("needs a CUDA device", allow_module_level=True)

from collections.abc import Iterator  # noqa: E402

from shared.model.kernels import invariant_matmul as im  # noqa: E402
from shared.model.kernels import invariant_matmul_tma as tma  # noqa: E402

SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
"""Llama-3-8B's weights [N, K] as the model runs them (q, k, v and gate, up stacked)."""
_EDGES = {e for n, k in SHAPES.values() for p in (False, True) for e in im.matmul_family(n, k, torch.bfloat16, p).edges}
ROWS = tuple(sorted({1, 2, 7, 16, 63, 64, 65, 255, 256, 257, 511, 2048, 8192} | _EDGES | {e + 1 for e in _EDGES}))
"""M of each call: every bucket edge of every weight from both sides, and the tiles' edges."""
FROM_ROW_5 = (1, 65, 129, 257, 2048)
WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16")
TMA_COPY = "cp.async.bulk.tensor"


class LaunchSpy:
    """Stands in for one of the two matmul kernels: records each launch's tile settings
    (and which kernel) and the compiled kernel it ran into ``launches``, then launches."""

    KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")

    def __init__(self, kernel, persistent: bool, launches: dict[tuple, object]) -> None:  # noqa: ANN001
        self.kernel = kernel
        self.persistent = persistent
        self.launches = launches

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            compiled = self.kernel[grid](*args, **kwargs)
            subtile = kwargs.get("EPILOGUE_SUBTILE", False)
            self.launches[(*(kwargs[k] for k in self.KEYS), self.persistent, subtile)] = compiled
            return compiled

        return launch


@pytest.fixture
def persistent_prefill(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """PERSISTENT_PREFILL set to the test's parameter for its duration."""
    monkeypatch.setattr(im, "PERSISTENT_PREFILL", request.param)
    im.matmul_family.cache_clear()
    yield request.param
    monkeypatch.undo()
    im.matmul_family.cache_clear()


@pytest.mark.parametrize("persistent_prefill", [False, True], ids=["tile", "persistent"], indirect=True)
@pytest.mark.parametrize("name", list(SHAPES))
def test_rows_bitwise_equal_across_the_m_buckets(
    name: str, persistent_prefill: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    n, k = SHAPES[name]
    family = im.matmul_family(n, k, torch.bfloat16)
    assert len(family.configs) >= 2 and all(e in ROWS and e + 1 in ROWS for e in family.edges)
    assert any(c.persistent for c in family.configs) == persistent_prefill
    launches: dict[tuple, object] = {}
    monkeypatch.setattr(im, "_matmul_kernel", LaunchSpy(im._matmul_kernel, False, launches))
    monkeypatch.setattr(tma, "_persistent_kernel", LaunchSpy(tma._persistent_kernel, True, launches))

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

    assert set(launches) == {_key(c) for c in family.configs}  # every bucket ran, on its kernel, none other
    assert {key[2] for key in launches} == {family.block_k}
    shapes: dict[str, list[int]] = {}
    for c in family.configs:
        compiled = launches[_key(c)]
        assert compiled is not None, "this Triton's launch returns no compiled kernel: read its PTX another way"
        ptx = compiled.asm["ptx"]
        shapes[str(c)] = sorted({int(wgmma_n) for wgmma_n in WGMMA.findall(ptx)})
        assert shapes[str(c)] and "mma.sync" not in ptx, (name, shapes)
        assert TMA_COPY in ptx or not c.persistent, (name, str(c))  # the persistent kernel's loads are TMA's
    print(f"{name}: wgmma N per bucket {shapes}")
    if not persistent_prefill:
        return
    # The persistent rows are the tile kernel's: its largest bucket on the same x.
    tiled = im.matmul_family(n, k, torch.bfloat16, persistent=False).configs[-1]
    assert torch.equal(im.invariant_matmul(x, w, config=tiled), full), (name, str(tiled))
    # An x TMA cannot address (rows K + 1 elements apart) runs the tile kernel, same bits.
    padded = torch.zeros(max(ROWS), k + 1, device="cuda", dtype=torch.bfloat16)
    padded[:, :k] = x
    assert not tma.tma_ready(padded[:, :k])
    assert torch.equal(im.invariant_matmul(padded[:, :k], w), full), name
    last = family.configs[-1]
    assert _key(last)[:6] + (False, False) in launches  # that fallback ran the persistent tiles on the tile kernel


def _key(c: im.MatmulConfig) -> tuple:
    return (c.block_m, c.block_n, c.block_k, c.group_m, c.num_warps, c.num_stages, c.persistent, c.epilogue_subtile)


def _differences(a: torch.Tensor, b: torch.Tensor) -> str:
    """How two results differ: rows and elements that do, the largest difference."""
    ne = a != b
    largest = float((a.float() - b.float()).abs().max())
    return f"{int(ne.any(1).sum())} rows, {int(ne.sum())} elements differ, the largest by {largest:.3g}"
